"""The RULER retrieval tasks of lm-evaluation-harness on one checkpoint, under one attention arm.

    flexmoba lm-eval --ckpt runs/pretrained/smollm2/model.ckpt --out runs/lm-eval/... --arm full --limit 20
    flexmoba lm-eval --ckpt ... --out ... --arm moba:512:3:10 --lengths '[4096, 8192]' --limit 20
    flexmoba lm-eval --ckpt ... --out ... --tasks '[niah_single_1]' --lengths '[4096]' --limit 2

lm-eval (0.4.13, ``pip install 'flexmoba[eval]'``) runs its own tasks on the checkpoint's GPT under the arm
(:class:`lit.experiments.lm_eval_model.FlexmobaLM`: ``full``, ``moba:CHUNK:TOPK``, ``moba:CHUNK:TOPK:N``
with the last N layers full), greedy decoding with KV caches. The tasks are RULER's that build their data
offline (a haystack of repeated sentences or of other needles, variable chains, word lists; the essay and
QA tasks need the Hugging Face hub and are refused): ``niah_single_1``, ``niah_multikey_2``,
``niah_multikey_3``, ``ruler_vt``, ``ruler_cwe``, ``ruler_fwe``. RULER sizes its prompts to each length
with a tokenizer it loads by name: the checkpoint's own, written to ``<out>/tokenizer`` (a transformers
folder) and named in the tasks' metadata, so nothing is downloaded.

One lm-eval evaluation per length, so that ``limit`` is the samples per task and length (the first
``limit`` of the 500 RULER generates per length, lm-eval's seeds). Each writes lm-eval's own output into
``<out>/<length>/``: ``results_<date>.json`` and, with ``log_samples``, ``samples_<task>_<date>.jsonl``.
``<out>/summary.json`` holds the score (RULER's string match, 0 to 1) per task and length and the wall
times; one line on stdout says the scores (lm-eval's own messages go to stderr).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lit.experiments.context_eval import Arm, machine_name
from lit.training import checks
from lit.training.errors import UsageError
from lit.training.options import parse_dataclass

LM_EVAL_VERSION = "0.4.13"
# RULER's tasks whose data lm-eval builds without downloading anything.
OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
NEEDS_HUB = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery",
             "ruler_qa_squad", "ruler_qa_hotpot", "ruler")
# What the RULER tasks import at run time (lm-eval's ruler extra, and transformers for the tokenizer).
NEEDED_MODULES = ("lm_eval", "wonderwords", "nltk", "scipy", "transformers")
SHORTEST = 256  # a prompt and the 128 tokens niah generates
VT_EXAMPLE = 500  # ruler_vt's worked example is sized to at most this many tokens (generation included)


@dataclass
class LmEvalJob:
    """What ``flexmoba lm-eval`` scores.

    Args:
        ckpt: a flexmoba checkpoint (``flexmoba import-hf``'s model.ckpt, or a run's last.ckpt) carrying its
            tokenizer.
        out: the folder for lm-eval's output per length, the tokenizer folder and summary.json; a folder that
            holds files is refused (--overwrite true replaces them).
        arm: how every layer attends: full, moba:CHUNK:TOPK, moba:CHUNK:TOPK:N (the last N layers full).
        tasks: RULER tasks that build their data offline: niah_single_1, niah_multikey_2, niah_multikey_3,
            ruler_vt, ruler_cwe, ruler_fwe.
        lengths: the prompt lengths in tokens (generation included), at most the model's context; one too short
            for a task's smallest prompt with the checkpoint's tokenizer is refused (ruler_vt needs about 1000).
        limit: samples per task and length (null: all 500 that RULER generates).
        dense_decode: generated tokens attend with full attention (MoBA prefill only; the paper's protocol).
        eos_token: the token that ends a generation: auto (the tokenizer's <|endoftext|>, </s>, ... if it has
            one), a token, or none.
        log_samples: write lm-eval's per-sample file (prompts, outputs, targets) beside its results.
        threads: torch threads (default: torch's).
        device: where the model runs (cpu, cuda, auto).
        overwrite: replace what ``out`` holds.
    """

    ckpt: str
    out: str
    arm: str = "full"
    tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "niah_multikey_2", "ruler_vt"])
    lengths: list[int] = field(default_factory=lambda: [4096, 8192])
    limit: int | None = 20
    dense_decode: bool = False
    eos_token: str = "auto"
    log_samples: bool = True
    threads: int | None = None
    device: str = "cpu"
    overwrite: bool = False


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_installed() -> None:
    """One line naming the extra when lm-eval or what its RULER tasks import is missing."""
    missing = [name for name in NEEDED_MODULES if not importable(name)]
    if missing:
        raise UsageError("lm-eval", f"{', '.join(missing)} not installed (lm-eval {LM_EVAL_VERSION} with its RULER "
                         "tasks)", "pip install 'flexmoba[eval]'")


def check_job(job: LmEvalJob, checkpoint: dict) -> Arm:
    try:
        arm = Arm.parse(job.arm)
    except UsageError as error:
        raise UsageError("--arm", error.problem, error.fix) from None
    if not job.tasks:
        raise UsageError("--tasks", "no task given", f"give some of {', '.join(OFFLINE_TASKS)}")
    for task in job.tasks:
        if task in NEEDS_HUB:
            raise UsageError("--tasks", f"{task} downloads its data from the Hugging Face hub",
                             f"give tasks that build theirs offline: {', '.join(OFFLINE_TASKS)}")
        if task not in OFFLINE_TASKS:
            raise UsageError("--tasks", f"{task!r} is not one of RULER's offline tasks",
                             f"give some of {', '.join(OFFLINE_TASKS)}")
    if not job.lengths:
        raise UsageError("--lengths", "no length given", "give e.g. [4096, 8192]")
    from flexmoba.checkpoint import checkpoint_config

    context = checkpoint_config(checkpoint).max_seq_len
    for length in job.lengths:
        if context is not None and length > context:
            raise UsageError("--lengths", f"{length} tokens exceed the model's context of {context}",
                             f"give at most {context}")
        if length < SHORTEST:
            raise UsageError("--lengths", f"{length} tokens cannot hold a RULER prompt and its 128 generated tokens",
                             f"give at least {SHORTEST}")
    if len(set(job.lengths)) != len(job.lengths):
        raise UsageError("--lengths", f"{job.lengths} repeats a length", "give each length once")
    if job.limit is not None and job.limit < 1:
        raise UsageError("--limit", f"{job.limit} samples", "give at least 1, or null for all")
    return arm


def smallest_prompt(task: str, tokenizer, length: int) -> int:
    """Tokens of the smallest prompt lm-eval 0.4.13 makes for ``task`` at ``length``, generation included.

    Its generators of ruler_vt and ruler_cwe shrink the haystack to 10 units (noise sentences, words) and
    no further, and retry forever while that does not fit ``length``: a length below this is refused before
    they start. How long that is depends on the tokenizer: with SmolLM2's, 929 tokens for ruler_vt (its worked
    example counted at its 500 at most), for ruler_cwe 491 below 4096 and 2084 from 4096 on (a denser haystack).
    0 for the other tasks, whose generators stop by themselves."""
    import random

    import numpy as np

    def tokens(text: str) -> int:
        return len(tokenizer(text).input_ids)

    state, np_state = random.getstate(), np.random.get_state()  # lm-eval seeds both again before its own draws
    try:
        if task == "ruler_vt":
            from lm_eval.tasks.ruler import vt_utils

            example = vt_utils.generate_input_output(5, 1, 4, is_icl=True)[0]  # its fewest noises
            if tokens(example) + 30 > VT_EXAMPLE:
                return 10**9  # the worked example alone never fits
            return VT_EXAMPLE + max(tokens(vt_utils.generate_input_output(10, 1, 4)[0]) for _ in range(5)) + 30
        if task == "ruler_cwe":
            from lm_eval.tasks.ruler import cwe_utils

            return max(tokens(cwe_utils.generate_input_output(10, length)[1]) for _ in range(5)) + 120
        return 0
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


def check_lengths_fit(job: LmEvalJob, tokenizer) -> None:
    for task in job.tasks:
        for length in job.lengths:
            needed = smallest_prompt(task, tokenizer, length)
            if needed > length:
                shown = "any length" if needed >= 10**9 else f"{needed} tokens or more"
                raise UsageError("--lengths", f"{length} tokens cannot hold a {task} prompt with this tokenizer "
                                 f"(it needs {shown})", f"give longer lengths, or leave {task} out")


def write_tokenizer_folder(job: LmEvalJob, checkpoint: dict, folder: Path):
    """The checkpoint's tokenizer, saved as a transformers folder (what RULER's ``AutoTokenizer.from_pretrained``
    reads)."""
    from flexmoba.checkpoint import checkpoint_tokenizer
    from lit.experiments.lm_eval_model import hf_tokenizer

    text = checkpoint_tokenizer(checkpoint)
    if text is None:
        raise UsageError("--ckpt", f"{job.ckpt} carries no tokenizer (a byte-level model?)",
                         "give a checkpoint of a token-level model, e.g. flexmoba import-hf's model.ckpt")
    if job.eos_token not in ("auto", "none"):
        from tokenizers import Tokenizer

        if Tokenizer.from_str(text).token_to_id(job.eos_token) is None:
            raise UsageError("--eos_token", f"{job.eos_token!r} is not a token of the checkpoint's tokenizer",
                             "give one of its special tokens, auto or none")
    tokenizer = hf_tokenizer(text, None if job.eos_token == "none" else job.eos_token)
    from flexmoba.checkpoint import checkpoint_config

    vocab = checkpoint_config(checkpoint).vocab_size
    if len(tokenizer) > vocab:
        raise UsageError("--ckpt", f"its tokenizer has {len(tokenizer)} tokens, more than the model's {vocab}")
    tokenizer.save_pretrained(folder)
    return tokenizer


@contextlib.contextmanager
def offline_nltk():
    """RULER's data module asks nltk to download its sentence splitter when it is imported; only the essay
    haystacks split sentences, and none of the offline tasks has one. Without the splitter installed, the
    download is skipped (nothing reaches the network) for the length of the block."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
        yield
        return
    except LookupError:
        pass
    download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        yield
    finally:
        nltk.download = download


def evaluate_length(lm, job: LmEvalJob, tokenizer_folder: Path, length: int, out: Path) -> dict:
    """One lm-eval evaluation of the tasks at ``length``, its output saved in ``out`` as lm-eval's CLI saves it."""
    import lm_eval.tasks
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker

    # RULER's folder alone: lm-eval's index of all its tasks takes seconds to build, per evaluation.
    tasks = lm_eval.tasks.TaskManager(include_path=str(Path(lm_eval.tasks.__file__).parent / "ruler"),
                                      include_defaults=False,
                                      metadata={"tokenizer": str(tokenizer_folder), "max_seq_lengths": [length]})
    tracker = EvaluationTracker(output_path=str(out / "results.json"))  # results_<date>.json in out
    model_args = {"ckpt": str(job.ckpt), "arm": job.arm, "tokenizer": str(tokenizer_folder),
                  "dense_decode": job.dense_decode, "device": job.device}
    with offline_nltk(), contextlib.redirect_stdout(sys.stderr):  # stdout carries the summary line only
        try:
            results = simple_evaluate(model=lm, model_args=model_args, tasks=list(job.tasks), limit=job.limit,
                                      log_samples=job.log_samples, evaluation_tracker=tracker, task_manager=tasks)
        except ValueError as error:  # RULER: a length that no sample fits
            if "Could not generate any sample" not in str(error):
                raise
            raise UsageError("--lengths", f"{length}: {' '.join(str(error).split())}") from None
        samples = results.pop("samples", None) if job.log_samples else None
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"] if samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    return results


def task_scores(results: dict, length: int) -> dict[str, float]:
    """RULER's score of each task at ``length`` in lm-eval's results (its metric is named after the length)."""
    return {task: metrics[f"{length},none"] for task, metrics in results["results"].items()}


def run(job: LmEvalJob) -> tuple[dict, object]:
    """Score the checkpoint; returns (the summary, the lm-eval model that was scored)."""
    check_installed()
    checkpoint = checks.checkpoint_file("--ckpt", job.ckpt)
    arm = check_job(job, checkpoint)
    device = checks.device("--device", job.device)
    out = checks.output_folder("--out", job.out, job.overwrite)
    if job.threads:
        import torch

        torch.set_num_threads(job.threads)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_folder = out / "tokenizer"
    check_lengths_fit(job, write_tokenizer_folder(job, checkpoint, tokenizer_folder))
    from lit.experiments.lm_eval_model import FlexmobaLM

    lm = FlexmobaLM(checkpoint, arm=arm.name, tokenizer=str(tokenizer_folder), device=device,
                    dense_decode=job.dense_decode)
    summary = {"settings": asdict(job), "arm": arm.name, "label": arm.label(),
               "layer_attention": lm.model.layer_attention(), "eos_token": lm.tokenizer.eos_token,
               "machine": machine_name(device), "lm_eval": LM_EVAL_VERSION, "scores": {}, "samples": {},
               "wall_s": {}}
    for length in job.lengths:
        started = time.monotonic()
        print(f"lm-eval: {arm.name} at {length} tokens: {', '.join(job.tasks)}", file=sys.stderr, flush=True)
        results = evaluate_length(lm, job, tokenizer_folder, length, out / str(length))
        for task, score in task_scores(results, length).items():
            summary["scores"].setdefault(task, {})[str(length)] = score
            summary["samples"].setdefault(task, {})[str(length)] = results["n-samples"][task]["effective"]
        summary["wall_s"][str(length)] = round(time.monotonic() - started, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary, lm


def summary_line(summary: dict, out: str) -> str:
    scores = "; ".join(f"{task} " + ", ".join(f"{length} {score:.2f}" for length, score in by_length.items())
                       for task, by_length in summary["scores"].items())
    samples = sorted({n for by_length in summary["samples"].values() for n in by_length.values()})
    return (f"lm-eval: {summary['arm']}: {scores} ({'/'.join(map(str, samples))} samples per task and length, "
            f"{sum(summary['wall_s'].values()):.0f}s); see {out}")


def main(argv: list[str] | None = None) -> dict:
    job = parse_dataclass(LmEvalJob, argv, prog="flexmoba lm-eval", description=__doc__)
    summary, _ = run(job)
    print(summary_line(summary, job.out), flush=True)
    return summary
