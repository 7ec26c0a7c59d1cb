"""The library installs and runs with torch alone; one version number; the license ships."""

import hashlib
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

import flexmoba

import conformance_cases

REPO = Path(__file__).resolve().parents[1]
TRAINING_STACK = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "jsonargparse",
                  "matplotlib", "tensorboard", "yaml", "rich", "transformers")

# Runs in a fresh interpreter: any import of the training stack raises ImportError.
WITHOUT_TRAINING_STACK = textwrap.dedent("""
    import sys

    BLOCKED = set(sys.argv[1:])

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: the library must not need it")
            return None

    sys.meta_path.insert(0, Blocker())

    import torch
    import flexmoba

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    out = flexmoba.moba_attention(q, k, v, chunk_size=16, top_k=2)
    assert out.shape == q.shape and torch.isfinite(out).all()
    loaded = sorted(name for name in sys.modules if name.partition(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok", flexmoba.__version__)
""")


def test_library_runs_without_the_training_stack():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TRAINING_STACK, *TRAINING_STACK], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["ok", flexmoba.__version__]


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_core_dependency_is_torch_only():
    project = pyproject()["project"]
    assert [re.split(r"[<>=!~ \[;]", dep)[0] for dep in project["dependencies"]] == ["torch"]
    extras = project["optional-dependencies"]
    assert {"lightning", "torchmetrics", "tensorboard"} <= {re.split(r"[<>=!~ \[;]", d)[0] for d in extras["train"]}
    assert {"train", "hf", "dev"} <= set(extras)


def test_version_is_one_number():
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", flexmoba.__version__), flexmoba.__version__
    project = pyproject()
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "flexmoba.__version__"}


def test_installed_metadata_matches_when_installed():
    try:
        installed = metadata.version("flexmoba")
    except metadata.PackageNotFoundError:
        return  # running from a plain checkout
    # An editable install records the version at install time; reinstall after a bump.
    assert installed == flexmoba.__version__


def test_license_is_mit():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the flexmoba authors" in text


def test_conformance_vectors_ship_with_the_repository():
    """The official vectors are read from the repository's test data, byte for byte as recorded."""
    folder = conformance_cases.CONFORMANCE_DIR
    assert folder.is_relative_to(REPO / "tests"), folder
    listing = re.findall(r"^\s+([0-9a-f]{64})\s+(\S+\.pt)$", (folder / "README.md").read_text(), re.M)
    recorded = {name: digest for digest, name in listing}
    assert set(recorded) == set(conformance_cases.FILES)
    for name, digest in recorded.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
