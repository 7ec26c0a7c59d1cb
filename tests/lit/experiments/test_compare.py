"""The main job's code path on a tiny budget, and its command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TINY = ["--steps", "2", "--max_files", "5", "--seq_len", "128", "--batch_size", "2",
        "--model.moba_chunk_size", "32", "--model.moba_top_k", "2", "--model.d_model", "32", "--model.n_layers", "2",
        "--model.n_heads", "2", "--model.n_kv_heads", "1", "--model.moba_backend", "sdpa",
        "--val_batches", "1", "--final_val_batches", "2"]


def compare(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "lit.experiments.compare", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_compare_with_two_seeds_writes_mean_and_std_plots_and_checkpoints(tmp_path, corpus_cache):
    proc = compare(*TINY, "--seeds", "2", "--out", str(tmp_path), "--cache_dir", str(corpus_cache))
    assert proc.returncode == 0, proc.stderr[-5000:]
    (run_dir,) = tmp_path.glob("compare-*")
    assert str(run_dir) in proc.stdout
    table = (run_dir / "results.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| moba |")
            or line.startswith("| full |")}
    assert set(rows) == {"moba", "full"}
    assert all(" ± " in row for row in rows.values()), table
    for png in ("val_loss.png", "loss_by_position.png"):
        assert (run_dir / png).stat().st_size > 1000
    results = json.loads((run_dir / "results.json").read_text())["results"]
    assert [(r["attention"], r["seed"]) for r in results] == [("moba", 1337), ("moba", 1338),
                                                              ("full", 1337), ("full", 1338)]
    assert all(r["final"]["val/loss"] > 0 and len(r["val_history"]) == 2 for r in results)
    losses = [r["final"]["val/loss"] for r in results if r["attention"] == "moba"]
    assert losses[0] != losses[1], "two seeds trained the same model"
    for r in results:
        assert Path(r["checkpoint"]).is_file()
        run = Path(r["checkpoint"]).parent
        assert (run / "csv" / "metrics.csv").is_file() and list((run / "tb").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be a positive int, got 0"),
    (["--seeds", "-1"], "--seeds must be a positive int, got -1"),
    (["--model.moba_chunk_size", "0"], "moba_chunk_size must be a positive int"),
    (["--steps", "abc"], 'Parser key "steps"'),
    (["--model.moba_top_kk", "3"], "did you mean --model.moba_top_k?"),
])
def test_bad_options_are_one_line_and_exit_2(args, message, tmp_path):
    proc = compare(*args, "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written before the options are valid"


def test_a_corpus_that_cannot_work_is_one_line_before_anything_is_written(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.md").write_text("too short")
    out = tmp_path / "out"
    proc = compare("--root", str(tmp_path / "corpus"), "--patterns", '["*.txt"]', "--out", str(out), timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("flexmoba compare: error: --patterns: ") and not out.exists()
