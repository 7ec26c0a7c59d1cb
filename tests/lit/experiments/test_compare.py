"""The main job's code path on a tiny budget: its report, its command line, resume and divergence."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TINY = ["--trainer.max_steps", "2", "--data.max_files", "5", "--data.seq_len", "128", "--data.batch_size", "2",
        "--model.config.moba.chunk_size", "32", "--model.config.moba.top_k", "2", "--model.config.d_model", "32",
        "--model.config.n_layers", "2", "--model.config.n_heads", "2", "--model.config.n_kv_heads", "1",
        "--model.config.moba.backend", "sdpa", "--trainer.limit_val_batches", "1", "--final_val_batches", "2",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false"]


def command(*args) -> list[str]:
    return [sys.executable, "-m", "lit.cli.main", "compare", *args]


def compare(*args, timeout=600):
    return subprocess.run(command(*args), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def loss_lines(results_md: Path) -> list[str]:
    """The report without its clock columns (train time, tokens/s) and without its folder names."""
    lines = []
    for line in results_md.read_text().splitlines():
        cells = line.split("|")
        lines.append("|".join(cells[:7] + cells[9:]) if line.startswith(("| moba |", "| full |")) and
                     len(cells) > 10 else line)
    return lines


@pytest.mark.slow
def test_compare_with_two_seeds_writes_mean_and_std_plots_and_checkpoints(tmp_path, corpus_cache):
    out = tmp_path / "study"
    proc = compare(*TINY, "--seeds", "2", "--out", str(out), "--data.cache_dir", str(corpus_cache))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert str(out / "results.md") in proc.stdout
    table = (out / "results.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| moba |")
            or line.startswith("| full |")}
    assert set(rows) == {"moba", "full"}
    assert all(" ± " in row for row in rows.values()), table
    for png in ("val_loss.png", "loss_by_position.png"):
        assert (out / png).stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())["results"]
    # each seed's two kinds back to back: the machine's drift moves both sides of a pair alike
    assert [(r["attention"], r["seed"]) for r in results] == [("moba", 1337), ("full", 1337),
                                                              ("moba", 1338), ("full", 1338)]
    assert all(r["final"]["val/loss"] > 0 and len(r["val_history"]) == 2 for r in results)
    assert all(r["tokens_per_second"] > 0 for r in results)
    losses = [r["final"]["val/loss"] for r in results if r["attention"] == "moba"]
    assert losses[0] != losses[1], "two seeds trained the same model"
    for r in results:
        assert Path(r["checkpoint"]).is_file()
        run = Path(r["checkpoint"]).parents[1]
        assert list(run.glob("csv/version_*/metrics.csv")) and list(run.glob("tb/*/events.out.tfevents.*"))


@pytest.mark.slow
def test_compare_killed_mid_run_resumes_to_the_uninterrupted_numbers(tmp_path, corpus_cache):
    budget = [*TINY, "--trainer.max_steps", "6", "--checkpoint.every_n_train_steps", "2",
              "--data.cache_dir", str(corpus_cache)]
    whole = tmp_path / "whole"
    assert compare(*budget, "--out", str(whole)).returncode == 0
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(*budget, "--out", str(killed)), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    # save_top_k=1 deletes step 2's checkpoint once step 4's lands: wait for any of them
    checkpoints = killed / "moba" / "seed1337" / "checkpoints"
    deadline = time.time() + 300
    while not list(checkpoints.glob("step*.ckpt")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(checkpoints.glob("step*.ckpt")) and not (killed / "results.md").exists(), "the kill came too late"
    resumed = compare(*budget, "--out", str(killed))
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "resuming" in resumed.stdout
    assert loss_lines(killed / "results.md") == loss_lines(whole / "results.md")


@pytest.mark.slow
def test_a_diverging_compare_stops_with_one_line_and_exit_1(tmp_path, corpus_cache):
    proc = compare(*TINY, "--trainer.max_steps", "20", "--model.lr", "1e6", "--model.warmup_steps", "1",
                   "--out", str(tmp_path / "study"), "--data.cache_dir", str(corpus_cache))
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("flexmoba: error: training diverged at step "), proc.stderr[-3000:]
    assert not (tmp_path / "study" / "results.md").exists()


def test_the_default_study_is_the_default_model_on_the_main_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    from flexmoba.model import ModelConfig
    from lit.experiments.compare import parse, run_config

    study = parse(["--out", str(tmp_path / "study")])
    run = run_config(study, "full", 1337)
    assert ModelConfig(**run["model"]["config"]) == ModelConfig(attention="full")
    assert run["trainer"]["max_steps"] == 100 and run["trainer"]["val_check_interval"] == 20
    assert run["model"]["warmup_steps"] == 10 and run["model"]["position_window"] == 256
    assert run["trainer"]["gradient_clip_val"] == 1.0 and run["seed_everything"] == 1337
    assert run["trainer"]["default_root_dir"] == str(tmp_path / "study" / "full" / "seed1337")


def test_another_study_in_the_same_folder_is_refused(tmp_path):
    out = tmp_path / "study"
    out.mkdir()
    (out / "compare.json").write_text(json.dumps({"seeds": 7}))
    proc = compare("--out", str(out), timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"flexmoba: error: --out: {out} holds a compare study with other settings")


@pytest.mark.parametrize("args, message", [
    (["--trainer.max_steps", "0"], "--trainer.max_steps: must be a positive int, got 0"),
    (["--seeds", "-1"], "--seeds: must be a positive int, got -1"),
    (["--model.config.moba.chunk_size", "0"], "--model.config.moba.chunk_size: must be >= 1, got 0"),
    (["--trainer.max_steps", "abc"], "--trainer.max_steps: must be int, got 'abc'"),
    (["--model.config.moba.top_kk", "3"], "did you mean --model.config.moba.top_k?"),
])
def test_bad_options_are_one_line_and_exit_2(args, message, tmp_path):
    proc = compare(*args, "--out", str(tmp_path / "study"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir()), "nothing may be written before the options are valid"


def test_a_corpus_that_cannot_work_is_one_line_before_anything_is_written(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.md").write_text("too short")
    out = tmp_path / "out"
    proc = compare("--data.root", str(tmp_path / "corpus"), "--data.patterns", '["*.txt"]', "--out", str(out),
                   timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("flexmoba: error: --data.patterns: ") and not out.exists()
