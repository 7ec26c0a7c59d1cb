"""The main job's code path on a tiny budget: its report, its command line, resume and divergence."""

import json
import os
import re
import shlex
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
    """The report without its clock columns (train time, tokens/s), the machine's load and its folder names."""
    lines = []
    for line in results_md.read_text().splitlines():
        line = re.sub(r" (1-minute load average|The machine's load) .*$", "", line)
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


# -- what a study says it did --------------------------------------------------------------------------------

# MoBA that cannot be sparse (chunk_size 64 x top_k 2 = 128 = seq_len), a capped corpus whose validation split
# is one 482-byte file (3 sequences: one batch, far below the 32 asked for), a progress line every step, 2 steps
# where the logs come every 10.
SMALL_VAL = ["--trainer.max_steps", "2", "--data.seq_len", "128", "--data.batch_size", "4", "--data.max_files", "8",
             "--data.patterns", '["*.txt"]', "--model.config.moba.chunk_size", "64", "--model.config.moba.top_k", "2",
             "--model.config.d_model", "32", "--model.config.n_layers", "2", "--model.config.n_heads", "2",
             "--model.config.n_kv_heads", "1", "--model.config.moba.backend", "sdpa",
             "--trainer.limit_val_batches", "8", "--final_val_batches", "32", "--trainer.enable_progress_bar", "false"]
NOT_SPARSE = ("flexmoba: note: MoBA at seq_len 128 with chunk_size 64 × top_k 2 attends every earlier key (equals "
              "full attention); lower chunk_size or top_k to make it sparse")


def corpus_with_one_small_val_file(root: Path, train_files: int = 30) -> Path:
    """``train_files`` files of 2,000 bytes that hash into the train split and one of 482 bytes that hashes into
    val (none into test): the validation split holds 3 sequences of 128 bytes."""
    import numpy as np

    from lit.training.data import split_of

    root.mkdir()
    rng = np.random.default_rng(0)
    wanted = {"train": (train_files, 2000), "val": (1, 482), "test": (0, 0)}
    written = {split: 0 for split in wanted}
    for i in range(10_000):
        name = f"doc{i:04d}.txt"
        split = split_of(name, 0.05, 0.05)
        count, size = wanted[split]
        if written[split] < count:
            (root / name).write_bytes(rng.integers(32, 127, size, dtype=np.uint8).tobytes())
            written[split] += 1
        if all(written[s] == wanted[s][0] for s in wanted):
            return root
    raise AssertionError(f"no names hashed into every split: {written}")


@pytest.fixture(scope="module")
def small_val_study(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("small-val")
    corpus = corpus_with_one_small_val_file(folder / "corpus")
    out = folder / "study"
    proc = subprocess.run(command(*SMALL_VAL, "--data.root", str(corpus), "--data.cache_dir", str(folder / "cache"),
                                  "--out", str(out)), cwd=REPO, capture_output=True, encoding="utf-8", timeout=600,
                          env={**os.environ, "FLEXMOBA_PROGRESS_SECONDS": "0"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    return corpus, out, proc


@pytest.mark.slow
def test_the_report_counts_what_the_final_validation_read_not_the_limit(small_val_study):
    _, out, proc = small_val_study
    report = (out / "results.md").read_text()
    assert "32 batches" not in report and "8 batches" not in report, report
    assert ("Final validation read 1 batch, 3 sequences, 384 tokens per run (all the validation split holds: fewer "
            "than --final_val_batches 32)") in report, report
    closing = proc.stdout.strip().splitlines()[-1]
    assert closing.startswith("flexmoba: compare done: ") and "(1 batch, 3 sequences, 384 tokens)" in closing, closing
    read = {"batches": 1, "sequences": 3, "tokens": 3 * 128}  # the split's one file: what the validation can read
    results = json.loads((out / "results.json").read_text())["results"]
    assert [r["final_validation"] for r in results] == [read, read], results
    assert [r["validation_during_fit"] for r in results] == [read, read], results
    assert [r["train_tokens"] for r in results] == [2 * 4 * 128] * 2, results  # 2 steps x 4 sequences x 128 bytes
    assert all(r["tokens_per_second"] > 0 and r["train_seconds"] > 0 for r in results), results


@pytest.mark.slow
def test_a_study_says_once_at_the_start_what_data_it_reads_and_how_to_lift_its_cap(small_val_study):
    corpus, _, proc = small_val_study
    lines = [line for line in proc.stderr.splitlines() if line.startswith("flexmoba: data: ")]
    assert lines == [
        f"flexmoba: data: 9 files under {corpus} (*.txt), sequences of 128 bytes: train 8 files, 16,000 bytes, "
        "120 sequences; val 1 file, 482 bytes, 3 sequences; test 0 files, 0 bytes, 0 sequences",
        "flexmoba: data: max_files 8 keeps 8 train files (9 with val and test) of the 31 files long enough; pass "
        "--data.max_files null to use them all",
    ], proc.stderr[-3000:]
    assert proc.stderr.index(lines[0]) < proc.stderr.index("flexmoba: step 1/2"), "said after training started"


@pytest.mark.slow
def test_a_study_whose_moba_cannot_be_sparse_says_so_at_the_start_and_in_its_report(small_val_study):
    _, out, proc = small_val_study
    assert proc.stderr.splitlines().count(NOT_SPARSE) == 1, proc.stderr[-3000:]
    assert proc.stderr.index(NOT_SPARSE) < proc.stderr.index("flexmoba: step 1/2"), "said after training started"
    report = (out / "results.md").read_text()
    assert ("**Note:** MoBA at seq_len 128 with chunk_size 64 × top_k 2 attends every earlier key (equals full "
            "attention); lower chunk_size or top_k to make it sparse: the moba row is full attention here.") in report


@pytest.mark.slow
def test_a_study_into_a_pipe_prints_progress_for_training_and_for_every_validation(small_val_study):
    _, _, proc = small_val_study
    lines = proc.stderr.splitlines()
    training = [line for line in lines if re.fullmatch(r"flexmoba: step [12]/2: loss \d+\.\d{4}, [\d,]+ tokens/s, "
                                                        r"\d+(s|m \d\ds) left", line)]
    validation = [line for line in lines if re.fullmatch(r"flexmoba: validation batch 1/1: [\d,]+ tokens/s, 0s left",
                                                          line)]
    assert len(training) == 4, lines  # 2 steps x 2 runs
    assert len(validation) == 6, lines  # per run: after steps 1 and 2, and the final validation


@pytest.mark.slow
def test_ctrl_c_ends_a_study_with_the_step_reached_and_the_command_that_resumes(tmp_path, corpus_cache):
    args = [*TINY, "--trainer.max_steps", "100000", "--checkpoint.every_n_train_steps", "2",
            "--data.cache_dir", str(corpus_cache), "--out", str(tmp_path / "study")]
    proc = subprocess.Popen(command(*args), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            encoding="utf-8", preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    checkpoints = tmp_path / "study" / "moba" / "seed1337" / "checkpoints"
    deadline = time.time() + 300
    while not list(checkpoints.glob("step*.ckpt")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    said = re.fullmatch(r"flexmoba: interrupted at step (\d+) of (\S+) \(resumes from step (\d+)\); resume with: (.*)",
                        last)
    assert said, stderr[-3000:]
    assert int(said[3]) <= int(said[1]) and said[2] == str(tmp_path / "study" / "moba" / "seed1337")
    assert said[4] == shlex.join(["flexmoba", "compare", *args]), said[4]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]


def test_the_report_says_what_its_speed_columns_are_worth_from_the_load_while_they_ran():
    def runs(*loads):
        return [{"load_average": list(pair), "cpus": 2} for pair in loads]

    from lit.experiments.compare import speed_note

    busy = speed_note(runs((1.1, 2.0), (2.2, 4.3)))
    assert busy.startswith("1-minute load average 1.1-4.3 on 2 CPUs at the runs' starts and ends (shared with other "
                           "work): the time columns are no speed measurement; flexmoba bench train_step")
    quiet = speed_note(runs((0.1, 2.0), (1.9, 2.3)))
    assert "(not otherwise busy): the time columns are one run per seed, not a speed measurement" in quiet
    assert speed_note([{}]).startswith("The machine's load was not recorded: the time columns are no speed")
