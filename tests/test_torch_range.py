"""CI tests the torch range the package states: the oldest supported torch, the Makefile's, the newest."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def make_variable(name: str) -> list[str]:
    found = re.search(rf"^{name} \?= (.+)$", (REPO / "Makefile").read_text(), re.M)
    assert found, f"{name} is not set in the Makefile"
    return found.group(1).split()


def test_ci_runs_the_core_suite_on_every_version_after_the_full_suite():
    commands = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line.strip().startswith("make")]
    assert commands == ["make test", "make test-torch-range"]


def test_the_oldest_supported_torch_is_tested():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (bound,) = (re.fullmatch(r"torch>=(\d+)\.(\d+)", dep) for dep in dependencies)
    assert bound, dependencies
    oldest = min(tuple(int(part) for part in v.split(".")) for v in make_variable("TORCH_RANGE"))
    assert oldest == (int(bound.group(1)), int(bound.group(2)), 0)


def test_the_readme_and_pyproject_state_the_tested_versions():
    versions = sorted(make_variable("TORCH_VERSION") + make_variable("TORCH_RANGE"),
                      key=lambda v: tuple(map(int, v.split("."))))
    stated = f"tested on torch {', '.join(versions[:-1])} and {versions[-1]}"
    assert stated in (REPO / "README.md").read_text()
    assert stated in (REPO / "pyproject.toml").read_text()
