"""``flexmoba import-hf``: a pretrained Llama becomes a flexmoba checkpoint that trains, exports and imports
back exactly; what cannot be imported or trained as asked is one line and exit code 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lightning")

from conftest import flexmoba_command  # noqa: E402
from test_mistakes import assert_one_line_error, run_forked  # noqa: E402

from flexmoba.checkpoint import load_model, read_checkpoint  # noqa: E402
from lit.cli import export_hf, import_hf  # noqa: E402
from lit.training.module import LitLM  # noqa: E402

from tiny_llama import VOCAB, save_tiny_llama, word_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama folder with a tokenizer, its import, and a fit config of the same architecture."""
    root = tmp_path_factory.mktemp("import")
    folder = save_tiny_llama(root / "hf", tie_word_embeddings=False)
    checkpoint = import_hf.main(["--source", str(folder), "--out", str(root / "imported")])
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(16):
        (corpus / f"doc{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % VOCAB}" for j in range(400)))
    config = {
        "trainer": {"max_steps": 2, "limit_val_batches": 1, "val_check_interval": 2, "enable_progress_bar": False,
                    "enable_model_summary": False, "num_sanity_val_steps": 0},
        "model": {"init_from": str(checkpoint), "lr": 1e-4, "warmup_steps": 1, "position_window": 32,
                  "trailing_window": 32, "config": {
                      "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "head_dim": 12, "mlp_hidden": 56,
                      "tie_embeddings": False, "rope_base": 50000.0, "norm_eps": 1e-6, "max_seq_len": 256,
                      "moba": {"chunk_size": 16, "top_k": 2, "backend": "sdpa"}}},
        "data": {"class_path": "lit.training.tokenizer.TokenFilesData", "init_args": {
            "root": str(corpus), "patterns": ["*.txt"], "seq_len": 64, "batch_size": 2, "val_fraction": 0.3,
            "tokenizer": str(root / "imported" / "tokenizer.json"), "cache_dir": str(root / "cache")}},
    }
    (root / "fit.json").write_text(json.dumps(config))
    word_tokenizer(VOCAB).save(str(root / "same_size_other.json"))
    other = json.loads((root / "same_size_other.json").read_text())
    other["model"]["vocab"] = {f"v{i}": i for i in range(VOCAB)}  # as many tokens, other ids
    (root / "other_tokenizer.json").write_text(json.dumps(other))
    return {"root": root, "folder": folder, "checkpoint": checkpoint, "fit": root / "fit.json"}


def test_the_import_computes_transformers_logits_and_carries_the_tokenizer(imported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load_model(imported["checkpoint"])
    llama = AutoModelForCausalLM.from_pretrained(imported["folder"], dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), llama(tokens).logits, atol=1e-4, rtol=0)
    written = (imported["root"] / "imported" / "tokenizer.json").read_text()
    theirs = AutoTokenizer.from_pretrained(imported["folder"]).backend_tokenizer.to_str()
    assert json.loads(written) == json.loads(theirs)


def test_an_import_into_a_log_is_its_closing_line_alone(imported, tmp_path):
    proc = subprocess.run([*flexmoba_command(), "import-hf", "--source", str(imported["folder"]), "--out",
                           str(tmp_path / "again")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    out = tmp_path / "again"
    (line,) = proc.stdout.splitlines()
    assert re.fullmatch(rf"flexmoba: import-hf done: [\d,]+ parameters, context 256, vocabulary {VOCAB}; "
                        rf"checkpoint {out / 'model.ckpt'}; tokenizer {out / 'tokenizer.json'}", line), line


def test_the_gguf_reader_s_own_progress_bar_is_off_while_importing(capsys):
    gguf_reader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    with import_hf.no_gguf_progress_bar():
        list(gguf_reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert capsys.readouterr().err == ""
    list(gguf_reader.tqdm(range(3), desc="drawn again"))  # and back on after
    assert "drawn again" in capsys.readouterr().err


def test_import_export_hf_import_round_trips_exactly(imported, tmp_path):
    exported = export_hf.main(["--ckpt", str(imported["checkpoint"]), "--out", str(tmp_path / "hf")])
    assert json.loads((exported / "config.json").read_text())["max_position_embeddings"] == 256
    again = import_hf.main(["--source", str(exported), "--out", str(tmp_path / "again")])
    first, second = read_checkpoint(imported["checkpoint"]), read_checkpoint(again)
    assert first["hyper_parameters"]["config"] == second["hyper_parameters"]["config"]
    a, b = first["state_dict"], second["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads(first["tokenizer"]["tokenizer_json"]) == json.loads(second["tokenizer"]["tokenizer_json"])


def test_init_from_starts_the_model_from_the_imported_weights(imported):
    config = json.loads(imported["fit"].read_text())["model"]
    module = LitLM(config["config"] | {"vocab_size": VOCAB}, seq_len=64, init_from=str(imported["checkpoint"]),
                   position_window=32, trailing_window=32)
    saved = load_model(imported["checkpoint"]).state_dict()
    assert all(torch.equal(module.model.state_dict()[k], saved[k]) for k in saved)


@pytest.mark.slow
def test_what_cannot_be_imported_or_trained_as_asked_is_one_line(imported, tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path / "gpt2")
    fit = ["fit", "--config", str(imported["fit"])]
    root = imported["root"]
    cases = [
        (["import-hf", "--source", str(tmp_path / "gpt2"), "--out", str(tmp_path / "x")],
         "--source: model_type='gpt2': only llama, "),
        (["import-hf", "--source", "no_such_model", "--out", str(tmp_path / "y")], "--source: no_such_model: no such"),
        ([*fit, "--trainer.default_root_dir", str(tmp_path / "a"), "--model.config.norm_eps", "1e-5"],
         "--model.init_from: " + str(imported["checkpoint"]) + " holds another architecture (norm_eps 1e-06 != 1e-05)"),
        ([*fit, "--trainer.default_root_dir", str(tmp_path / "b"), "--data.init_args.tokenizer",
          str(root / "other_tokenizer.json")], "--data.tokenizer: " + str(root / "other_tokenizer.json")
         + " is not the tokenizer the weights of"),
        ([*fit, "--trainer.default_root_dir", str(tmp_path / "c"), "--data.init_args.seq_len", "512"],
         "--data.seq_len: 512 tokens exceed the model's context of 256"),
        (["context-eval", "--ckpt", str(imported["checkpoint"]), "--out", str(tmp_path / "e"), "--seq_len", "512"],
         "--seq_len: 512 tokens exceed the model's context of 256"),
    ]
    results = run_forked([argv for argv, _ in cases], str(tmp_path))
    for (_, expected), outcome in zip(cases, results, strict=True):
        assert_one_line_error(outcome["rc"], outcome["stderr"], expected)


@pytest.mark.slow
def test_a_fit_from_the_imported_weights_validates_without_a_checkpoint(imported, tmp_path):
    root = str(tmp_path / "run")
    [validate, fit] = run_forked([
        ["validate", "--config", str(imported["fit"]), "--trainer.default_root_dir", root],
        ["fit", "--config", str(imported["fit"]), "--trainer.default_root_dir", root],
    ], str(tmp_path))
    assert validate["rc"] == 0 and "val/loss" in validate["stdout"] + validate["stderr"], validate["stderr"][-2000:]
    assert fit["rc"] == 0, fit["stderr"][-2000:]
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    from lit.experiments import context_eval

    summary = context_eval.main([  # the run's checkpoint carries its data's tokenizer
        "--ckpt", str(tmp_path / "run" / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "eval"),
        "--arms", "[full]", "--seq_len", "64", "--window", "32", "--trailing", "16", "--documents", "2",
        "--root", str(imported["root"] / "corpus"), "--patterns", '["*.txt"]', "--test_fraction", "0.5",
        "--retrieval_lengths", "[]"])
    assert len(summary["documents"]) == 2


def test_generate_continues_an_imported_model_with_its_tokenizer(imported, capsys):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from lit.cli import generate

    generate.main(["--ckpt", str(imported["checkpoint"]), "--prompt", "w5 w17 w99", "--max_new_tokens", "6"])
    printed = capsys.readouterr().out
    llama = AutoModelForCausalLM.from_pretrained(imported["folder"], dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 17, 99]])
    with torch.no_grad():
        for _ in range(6):  # greedy decoding by transformers' own forward
            tokens = torch.cat([tokens, llama(tokens).logits[:, -1:].argmax(-1)], dim=1)
    tokenizer = Tokenizer.from_file(str(imported["root"] / "imported" / "tokenizer.json"))
    assert printed == "w5 w17 w99" + tokenizer.decode(tokens[0, 3:].tolist()) + "\n"


def fit_command(imported, root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lit.cli.main", "fit", "--config", str(imported["fit"]), "--trainer.default_root_dir",
            str(root), "--trainer.max_steps", "6", "--checkpoint.every_n_train_steps", "2",
            "--checkpoint.save_top_k", "-1", "--trainer.val_check_interval", "6", *extra]


def last_logged(root: Path) -> dict[str, tuple[str, str]]:
    """The last (step, value) of every metric over the run's CSV logs, resumed sessions included."""
    import csv

    values = {}
    for path in sorted(root.glob("csv/version_*/metrics.csv")):
        for row in csv.DictReader(path.open()):
            values.update({k: (row["step"], v) for k, v in row.items() if v and k.startswith(("train/loss", "val/"))})
    return values


@pytest.mark.slow
def test_continued_training_killed_mid_run_resumes_to_the_same_numbers(imported, tmp_path):
    import signal
    import subprocess
    import time

    uninterrupted = subprocess.run(fit_command(imported, tmp_path / "whole"), capture_output=True, text=True,
                                   timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]
    killed = subprocess.Popen(fit_command(imported, tmp_path / "killed"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (tmp_path / "killed" / "checkpoints" / "step000002.ckpt").exists() and killed.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    resumed = subprocess.run(fit_command(imported, tmp_path / "killed", "--ckpt_path", "last"), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole, again = last_logged(tmp_path / "whole"), last_logged(tmp_path / "killed")
    assert whole.keys() == again.keys() and "val/loss" in whole
    for key, (step, value) in whole.items():
        assert again[key][0] == step and float(again[key][1]) == pytest.approx(float(value), rel=1e-6), key
