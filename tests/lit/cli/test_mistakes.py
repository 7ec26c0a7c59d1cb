"""Every user mistake, in every subcommand, is one line on stderr naming the option, and exit code 2.

The table runs as real processes of the command: one warm process imports it once and forks a child per
command line (``forked_commands.py``); a few run as fresh subprocesses of the installed entry point, to
show that the fork changes nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs"
DRIVER = Path(__file__).with_name("forked_commands.py")
TINY = ["--config", str(CONFIGS / "moba.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
        "--trainer.enable_progress_bar", "false"]
NO_CUDA = not torch.cuda.is_available()


def tiny(root: str, *extra: str) -> list[str]:
    return [*TINY, "--trainer.default_root_dir", root, *extra]


# gap-closed of three context-eval folders that agree (each row changes one option)
GAP = ["--before", "{evals}/before", "--moba", "{evals}/moba", "--control", "{evals}/control", "--out",
       "{empty}/gap"]
# context-eval of the tiny run with settings that fit it (each row changes one)
EVAL = ["--ckpt", "{run}/checkpoints/last.ckpt", "--out", "{empty}/eval", "--tokenizer", "{bytes}", "--arms",
        "[full]", "--seq_len", "128", "--window", "32", "--trailing", "16", "--retrieval_lengths", "[128]"]


# (command line, what the one line must say). Paths: {run} holds a trained tiny run, {empty} is a folder
# with nothing in it yet, {file} is a plain file, {junk} a file named .ckpt that is not one, {held} a
# folder that holds output, {corpus} another corpus, {missing} a path that does not exist, {words} a
# tokenizer.json of 320 tokens, {bytes} one of 256 (the tiny run's vocabulary), {evals} context-eval folders
# (write_evals), {gguf} a .gguf that is not one, {no_model_type} a folder whose config.json names no model.
MISTAKES = [
    # fit / validate / test / predict
    (["fit", *tiny("{empty}/a", "--trainer.max_step", "3")], "did you mean --trainer.max_steps?"),
    (["fit", *tiny("{empty}/a", "--model.lr", "-1")], "--model.lr: must be a positive float, got -1.0"),
    (["fit", *tiny("{empty}/a", "--model.config.moba.chunk_size", "100", "--model.config.moba.granularity", "64")],
     "--model.config.moba.granularity: granularity=64 must divide chunk_size=100"),
    (["fit", *tiny("{empty}/a", "--data.seq_len", "0")], "--data.seq_len: must be a positive int"),
    (["fit", *tiny("{empty}/a", "--data.batch_size", "0")], "--data.batch_size: must be a positive int, got 0"),
    (["fit", *tiny("{empty}/a", "--model.config.moba.backend", "flex", "--trainer.accelerator", "cpu")],
     "--model.config.moba.backend: flex cannot train on CPU (FlexAttention has no CPU backward)"),
    (["fit", *tiny("{empty}/a", "--trainer.max_steps", "-5")],
     "--trainer.max_steps: must be a positive int (or -1: no limit), got -5"),
    (["fit", *tiny("{file}")], "--trainer.default_root_dir: {file} is a file, not a folder"),
    (["fit", *tiny("{empty}/a", "--config", str(CONFIGS / "fsdp2.yaml"))],
     "--trainer.strategy.init_args.data_parallel_size: 2 x tensor_parallel_size 1 must equal the processes"),
    (["fit", *tiny("{empty}/a", "--ckpt_path", "last")], "--ckpt_path: last: nothing to resume"),
    (["fit", *tiny("{run}")], "--trainer.default_root_dir: {run} already holds a run's checkpoints"),
    (["fit", *tiny("{empty}/a", "--data.root", "{missing}")], "--data.root: root='{missing}' does not exist"),
    (["validate", *tiny("{empty}/a", "--ckpt_path", "last")], "--ckpt_path: last: nothing to resume"),
    (["validate", *tiny("{run}")], "--ckpt_path: validate without a checkpoint would score an untrained model"),
    (["test", *tiny("{run}")], "--ckpt_path: test without a checkpoint would score an untrained model"),
    (["validate", *tiny("{empty}/a", "--ckpt_path", "{missing}")], "--ckpt_path: {missing} does not exist"),
    (["validate", *tiny("{empty}/a", "--ckpt_path", "{junk}")], "--ckpt_path: {junk} is not a checkpoint"),
    (["validate", *tiny("{empty}/a", "--ckpt_path", "{run}/checkpoints/last.ckpt", "--data.root", "{corpus}")],
     "--data.root: checkpoint was trained on corpus fingerprint"),
    (["validate", *tiny("{empty}/a", "--ckpt_path", "{run}/checkpoints/last.ckpt", "--model.config.d_model", "64")],
     "holds another model (d_model 32 != 64"),
    (["predict", *tiny("{run}", "--ckpt_path", "last", "--trainer.max_steps", "x")],
     "--trainer.max_steps: must be int, got 'x'"),
    (["predict", *tiny("{run}", "--ckpt_path", "last")],
     "--predictions.output_dir: {run}/predictions already holds predictions (predictions-rank0.jsonl)"),
    # compare
    (["compare", "--step", "5", "--out", "{empty}/c"], "unrecognized arguments: --step 5; did you mean --seeds?"),
    (["compare", "--model.config.attention", "full", "--out", "{empty}/c"],
     "--model.config.attention: compare trains both kinds"),
    (["compare", "--model.config.moba.chunk_size", "100", "--model.config.moba.granularity", "64", "--out",
      "{empty}/c"], "--model.config.moba.granularity: granularity=64 must divide chunk_size=100"),
    (["compare", "--out", "{file}"], "--out: {file} is a file, not a folder"),
    (["compare", "--seeds", "0", "--out", "{empty}/c"], "--seeds: must be a positive int, got 0"),
    # generate
    (["generate", "--ckpt", "{missing}"], "--ckpt: {missing} does not exist"),
    (["generate", "--ckpt", "{junk}"], "--ckpt: {junk} is not a checkpoint"),
    (["generate", "--ckpt", "{run}"], "--ckpt: {run} is a folder; give a checkpoint file in it"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--max_new_bytes", "-1"],
     "--max_new_bytes: must be >= 0, got -1"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--max_new_tokens", "-1"],
     "--max_new_tokens: must be >= 0, got -1"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--temperature", "-0.5"],
     "--temperature: must be >= 0, got -0.5; give 0 or more (0 is greedy)"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--sample_top_k", "0"],
     "--sample_top_k: must be a positive int, got 0"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--seed", "-1"], "--seed: must be in [0, 2**63), got -1"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--dense_decode", "maybe"],
     "--dense_decode: must be bool, got 'maybe'"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--device", "abacus"],
     "--device: 'abacus' is not a device"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--temp", "0.5"], "unrecognized arguments: --temp"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--prompt", ""], "--prompt: must hold at least one"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--max_new_tokens", "5"],
     "--max_new_tokens: {run}/checkpoints/last.ckpt reads bytes, not tokens (a byte-level model); "
     "give --max_new_bytes 5 instead"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--attention", "sparse"],
     "--attention: must be one of moba, full, or null, got 'sparse'"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--sample_top_k", "many"],
     "--sample_top_k: must be int, or null, got 'many'"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--seed", "x"], "--seed: must be int, got 'x'"),
    # export-hf
    (["export-hf", "--ckpt", "{missing}", "--out", "{empty}/hf"], "--ckpt: {missing} does not exist"),
    (["export-hf", "--ckpt", "{run}/checkpoints/last.ckpt", "--out", "{held}"],
     "--out: {held} already holds output (earlier.md); pass --overwrite true to replace it"),
    (["export-hf", "--ckpt", "{run}/checkpoints/last.ckpt", "--out", "{file}"], "--out: {file} is a file"),
    # import-hf, context-eval, gap-closed
    (["import-hf", "--source", "{missing}", "--out", "{empty}/i"], "--source: {missing}: no such file or folder"),
    (["import-hf", "--source", "smollm2", "--out", "{held}"], "--out: {held} already holds output"),
    (["import-hf", "--source", "smollm2", "--out", "{file}"], "--out: {file} is a file, not a folder"),
    (["import-hf", "--source", "{file}", "--out", "{empty}/i"], "--source: {file} is a file, not a .gguf"),
    (["import-hf", "--source", "{empty}", "--out", "{empty}/i"],
     "--source: {empty}: a folder without config.json is not a transformers model"),
    (["import-hf", "--source", "{gguf}", "--out", "{empty}/i"],
     "--source: {gguf} is not a model transformers reads ("),
    (["import-hf", "--source", "{no_model_type}", "--out", "{empty}/i"],
     "--source: {no_model_type} is not a model transformers reads ("),
    (["import-hf", "--source", "smollm2", "--out", "{empty}/i", "--overwrite", "maybe"],
     "--overwrite: must be bool, got 'maybe'"),
    (["context-eval", "--ckpt", "{missing}", "--out", "{empty}/e"], "--ckpt: {missing} does not exist"),
    (["context-eval", "--ckpt", "{run}/checkpoints/last.ckpt", "--out", "{empty}/e", "--arms", "[moba:8]"],
     "--arms: 'moba:8' is not an arm; give full, moba:CHUNK:TOPK"),
    (["context-eval", "--ckpt", "{run}/checkpoints/last.ckpt", "--out", "{empty}/e"],
     "--tokenizer: {run}/checkpoints/last.ckpt carries no tokenizer"),
    (["context-eval", "--ckpt", "{run}/checkpoints/last.ckpt", "--out", "{empty}/e-words", "--tokenizer", "{words}"],
     "--tokenizer: {words} holds 320 tokens, the checkpoint's model 256 (its vocab_size); give the tokenizer"),
    (["context-eval", "--ckpt", "{run}/checkpoints/last.ckpt", "--out", "{empty}/e-bytes", "--tokenizer", "{bytes}"],
     "--arms: moba:512:3:10 makes the last 10 layers full, the checkpoint's model has 2 layers"),
    *((["context-eval", *EVAL, option, value], expected) for option, value, expected in [
        ("--window", "0", "--window: must be a positive int, got 0"),
        ("--window", "48", "--window: seq_len 128 must be a multiple of window 48"),
        ("--documents", "0", "--documents: must be a positive int, got 0"),
        ("--documents", "-2", "--documents: must be a positive int, got -2"),
        ("--trailing", "0", "--trailing: must be a positive int, got 0"),
        ("--trailing", "256", "--trailing: 256 positions exceed --seq_len 128"),
        ("--scored_windows", "[4]", "--scored_windows: [4] must be distinct window indices in [0, 4)"),
        ("--scored_windows", "[]", "--scored_windows: [] must be distinct window indices in [0, 4)"),
        ("--seq_len", "0", "--seq_len: must be a positive int, got 0"),
        ("--seq_len", "-128", "--seq_len: must be a positive int, got -128"),
        ("--retrieval_trials", "0", "--retrieval_trials: must be a positive int, got 0"),
        ("--retrieval_depths", "[0.5, 1.5]", "--retrieval_depths: 1.5 is not a share of the filler"),
        ("--retrieval_depths", "[-0.1]", "--retrieval_depths: -0.1 is not a share of the filler"),
        ("--retrieval_depths", "[]", "--retrieval_depths: empty"),
        ("--retrieval_lengths", "[0]", "--retrieval_lengths: must be positive ints, got 0"),
        ("--retrieval_lengths", "[128, -1]", "--retrieval_lengths: must be positive ints, got -1"),
        ("--split", "validation", "--split: 'validation' is not a split; give train, val or test"),
        ("--val_fraction", "1", "--val_fraction: must be in [0, 1), got 1.0"),
        ("--val_fraction", "-0.1", "--val_fraction: must be in [0, 1), got -0.1"),
        ("--test_fraction", "1.5", "--test_fraction: must be in [0, 1), got 1.5"),
        ("--test_fraction", "0.96", "--test_fraction: val_fraction 0.05 + test_fraction 0.96 must be below 1"),
        ("--threads", "0", "--threads: must be a positive int, got 0"),
        ("--threads", "-1", "--threads: must be a positive int, got -1"),
        ("--ckpt", "{missing}", "--ckpt: {missing} does not exist"),
        ("--ckpt", "{run}", "--ckpt: {run} is a folder"),
        ("--out", "{file}", "--out: {file} is a file, not a folder"),
        ("--root", "{missing}", "--root: {missing} does not exist"),
        ("--root", "{file}", "--root: {file} is a file, not a folder"),
        ("--patterns", "[]", "--patterns: empty: no file would be read"),
        ("--tokenizer", "{missing}", "--tokenizer: {missing} is not a file"),
        ("--tokenizer", "{file}", "--tokenizer: {file} is not a tokenizer.json"),
        ("--arms", "[]", "--arms: no arm given"),
        ("--arms", "[moba:0:3]", "--arms: moba:0:3: MobaSpec.chunk_size"),
        ("--device", "abacus", "--device: 'abacus' is not a device"),
        ("--overwrite", "maybe", "--overwrite: must be bool, got 'maybe'"),
    ]),
    (["gap-closed", "--before", "{empty}", "--moba", "{empty}", "--control", "{empty}", "--out", "{empty}/g"],
     "--before: {empty} holds no context-eval records"),
    *((["gap-closed", *GAP, option, value], expected) for option, value, expected in [
        ("--out", "{file}", "--out: {file} is a file, not a folder"),
        ("--out", "{held}", "--out: {held} already holds output (earlier.md); pass --overwrite true"),
        ("--before", "{missing}", "--before: {missing} does not exist"),
        ("--moba", "{file}", "--moba: {file} is a file, not a folder"),
        ("--control", "{empty}", "--control: {empty} holds no context-eval records"),
        ("--control", "{evals}/other_length", "--control: {evals}/other_length was scored at seq_len 4096, window"),
        ("--moba", "{evals}/other_documents", "--moba: {evals}/other_documents scored other documents than the"),
        ("--arm", "moba:512", "--arm: 'moba:512' is not an arm"),
        ("--arm", "full", "--arm: full is not a MoBA arm"),
        ("--arm", "moba:256:3", "--before: {evals}/before holds no position records of arm 'moba:256:3'"),
        ("--overwrite", "maybe", "--overwrite: must be bool, got 'maybe'"),
    ]),
    *(([command, "--config", "{missing}"], "--config: File does not exist: '{missing}'") for command in
      ("context-eval", "gap-closed", "generate", "import-hf")),
    (["gap-closed", "--config", "{file}"], "--config: not a YAML mapping of this command's options"),
    # retrieval
    (["retrieval", "evaluate", "--ckpt", "{missing}", "--out", "{empty}/r"], "--ckpt: {missing} does not exist"),
    (["retrieval", "evaluate", "--ckpt", "{run}/checkpoints/last.ckpt", "--out", "{held}"],
     "--out: {held} already holds output"),
    (["retrieval", "--ckpt", "{run}/checkpoints/last.ckpt"], "the subcommand is evaluate"),
    # sweep, scaling-report
    (["sweep", "{missing}"], "config: {missing} does not exist"),
    (["sweep", str(CONFIGS / "sweep" / "toy.yaml"), "--report_only"], "--report_only: no finished runs in"),
    (["sweep", str(CONFIGS / "sweep" / "toy.yaml"), "--pla"], "unrecognized arguments: --pla"),
    (["scaling-report", "--sweep_dir", "{missing}"], "--sweep_dir: no finished runs"),
    (["scaling-report", "--sweep", "{missing}"], "unrecognized arguments: --sweep"),
    (["scaling-report", "{empty}"], "--sweep_dir: {empty} is given without an option name; give --sweep_dir {empty}"),
    # continued-scaling, continued-scaling-report, lm-eval
    *((["continued-scaling", "--config", str(CONFIGS / "pretrained" / "smollm2_scaling.yaml"), "--out", "{empty}/s",
        option, value], expected) for option, value, expected in [
        ("--budgets", "[60, 30]", "--budgets: must be distinct positive step counts in ascending order"),
        ("--budgets", "[1]", "--budgets: 1 steps cannot hold both a stable phase and a decay of 20%"),
        ("--decay_fraction", "1.5", "--decay_fraction: must be between 0 and 1, got 1.5"),
        ("--arms", "[full, moba:512:3:31]", "--arms: moba:512:3:31 does not fit the model"),
        ("--arms", "[full, full]", "--arms: give distinct arms"),
        ("--eval_window", "500", "--eval_window: 500 does not divide --eval_seq_len 8192"),
        ("--eval_documents", "0", "--eval_documents: must be a positive int, got 0"),
    ]),
    (["continued-scaling", "--config", str(CONFIGS / "pretrained" / "smollm2_scaling.yaml"), "--out", "{empty}/s",
      "--model.init_from", "null"], "--model.init_from: continued training needs the pretrained checkpoint"),
    (["continued-scaling-report", "--study", "{empty}", "--out", "{empty}/r"],
     "--study: {empty} holds no continued-scaling study (no study.json)"),
    (["lm-eval", "--ckpt", "{missing}", "--out", "{empty}/lm-eval", "--limit", "many"],
     "--limit: must be int, or null, got 'many'"),
    # bench, the command itself
    (["bench", "attention", "--repeats", "1"], "--repeats: must be >= 2, got 1"),
    (["bench", "attention", "--seq_len", "128"], "unrecognized arguments: --seq_len 128; did you mean --seq_lens?"),
    (["bench", "no_such"], "no benchmark named 'no_such'"),
    (["bench", "attn"], "no benchmark named 'attn'; did you mean attention? one of attention, context_parallel,"),
    (["comprae"], "unknown subcommand 'comprae'; did you mean compare?"),
]
WITHOUT_A_GPU = [
    (["fit", *tiny("{empty}/a", "--trainer.accelerator", "gpu")],
     "--trainer.accelerator: gpu: this machine has no CUDA or MPS device"),
    (["compare", "--trainer.accelerator", "cuda", "--out", "{empty}/c"], "--trainer.accelerator: cuda: this machine"),
    (["generate", "--ckpt", "{run}/checkpoints/last.ckpt", "--device", "cuda"], "--device: cuda: this machine has no"),
    (["retrieval", "evaluate", "--ckpt", "{run}/checkpoints/last.ckpt", "--out", "{empty}/r", "--device", "cuda"],
     "--device: cuda: this machine has no CUDA device"),
]
TABLE = MISTAKES + (WITHOUT_A_GPU if NO_CUDA else [])
# Mistakes in the environment: (its variables, command line, what the one line must say), run as subprocesses.
ENVIRONMENT_MISTAKES = [
    ({"FLEXMOBA_PROGRESS_SECONDS": "soon"}, ["fit", *tiny("{empty}/progress")],
     "FLEXMOBA_PROGRESS_SECONDS: must be a number of seconds >= 0, got 'soon'; e.g. FLEXMOBA_PROGRESS_SECONDS=60"),
    ({"FLEXMOBA_PROGRESS_SECONDS": "-1"}, ["compare", "--out", "{empty}/progress-compare"],
     "FLEXMOBA_PROGRESS_SECONDS: must be a number of seconds >= 0, got '-1'"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mistakes")
    (root / "empty").mkdir()
    (root / "file").write_text("a plain file\n")
    (root / "junk.ckpt").write_text("not a checkpoint\n")
    (root / "held").mkdir()
    (root / "held" / "earlier.md").write_text("output of an earlier run\n")
    (root / "run" / "predictions").mkdir(parents=True)
    (root / "run" / "predictions" / "predictions-rank0.jsonl").write_text("{}\n")  # an earlier predict's
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(16):
        (corpus / f"module{i}.py").write_text(f"# another corpus, file {i}\n" + "x = 1\n" * 60)
    write_evals(root / "evals")
    (root / "junk.gguf").write_text("not a GGUF file\n")
    (root / "no_model_type").mkdir()
    (root / "no_model_type" / "config.json").write_text("{}\n")
    for name, size in (("words", 320), ("bytes", 256)):
        word_tokenizer(size).save(str(root / f"{name}.json"))
    return {"words": str(root / "words.json"), "bytes": str(root / "bytes.json"), "evals": str(root / "evals"),
            "gguf": str(root / "junk.gguf"), "no_model_type": str(root / "no_model_type"),
            "run": str(root / "run"), "empty": str(root / "empty"), "file": str(root / "file"),
            "junk": str(root / "junk.ckpt"), "held": str(root / "held"), "corpus": str(corpus),
            "missing": str(root / "no-such-thing"), "cwd": str(root)}


def write_evals(root: Path) -> None:
    """Context-eval folders as gap-closed reads them: before (full, moba:512:3), moba, control, and two that
    disagree with them (other_length: seq_len 4096; other_documents: one document fewer)."""
    arms = {"before": ["full", "moba:512:3"], "moba": ["moba:512:3"], "control": ["full"],
            "other_length": ["full"], "other_documents": ["moba:512:3"]}
    for name, scored in arms.items():
        (root / name).mkdir(parents=True)
        settings = {"seq_len": 4096 if name == "other_length" else 2048, "window": 1024, "trailing": 256}
        (root / name / "job.json").write_text(json.dumps(settings))
        documents = ["a.py", "b.py"] if name == "other_documents" else ["a.py", "b.py", "c.py"]
        (root / name / "records.jsonl").write_text("".join(
            json.dumps({"kind": "position", "arm": arm, "document": d, "windows": [2.0, 1.5], "trailing": 1.4}) + "\n"
            for arm in scored for d in documents))


def word_tokenizer(size: int):
    """A word-level tokenizer of ``size`` tokens (``w0`` ... ``w{size-1}``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def filled(argv: list[str], places: dict[str, str]) -> list[str]:
    return [arg.format(**places) for arg in argv]


def run_forked(commands: list[list[str]], cwd: str) -> list[dict]:
    payload = json.dumps([{"argv": argv, "cwd": cwd} for argv in commands])
    proc = subprocess.run([sys.executable, str(DRIVER)], input=payload, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def outcomes(places) -> list[dict]:
    """The tiny run the table needs, then every mistake of the table."""
    train = ["fit", *tiny(places["run"], "--trainer.max_steps", "2")]
    results = run_forked([train, *(filled(argv, places) for argv, _ in TABLE)], places["cwd"])
    assert results[0]["rc"] == 0, results[0]["stderr"][-3000:]
    return results[1:]


def assert_one_line_error(rc: int, stderr: str, expected: str) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    assert rc == 2 and stderr.count("\n") == 1 and stderr.startswith("flexmoba: error: "), (rc, stderr[-3000:])
    assert expected in stderr, stderr


def test_the_table_covers_every_subcommand():
    from lit.cli.main import SUBCOMMANDS

    assert len(TABLE) >= 30
    assert {argv[0] for argv, _ in TABLE} >= set(SUBCOMMANDS)


# The subcommands whose every option that takes a value has a row of its own (a number: a value of the right
# type that is refused, zero, negative or out of range; a path or a choice: any refused value).
EVERY_OPTION = ("context-eval", "gap-closed", "generate", "import-hf")


def job_parser(command: str):
    """The job dataclass of ``command``'s module and the parser ``flexmoba <command>`` parses it with."""
    import importlib
    from dataclasses import is_dataclass

    from lit.cli.main import SUBCOMMANDS
    from lit.training.options import dataclass_parser

    module = importlib.import_module(SUBCOMMANDS[command][0])
    jobs = [value for value in vars(module).values() if isinstance(value, type) and is_dataclass(value)
            and value.__module__ == module.__name__ and value.__name__.endswith("Job")]
    assert len(jobs) == 1, (command, jobs)
    return jobs[0], dataclass_parser(jobs[0], prog=f"flexmoba {command}")


def value_kind(job: type, option: str) -> str:
    """``number``, ``choice`` (a bool, a Literal) or ``path or choice`` (any other str), by the field's type."""
    import typing

    if option == "--config":
        return "path or choice"
    hint = typing.get_type_hints(job)[option.removeprefix("--")]
    while typing.get_origin(hint) in (typing.Union, list, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint is bool or typing.get_origin(hint) is typing.Literal:
        return "choice"
    return "number" if hint in (int, float) else "path or choice"


def is_number(value: str) -> bool:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return False
    return all(isinstance(v, int | float) and not isinstance(v, bool)
               for v in (parsed if isinstance(parsed, list) else [parsed]))


def rows_of(command: str, option: str) -> list[str]:
    """The values the table's rows refuse for ``option`` of ``command`` (rows whose line starts with it)."""
    values = []
    for argv, expected in MISTAKES + WITHOUT_A_GPU:
        if argv[0] == command and expected.startswith(f"{option}:") and option in argv:
            values.append(argv[len(argv) - 1 - argv[::-1].index(option) + 1])
    return values


@pytest.mark.parametrize("command", EVERY_OPTION)
def test_every_option_that_takes_a_number_a_path_or_a_choice_has_a_row(command):
    job, parser = job_parser(command)
    options = [action.option_strings[0] for action in parser._actions  # not --arms+, the list's append form
               if action.option_strings and action.nargs != 0 and action.dest not in ("help", "print_config")]
    assert {f"--{name}" for name in job.__dataclass_fields__} <= set(options)
    missing = []
    for option in options:
        kind = value_kind(job, option)
        values = rows_of(command, option)
        if not values or (kind == "number" and not any(map(is_number, values))):
            missing.append(f"{option} ({kind})")
    assert not missing, f"flexmoba {command}: no row refusing a value of {', '.join(missing)}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(TABLE)), ids=[" ".join(argv[:3]) for argv, _ in TABLE])
def test_a_mistake_is_one_line_and_exit_2(index, outcomes, places):
    argv, expected = TABLE[index]
    outcome = outcomes[index]
    assert_one_line_error(outcome["rc"], outcome["stderr"], expected.format(**places))


@pytest.mark.slow
@pytest.mark.parametrize("argv, expected", [
    (["fit", *TINY, "--trainer.default_root_dir", "{empty}/fresh", "--ckpt_path", "last"],
     "--ckpt_path: last: nothing to resume"),
    (["generate", "--ckpt", "{missing}"], "--ckpt: {missing} does not exist"),
], ids=["fit", "generate"])
def test_the_installed_command_says_the_same(argv, expected, places):
    proc = subprocess.run([sys.executable, "-m", "lit.cli.main", *filled(argv, places)], cwd=places["cwd"],
                          capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc.returncode, proc.stderr, expected.format(**places))


@pytest.mark.slow
@pytest.mark.parametrize("variables, argv, expected", ENVIRONMENT_MISTAKES,
                         ids=[" ".join(argv[:1] + [f"{k}={v}" for k, v in variables.items()])
                              for variables, argv, _ in ENVIRONMENT_MISTAKES])
def test_a_mistake_in_the_environment_is_one_line_and_exit_2_before_anything_is_written(variables, argv, expected,
                                                                                        places):
    import os

    proc = subprocess.run([sys.executable, "-m", "lit.cli.main", *filled(argv, places)], cwd=places["cwd"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **variables})
    assert_one_line_error(proc.returncode, proc.stderr, expected.format(**places))
    assert not any(Path(arg.format(**places)).exists() for arg in argv if arg.startswith("{empty}/"))
