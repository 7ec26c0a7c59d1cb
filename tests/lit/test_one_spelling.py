"""One spelling of MoBA's settings: every shipped config and every README command parses with it."""

import re
import shlex
import sys
from pathlib import Path

import pytest

from lit.experiments import compare
from lit.experiments.sweep import SweepSpec, base_config
from lit.training.launch import read_config

REPO = Path(__file__).resolve().parents[2]
OLD_SPELLING = re.compile(r"moba_(chunk_size|top_k|granularity|backend)\b")
TRAINING = ("fit", "validate", "test", "predict")


def readme_commands() -> list[list[str]]:
    """The ``flexmoba <subcommand> ...`` lines of README.md's code blocks that hold no placeholder."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    commands = []
    shell = (code for language, code in blocks if language in ("", "bash", "sh"))
    for line in (line for code in shell for line in code.splitlines()):
        line = line.split(" #")[0].strip()
        if line.startswith("flexmoba ") and not re.search(r"\.\.\.|<|\[|PATH|DIR", line):
            commands.append(shlex.split(line)[1:])
    return commands


def without_subcommand_options(args: list[str]) -> list[str]:
    """fit's options without ``--ckpt_path X`` (a subcommand's own, not the config's)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            out.append(arg)
    return out


def test_readme_shows_training_commands():
    subcommands = {command[0] for command in readme_commands()}
    assert {"fit", "compare", "sweep"} <= subcommands, subcommands


@pytest.mark.parametrize("command", [c for c in readme_commands() if c[0] in (*TRAINING, "compare", "sweep")],
                         ids=lambda c: " ".join(c)[:80])
def test_every_readme_training_command_parses(command, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    name, args = command[0], [a for a in command[1:] if a not in ("--help", "-h", "--print_config")]
    if name in TRAINING:
        assert read_config(without_subcommand_options(args))["model"]["config"]["moba"]["chunk_size"] >= 1
    elif name == "compare":
        assert compare.parse(args)["seeds"] >= 1
    else:
        monkeypatch.setattr("lit.training.checks.available", lambda kind: True)  # a GPU sweep parses as on its machine
        spec = SweepSpec.from_yaml(args[0])
        assert base_config(spec) and spec.runs()


SWEEPS = sorted((REPO / "configs" / "sweep").glob("*.yaml"))


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_sweep_config_builds_its_runs_on_its_base_config(path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    monkeypatch.setattr("lit.training.checks.available", lambda kind: True)  # gpu.yaml's runs, as on a GPU machine
    spec = SweepSpec.from_yaml(path)
    base = base_config(spec)
    for run in spec.runs():
        moba = run.config(base)["model"]["config"]["moba"]
        assert moba == {**base["model"]["config"]["moba"], **run.kind.model.get("moba", {})}


# What users read and copy (CHANGELOG.md names the old spelling on purpose; retrieval evaluate and the
# benchmarks have --moba_* options of their own, overrides outside a training config).
DOCUMENTS = [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("configs/**/*.yaml"),
             *REPO.glob("examples/*.py")]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_file_shows_the_old_spelling(path):
    old = [line for line in path.read_text().splitlines() if OLD_SPELLING.search(line) and "--moba_" not in line]
    assert not old, old
