"""What a newcomer sees: a tiny fit and a tiny compare print no banner, tip or warning, and end with one
line naming the result, the checkpoint and the logs; a resume past a truncated last.ckpt leaves an
intact last.ckpt where generate looks; retrieval evaluate reads compare's checkpoints."""

from __future__ import annotations

import json
import re
import shlex
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
    # under the working directory: shown from it
    assert "; checkpoint run/checkpoints/last.ckpt;" in summary, summary
    assert "; logs run/csv/version_0, run/tb/version_0" in summary, summary
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


# -- a fit into a log file: what it reads, its progress, Ctrl-C ------------------------------------------------

# MoBA that cannot be sparse (64 x 2 = seq_len 128), a budget nobody waits for, a checkpoint every 2 steps.
LONG_FIT = ["--model.config.moba.chunk_size", "64", "--model.config.moba.top_k", "2", "--trainer.max_steps", "100000",
            "--checkpoint.every_n_train_steps", "2", "--trainer.enable_progress_bar", "false"]


def fit_until(args: list[str], root: Path, ready, cwd: Path) -> tuple[int, str]:
    """``flexmoba fit`` with stdout and stderr in files (not a terminal), a progress line every step; SIGINT once
    ``ready(stderr so far)`` holds; its exit code and stderr."""
    import os
    import signal
    import time

    err = root.with_suffix(".stderr")
    with open(err, "w") as errors, open(root.with_suffix(".stdout"), "w") as output:
        proc = subprocess.Popen([sys.executable, "-m", "lit.cli.main", *args], cwd=cwd, stdout=output, stderr=errors,
                                env={**os.environ, "FLEXMOBA_PROGRESS_SECONDS": "0"},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 300
        while not ready(err.read_text(encoding="utf-8")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:  # Ctrl-C did not stop it: the tests fail on the code, with its output
            proc.kill()
            code = proc.wait()
    return code, err.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def interrupted_fit(tmp_path_factory, corpus_cache) -> dict:
    """A long fit stopped by Ctrl-C after its first checkpoint and a validation, then resumed with the command its
    last line names, and stopped again once it has taken a step."""
    folder = tmp_path_factory.mktemp("interrupted")
    root = folder / "run"
    args = [*tiny_fit(root), *LONG_FIT, "--data.cache_dir", str(corpus_cache)]
    code, stderr = fit_until(args, root, lambda text: list((root / "checkpoints").glob("step*.ckpt"))
                             and "flexmoba: validation batch" in text, folder)
    resume = re.search(r"resume with: (.*)$", stderr.strip().splitlines()[-1]) if stderr.strip() else None
    again = None
    if resume:
        again = fit_until(shlex.split(resume[1])[1:], folder / "resumed", lambda text: "flexmoba: step " in text,
                          folder)
    return {"args": args, "root": root, "code": code, "stderr": stderr, "resumed": again}


@pytest.mark.slow
def test_a_fit_says_at_the_start_what_data_it_reads_and_how_to_lift_the_cap(interrupted_fit):
    lines = interrupted_fit["stderr"].splitlines()
    data = [line for line in lines if line.startswith("flexmoba: data: ")]
    assert len(data) == 2, lines[:20]
    assert re.fullmatch(r"flexmoba: data: \d+ files under \S+ \(\*\.py\), sequences of 128 bytes: train 8 files, "
                        r"[\d,]+ bytes, [\d,]+ sequences; val 1 file, [\d,]+ bytes, [\d,]+ sequences; test 1 file, "
                        r"[\d,]+ bytes, [\d,]+ sequences", data[0]), data[0]
    assert re.fullmatch(r"flexmoba: data: max_files 8 keeps 8 train files \(10 with val and test\) of the "
                        r"[\d,]+ files long enough; pass --data.max_files null to use them all", data[1]), data[1]
    assert lines.index(data[0]) < min(i for i, line in enumerate(lines) if line.startswith("flexmoba: step "))


@pytest.mark.slow
def test_a_fit_whose_moba_cannot_be_sparse_says_so_once_at_the_start(interrupted_fit):
    lines = interrupted_fit["stderr"].splitlines()
    note = ("flexmoba: note: MoBA at seq_len 128 with chunk_size 64 × top_k 2 attends every earlier key (equals full "
            "attention); lower chunk_size or top_k to make it sparse")
    assert lines.count(note) == 1, lines[:20]
    assert lines.index(note) < min(i for i, line in enumerate(lines) if line.startswith("flexmoba: step "))


@pytest.mark.slow
def test_a_fit_into_a_file_prints_progress_lines_for_training_and_validation(interrupted_fit):
    lines = interrupted_fit["stderr"].splitlines()
    steps = [line for line in lines if line.startswith("flexmoba: step ")]
    assert steps and all(re.fullmatch(r"flexmoba: step \d+/100000: loss \d+\.\d{4}, [\d,]+ tokens/s, "
                                      r"(\d+s|\d+m \d\ds|\d+h \d\dm) left", line) for line in steps), steps[:5]
    assert [int(line.split()[2].split("/")[0]) for line in steps[:3]] == [1, 2, 3]  # one a step (interval 0)
    validation = [line for line in lines if line.startswith("flexmoba: validation batch ")]
    assert validation and all(re.fullmatch(r"flexmoba: validation batch [12]/2: [\d,]+ tokens/s, \d+s left", line)
                              for line in validation), validation


@pytest.mark.slow
def test_ctrl_c_ends_a_fit_with_the_step_reached_and_the_command_that_resumes_it(interrupted_fit):
    code, stderr = interrupted_fit["code"], interrupted_fit["stderr"]
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    said = re.fullmatch(r"flexmoba: interrupted at step (\d+) \(resumes from step (\d+)\); resume with: (.*)", last)
    assert said, last
    printed = max(int(line.split()[2].split("/")[0]) for line in stderr.splitlines()
                  if line.startswith("flexmoba: step "))
    # Ctrl-C can land after a step's optimizer update and before its progress line: one step past the last line
    assert printed <= int(said[1]) <= printed + 1, last
    assert 2 <= int(said[2]) <= int(said[1]) and int(said[2]) % 2 == 0, last
    assert said[3] == shlex.join(["flexmoba", *interrupted_fit["args"], "--ckpt_path", "last"]), said[3]
    code, resumed = interrupted_fit["resumed"]  # the command it names, run: it goes on from that checkpoint
    first_step = next(line for line in resumed.splitlines() if line.startswith("flexmoba: step "))
    assert first_step.startswith(f"flexmoba: step {int(said[2]) + 1}/100000: "), resumed[-3000:]
    assert code == 130 and resumed.strip().splitlines()[-1].startswith("flexmoba: interrupted at step "), resumed


@pytest.mark.parametrize("command, error, line", [
    (["flexmoba", "fit", "--config", "configs/moba.yaml", "--ckpt_path", "runs/moba/checkpoints/step000010.ckpt"],
     (37, 36, "runs/moba", True),
     "interrupted at step 37 (resumes from step 36); resume with: flexmoba fit --config configs/moba.yaml "
     "--ckpt_path last"),
    (["flexmoba", "fit", "--config", "my config.yaml"], (1, None, "runs/moba", False),
     "interrupted at step 1, before its first checkpoint; start again with: flexmoba fit --config 'my config.yaml'"),
    (["flexmoba", "compare", "--seeds", "2"], (40, 40, "runs/compare/full/seed1338", True),
     "interrupted at step 40 of runs/compare/full/seed1338 (resumes from step 40); resume with: flexmoba compare "
     "--seeds 2"),
    (["flexmoba", "sweep", "configs/sweep/toy.yaml"], (7, None, "runs/sweep/s0-moba", True),
     "interrupted at step 7 of runs/sweep/s0-moba (resumes from its newest checkpoint); resume with: flexmoba sweep "
     "configs/sweep/toy.yaml"),
    (["flexmoba", "compare"], None, "interrupted; run it again with: flexmoba compare"),
])
def test_an_interrupted_run_names_the_command_that_resumes_it(command, error, line):
    from lit.cli.errors import interrupted_line
    from lit.training.errors import RunInterrupted

    assert interrupted_line(error and RunInterrupted(*error), command) == line
