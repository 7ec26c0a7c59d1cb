import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def flexmoba_command() -> list[str]:
    """The installed console script, or the module when the venv has no script."""
    script = Path(sys.executable).parent / "flexmoba"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lit.cli.lightning_cli"]


def run_flexmoba(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([*flexmoba_command(), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"flexmoba {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def read_metrics(root: Path) -> list[dict[str, str]]:
    """Rows of every CSVLogger version under ``root/csv``, oldest version first."""
    rows = []
    for path in sorted((root / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with open(path) as f:
            rows += list(csv.DictReader(f))
    return rows


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus-cache")


@pytest.fixture(scope="session")
def flexmoba():
    """``flexmoba(*args, cwd=...)``: run the CLI in a subprocess, fail with its output."""
    return run_flexmoba


@pytest.fixture(scope="session")
def metrics_of():
    """``metrics_of(root)``: CSVLogger rows under ``root/csv``."""
    return read_metrics


def write_random_files(root: Path, n_files: int, size: int) -> Path:
    """``n_files`` files of ``size`` random bytes in ``root``: a corpus that repeats nothing a test could
    mistake for a copy."""
    rng = np.random.default_rng(0)
    for i in range(n_files):
        (root / f"mod{i:02d}.py").write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return root


@pytest.fixture(scope="session")
def random_files():
    """``random_files(root, n_files, size)``: write a corpus of random bytes, see :func:`write_random_files`."""
    return write_random_files
