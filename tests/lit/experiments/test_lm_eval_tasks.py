"""``flexmoba lm-eval``: lm-eval's own RULER tasks score a tiny random checkpoint per task and length, offline,
and the model lm-eval called is flexmoba's GPT under the arm: its logits are load_model's with the arm's
overrides, and every continuation lm-eval recorded is that model's greedy decoding of the prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("jsonargparse")
pytest.importorskip("lm_eval")

from flexmoba.checkpoint import load_model  # noqa: E402
from lit.cli import import_hf  # noqa: E402
from lit.experiments import lm_eval_tasks  # noqa: E402
from lit.experiments.context_eval import Arm  # noqa: E402
from lit.training.errors import UsageError  # noqa: E402
from lit.training.options import parse_dataclass  # noqa: E402
from lit.training.tokenizer import train_byte_level_bpe  # noqa: E402

from tiny_llama import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ARM = "moba:32:2:1"  # MoBA in the first layer, the second full
TASKS = ["niah_single_1", "niah_multikey_2", "ruler_vt"]
LENGTHS = [1024, 1280]  # ruler_vt's worked example alone takes up to 500 tokens: with this tokenizer it needs 966
VOCAB = 512
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
LIMIT = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama with a byte-level BPE trained on RULER's phrasing (English text becomes varied tokens,
    so MoBA's choice of chunks matters) and an end-of-text token."""
    from lm_eval.tasks.ruler import niah_utils, vt_utils
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("lm_eval")
    texts = [FILLER * 20, niah_utils.TEMPLATE, "One of the special magic numbers for wise-cat is: 1234567.",
             vt_utils.TEMPLATE]
    tokenizer = train_byte_level_bpe(texts, VOCAB - 1)
    tokenizer.add_special_tokens(["<|endoftext|>"])
    source = save_tiny_llama(root / "hf", with_tokenizer=False, max_position_embeddings=2048, vocab_size=VOCAB)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(source)
    return import_hf.main(["--source", str(source), "--out", str(root / "imported")])


@pytest.fixture(scope="module")
def finished(checkpoint, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lm_eval_run") / "out"
    job = parse_dataclass(lm_eval_tasks.LmEvalJob, ["--ckpt", str(checkpoint), "--out", str(out), "--arm", ARM,
                                                    "--tasks", json.dumps(TASKS), "--lengths", json.dumps(LENGTHS),
                                                    "--limit", str(LIMIT)], prog="flexmoba lm-eval")
    summary, lm = lm_eval_tasks.run(job)
    return {"out": out, "summary": summary, "lm": lm}


def lm_eval_results(out: Path, length: int) -> dict:
    (path,) = (out / str(length)).glob("results_*.json")
    return json.loads(path.read_text())


def lm_eval_samples(out: Path, length: int, task: str) -> list[dict]:
    (path,) = (out / str(length)).glob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lm_eval_scores_every_task_at_every_length(finished):
    out, summary = finished["out"], finished["summary"]
    for length in LENGTHS:
        results = lm_eval_results(out, length)
        assert set(results["results"]) == set(TASKS)
        for task in TASKS:
            score = results["results"][task][f"{length},none"]
            assert 0.0 <= score <= 1.0
            assert results["n-samples"][task]["effective"] == LIMIT
            assert summary["scores"][task][str(length)] == score
            samples = lm_eval_samples(out, length, task)
            assert len(samples) == LIMIT and all(s["doc"]["max_length"] == length for s in samples)
        assert results["config"]["flexmoba_arm"] == ARM and results["config"]["layer_attention"] == ["moba", "full"]
    assert json.loads((out / "summary.json").read_text())["scores"] == summary["scores"]
    line = lm_eval_tasks.summary_line(summary, str(out))
    assert all(task in line for task in TASKS) and f"{LIMIT} samples per task and length" in line, line


def encoded(out: Path, text: str) -> torch.Tensor:
    """``text`` as the tokenizer RULER sized it with encodes it (the one lm-eval's model uses)."""
    from transformers import AutoTokenizer

    return torch.tensor([AutoTokenizer.from_pretrained(out / "tokenizer")(text).input_ids])


def test_the_model_lm_eval_called_is_flexmoba_under_the_arm(finished, checkpoint):
    out, lm = finished["out"], finished["lm"]
    prompt = lm_eval_samples(out, LENGTHS[0], TASKS[0])[0]["arguments"]["gen_args_0"]["arg_0"]
    tokens = encoded(out, prompt)
    assert tokens.shape[1] > 32 * 2  # longer than MoBA's chunk times top-k: the arm changes the logits
    with torch.no_grad():
        called = lm.model(tokens)
        own = load_model(checkpoint, **Arm.parse(ARM).overrides())(tokens)
        full = load_model(checkpoint, **Arm.parse("full").overrides())(tokens)
    torch.testing.assert_close(called, own, rtol=0, atol=1e-6)
    assert (called - full).abs().max() > 1e-3


def test_every_continuation_is_the_arms_greedy_decoding(finished, checkpoint):
    from transformers import AutoTokenizer

    out = finished["out"]
    model = load_model(checkpoint, **Arm.parse(ARM).overrides())
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    for task in TASKS:
        for sample in lm_eval_samples(out, LENGTHS[0], task):
            prompt, gen_kwargs = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
            new = []
            for step in model.generate_steps(encoded(out, prompt), gen_kwargs["max_gen_toks"], temperature=0.0):
                if int(step[0, 0]) == tokenizer.eos_token_id:  # the end of text ends it (RULER gives no stop string)
                    break
                new.append(int(step[0, 0]))
            assert sample["resps"] == [[tokenizer.decode(new)]], task


@pytest.mark.parametrize("args, message", [
    (["--tasks", "[niah_single_2]"], "--tasks: niah_single_2 downloads its data from the Hugging Face hub"),
    (["--tasks", "[niah_single]"], "--tasks: 'niah_single' is not one of RULER's offline tasks"),
    (["--tasks", "[ruler_vt]", "--lengths", "[900]"], "--lengths: 900 tokens cannot hold a ruler_vt prompt with "
     "this tokenizer (it needs 966 tokens or more)"),
    (["--lengths", "[4096]"], "--lengths: 4096 tokens exceed the model's context of 2048"),
    (["--arm", "moba:32"], "--arm: 'moba:32' is not an arm"),
    (["--lengths", "[1024]", "--limit", "0"], "--limit: 0 samples"),
    (["--lengths", "[1024]", "--eos_token", "<|nope|>"], "--eos_token: '<|nope|>' is not a token"),
])
def test_mistakes_are_usage_errors(args, message, checkpoint, tmp_path):
    argv = ["--ckpt", str(checkpoint), "--out", str(tmp_path / "out"), *args]
    with pytest.raises(UsageError) as error:
        lm_eval_tasks.main(argv)
    assert message in str(error.value)


WITHOUT_LM_EVAL = """
import sys

class Blocker:  # as if the eval extra were not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "lm_eval":
            raise ModuleNotFoundError("No module named 'lm_eval'", name="lm_eval")

sys.meta_path.insert(0, Blocker())
from lit.cli.main import main
main(["lm-eval", "--ckpt", sys.argv[1], "--out", sys.argv[2]])
"""


def test_without_lm_eval_one_line_names_the_extra(checkpoint, tmp_path):
    proc = subprocess.run([sys.executable, "-c", WITHOUT_LM_EVAL, str(checkpoint), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "lm_eval" in proc.stderr and "pip install 'flexmoba[eval]'" in proc.stderr, proc.stderr
