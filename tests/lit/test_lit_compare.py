"""The main job's code path on a tiny budget."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_compare_writes_table_and_plots(tmp_path, corpus_cache):
    args = ["--steps", "2", "--max-files", "5", "--seq-len", "128", "--batch-size", "2", "--chunk-size", "32",
            "--top-k", "2", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1",
            "--val-batches", "1", "--final-val-batches", "2", "--moba-backend", "sdpa",
            "--out", str(tmp_path), "--cache-dir", str(corpus_cache)]
    proc = subprocess.run([sys.executable, "-m", "lit.compare", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    (run_dir,) = tmp_path.glob("compare-*")
    assert str(run_dir) in proc.stdout
    table = (run_dir / "results.md").read_text()
    assert "| moba |" in table and "| full |" in table
    for png in ("val_loss.png", "loss_by_position.png"):
        assert (run_dir / png).stat().st_size > 1000
    results = json.loads((run_dir / "results.json").read_text())["results"]
    assert [r["attention"] for r in results] == ["moba", "full"]
    assert all(r["final"]["val/loss"] > 0 and len(r["val_history"]) == 2 for r in results)
