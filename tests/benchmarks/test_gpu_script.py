"""``benchmarks/gpu.sh`` as a whole: its CPU dry run runs every part, a failing or hanging part
hides no other, and a dry run never writes the committed results."""

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.device import cpu_model

REPO = Path(__file__).resolve().parents[2]
PARTS = ("device", "oracle", "determinism", "flash", "timing", "mfu")
SUMMARY_LINE = re.compile(r"^(\w+)\s+(PASS|FAIL|SKIP|TIMEOUT)\s+(\d+)s\s+(.*)$")


def kill_session(session: int) -> None:
    """SIGKILL every process of a session (``timeout`` puts each part in a process group of its own)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session:
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass


def run_script(root: Path, *args: str, out: Path, timeout: int, **env) -> subprocess.CompletedProcess:
    """``bash gpu.sh *args`` in a session of its own, all of it killed if it outlives ``timeout``."""
    environment = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "PYTHONWARNINGS": "ignore", **env}
    command = ["bash", str(root / "benchmarks" / "gpu.sh"), *args]
    with subprocess.Popen(command, cwd=root, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def summary(stdout: str) -> dict[str, tuple[str, str]]:
    """part -> (verdict, why), from the lines after ``== summary``."""
    lines = stdout.split("== summary", 1)[1].splitlines()[1:]
    return {m[1]: (m[2], m[4]) for m in map(SUMMARY_LINE.match, lines) if m}


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_dry_run_runs_every_part_into_a_temporary_folder(tmp_path):
    committed = digest(REPO / "benchmarks" / "results")
    out = tmp_path / "out"
    proc = run_script(REPO, "--device", "cpu", out=out, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    verdicts = summary(proc.stdout)
    assert set(verdicts) == set(PARTS), proc.stdout[-4000:]
    for part in ("device", "oracle", "determinism", "timing", "mfu"):
        assert verdicts[part][0] == "PASS", f"{part}: {verdicts[part]}"
    assert verdicts["flash"][0] == "SKIP" and "not available" in verdicts["flash"][1]
    assert "inductor deterministic True" in verdicts["determinism"][1]
    for method in ("moba_flex", "moba_flex_union", "moba_gather", "sdpa_causal"):
        assert method in verdicts["oracle"][1]
    timing = (out / "gpu" / "attention_cpu.md").read_text()
    for method in ("moba_flex", "moba_flex_union", "moba_gather", "sdpa_causal"):
        (row,) = [line for line in timing.splitlines() if f"| {method} |" in line]
        assert "not timed" not in row and "error" not in row, row
    report = (out / "gpu.md").read_text()
    assert report.startswith("# flexmoba GPU script, dry run on CPU ") and cpu_model() in report.splitlines()[0]
    for part in PARTS:
        assert f"| {part} | {verdicts[part][0]} |" in report
    assert "## Oracle check" in report and "## Attention timing" in report
    assert digest(REPO / "benchmarks" / "results") == committed


def test_dry_run_refuses_the_committed_results_folder():
    committed = digest(REPO / "benchmarks" / "results")
    proc = run_script(REPO, "--device", "cpu", out=REPO / "benchmarks" / "results", timeout=60)
    assert proc.returncode == 2
    assert "never writes the committed results" in proc.stderr
    assert digest(REPO / "benchmarks" / "results") == committed


def test_a_failing_or_hanging_part_hides_no_other(tmp_path):
    """In a scratch copy: the oracle part crashes, the determinism part hangs past its timeout;
    the parts after them still run, and the summary and gpu.md list every verdict (a part not
    rerun keeps its old one, a rerun part's old outputs are gone)."""
    root = tmp_path / "repo"
    for name in ("benchmarks", "flexmoba", "configs"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(REPO / "pyproject.toml", root)
    (root / "benchmarks" / "gpu_check.py").write_text("raise RuntimeError('planted crash')\n")
    (root / "benchmarks" / "gpu_determinism.py").write_text("import time\ntime.sleep(600)\n")
    (root / "benchmarks" / "gpu_flash.py").write_text("print('VERDICT flash PASS planted, ran after a timeout')\n")
    out = tmp_path / "out"
    (out / "gpu").mkdir(parents=True)
    (out / "gpu" / "checks.json").write_text("a previous run's checks")
    (out / "gpu" / "mfu.verdict").write_text("PASS\t9\ta previous run's verdict\n")
    proc = run_script(root, "--device", "cpu", "--parts", "device,oracle,determinism,flash", out=out, timeout=120,
                      TIMEOUT_DETERMINISM="3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdicts = summary(proc.stdout)
    assert set(verdicts) == {"device", "oracle", "determinism", "flash", "mfu"}, proc.stdout
    assert verdicts["mfu"] == ("PASS", "(kept from an earlier run) a previous run's verdict")
    assert verdicts["device"][0] == "PASS"
    assert verdicts["oracle"][0] == "FAIL" and "planted crash" in verdicts["oracle"][1]
    assert verdicts["determinism"][0] == "TIMEOUT" and "3s" in verdicts["determinism"][1]
    assert verdicts["flash"] == ("PASS", "planted, ran after a timeout")
    report = (out / "gpu.md").read_text()
    for part, status in (("oracle", "FAIL"), ("determinism", "TIMEOUT"), ("flash", "PASS")):
        assert f"| {part} | {status} |" in report
    assert "| timing | not run |" in report
    assert "| mfu | PASS | 9 | a previous run's verdict |" in report  # a part not rerun keeps its verdict
    assert not (out / "gpu" / "checks.json").exists()  # the rerun oracle's old checks are gone
