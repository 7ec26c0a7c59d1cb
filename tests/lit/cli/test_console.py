"""What a newcomer sees: a tiny fit and a tiny compare print no banner, tip or warning, and end with one
line naming the result, the checkpoint and the logs; a resume past a truncated last.ckpt leaves an
intact last.ckpt where generate looks; retrieval evaluate reads compare's checkpoints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs"
# What Lightning and torch print unasked, as a newcomer reported it.
NOISE = ["GPU available", "TPU available", "HPU available", "litlogger", "Tip:", "LeafSpec", "is deprecated",
         "weights_only", "exists and is not empty", "Total FLOPs", "Epoch 0/-2", "/-2", "Traceback"]
PYTHON_WARNING = re.compile(r"\.py:\d+: ")  # how warnings.warn shows where it came from
TINY_COMPARE = ["--trainer.max_steps", "2", "--data.max_files", "5", "--data.seq_len", "128",
                "--data.batch_size", "2", "--model.config.moba.chunk_size", "32", "--model.config.moba.top_k", "2",
                "--model.config.d_model", "32", "--model.config.n_layers", "2", "--model.config.n_heads", "2",
                "--model.config.n_kv_heads", "1", "--model.config.moba.backend", "sdpa",
                "--trainer.limit_val_batches", "1", "--final_val_batches", "2"]


def flexmoba(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The command as a user runs it: a fresh process, warnings at Python's defaults."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-m", "lit.cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def assert_quiet(proc: subprocess.CompletedProcess) -> None:
    console = proc.stdout + proc.stderr
    heard = [word for word in NOISE if word in console]
    assert not heard, (heard, console[-5000:])
    assert not PYTHON_WARNING.search(console), console[-5000:]


def last_line(proc: subprocess.CompletedProcess, stream: str = "stderr") -> str:
    return getattr(proc, stream).strip().splitlines()[-1]


def tiny_fit(root: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(CONFIGS / "moba.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
            "--trainer.default_root_dir", str(root), "--trainer.enable_model_summary", "true", *extra]


@pytest.mark.slow
def test_a_tiny_fit_says_only_what_matters_and_ends_with_where_everything_is(tmp_path):
    root = tmp_path / "run"
    proc = flexmoba(*tiny_fit(root), cwd=tmp_path)
    assert_quiet(proc)
    summary = last_line(proc)
    assert summary.startswith("flexmoba: fit done at step 6") and re.search(r"val/loss \d\.\d{4}", summary), summary
    assert f"checkpoint {root / 'checkpoints' / 'last.ckpt'}" in summary, summary
    assert f"logs {root / 'csv' / 'version_0'}" in summary and str(root / "tb") in summary, summary
    assert (root / "checkpoints" / "last.ckpt").is_file() and (root / "csv" / "version_0" / "metrics.csv").is_file()
    assert "step" in proc.stdout and "6/6" in proc.stdout, proc.stdout  # the bar counts steps to max_steps


@pytest.mark.slow
def test_a_resume_past_a_truncated_last_ckpt_writes_a_whole_one_in_its_place(tmp_path):
    root = tmp_path / "run"
    flexmoba(*tiny_fit(root), cwd=tmp_path)
    last = root / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])  # as if the machine died while it was written
    proc = flexmoba(*tiny_fit(root, "--trainer.max_steps", "9", "--ckpt_path", "last"), cwd=tmp_path)
    assert_quiet(proc)
    assert "skipped unreadable last.ckpt (moved to last.ckpt.unreadable); using step000006.ckpt" in proc.stderr
    assert last_line(proc).startswith(f"flexmoba: fit done at step 9 (from {root / 'checkpoints'}")
    assert zipfile.ZipFile(last).testzip() is None, "last.ckpt is still the truncated one"
    names = {p.name for p in (root / "checkpoints").iterdir()}
    assert {"last.ckpt", "last.ckpt.unreadable", "step000009.ckpt"} <= names and "last-v1.ckpt" not in names, names
    generated = flexmoba("generate", "--ckpt", str(last), "--max_new_bytes", "4", cwd=tmp_path)
    assert generated.stdout.startswith("def ") and not generated.stderr, generated.stderr


@pytest.fixture(scope="module")
def tiny_compare(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("compare")
    out = folder / "study"
    return out, flexmoba("compare", *TINY_COMPARE, "--out", str(out), cwd=folder)


@pytest.mark.slow
def test_a_tiny_compare_says_only_what_matters_and_ends_with_where_everything_is(tiny_compare):
    out, proc = tiny_compare
    assert_quiet(proc)
    summary = last_line(proc, "stdout")
    results = json.loads((out / "results.json").read_text())["results"]
    for attention in ("moba", "full"):
        loss = next(r["final"]["val/loss"] for r in results if r["attention"] == attention)
        assert f"{attention} {loss:.4f}" in summary, summary
    assert summary.startswith("flexmoba: compare done: val/loss") and f"report {out / 'results.md'}" in summary
    assert f"checkpoints {out}/<attention>/seed<N>/checkpoints/last.ckpt" in summary, summary
    assert f"logs {out}/<attention>/seed<N>/csv, tb" in summary, summary


@pytest.mark.slow
def test_retrieval_evaluate_reads_a_compare_checkpoint(tiny_compare, tmp_path):
    out, _ = tiny_compare
    checkpoint = out / "moba" / "seed1337" / "checkpoints" / "last.ckpt"
    proc = flexmoba("retrieval", "evaluate", "--ckpt", str(checkpoint), "--out", str(tmp_path / "eval"),
                    "--samples", "2", cwd=tmp_path)
    rows = json.loads((tmp_path / "eval" / "retrieval.json").read_text())
    # a compare run trains on 128-byte text: the task at its length, shorter lengths where the task fits
    assert sorted({r["length"] for r in rows}) == [64, 128], rows
    assert all(0 <= r["accuracy"] <= 1 and r["samples"] == 2 for r in rows)
    assert "wrote " in proc.stdout and not proc.stderr, proc.stderr
