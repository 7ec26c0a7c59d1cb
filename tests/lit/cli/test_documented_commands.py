"""Every ``flexmoba`` command the docs show parses: the lines of ``flexmoba --help``, of every
subcommand's ``--help`` and of the code blocks in README.md and docs/ that start with ``flexmoba ``.

Each is handed to its subcommand's own parser (LightningCLI with ``--print_config``, compare's and the
jobs' config readers, the sweep's and the benchmarks' argparse), which runs nothing.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from lit.cli.main import LIGHTNING, SUBCOMMANDS, main, usage

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))  # benchmarks/ runs from the checkout
BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py")
                    if "def main(" in p.read_text() and p.stem not in ("gpu_timing",))
# A line standing for many commands (a placeholder, a user's own folder, alternatives) is not one command.
PLACEHOLDER = re.compile(r"\.\.\.|<|PATH|DIR| \| |~|\{")
OPTIONAL = re.compile(r"\[(--[^\[\]]*)\]")  # [--repeats 3]; a list value such as [64,256] stays


def commands_in(text: str) -> list[str]:
    """The lines of ``text`` that are a ``flexmoba`` command: without their comment, optional parts
    (``[--repeats 3]``) included, continuation lines joined."""
    text = text.replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip().replace("make compare", "flexmoba compare", 1)
        if line.startswith("flexmoba ") and not PLACEHOLDER.search(line):
            found.append(OPTIONAL.sub(r"\1", line))
    return found


def help_text(argv: list[str], capsys) -> str:
    """The help page ``flexmoba *argv`` prints; a benchmark's from its module in this process (``flexmoba bench``
    runs it as ``python -m benchmarks.NAME``, which prints the same page)."""
    with pytest.raises(SystemExit):
        if argv[0] == "bench":
            import importlib

            importlib.import_module(f"benchmarks.{argv[1]}").main(argv[2:])
        else:
            main(argv)
    return capsys.readouterr().out


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]


def code_blocks(path: Path) -> str:
    text = path.read_text()
    fenced = [code for _, code in re.findall(r"(```|~~~)\w*\n(.*?)\1", text, re.S)]
    indented = [line for line in text.splitlines() if line.startswith("    flexmoba ")]
    return "\n".join(fenced + indented)


def documented() -> list[tuple[str, str]]:
    """``(where, command)`` of every command in the docs (the --help texts are read in their own test)."""
    return [(path.relative_to(REPO).as_posix(), command) for path in documents()
            for command in commands_in(code_blocks(path))]


class Parsed(Exception):
    """Raised by a benchmark's parser once it has parsed: nothing is measured."""


def parse(command: str, monkeypatch, capsys) -> None:
    """Parse ``command`` as its subcommand would, then stop; any mistake is SystemExit 2 (one line)."""
    name, *args = shlex.split(command)[1:]
    if name in ("--version", "--help") or "--help" in args:
        assert args in ([], ["--help"]) or args[-1] == "--help", command  # the help pages are the next test's
        return
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    if name in LIGHTNING:
        from lit.cli import lightning_cli

        with pytest.raises(SystemExit) as exit_info:
            lightning_cli.main([name, *args, "--print_config"])
        assert exit_info.value.code in (0, None), capsys.readouterr().err
    elif name == "compare":
        from lit.experiments import compare

        assert compare.parse(args)["seeds"] >= 1
    elif name == "sweep":
        from lit.experiments.sweep import SweepSpec, base_config

        monkeypatch.setattr("lit.training.checks.available", lambda kind: True)  # a GPU sweep parses as on its machine
        spec = SweepSpec.from_yaml(next(a for a in args if not a.startswith("--")))
        assert set(args) - {"--plan", "--report_only"} == {next(a for a in args if not a.startswith("--"))}
        assert base_config(spec) and spec.runs()
    elif name == "bench":
        parse_benchmark(args, monkeypatch)
    elif name == "continued-scaling":
        from lit.experiments import continued_scaling

        assert continued_scaling.parse(args)["budgets"]
    elif name in SUBCOMMANDS:
        parse_job(name, args)
    else:
        pytest.fail(f"{command}: no subcommand {name!r}")


def parse_job(name: str, args: list[str]) -> None:
    from lit.cli.export_hf import ExportJob
    from lit.cli.generate import GenerateJob
    from lit.cli.import_hf import ImportJob
    from lit.experiments.context_eval import ContextEvalJob
    from lit.experiments.continued_scaling_report import ReportJob as ContinuedReportJob
    from lit.experiments.gap_closed import GapClosedJob
    from lit.experiments.retrieval_evaluate import EvaluateJob
    from lit.experiments.scaling_report import ReportJob
    from lit.training.options import parse_dataclass

    jobs = {"generate": GenerateJob, "export-hf": ExportJob, "scaling-report": ReportJob, "retrieval": EvaluateJob,
            "import-hf": ImportJob, "context-eval": ContextEvalJob, "gap-closed": GapClosedJob,
            "continued-scaling-report": ContinuedReportJob}
    if name == "retrieval":
        assert args[0] == "evaluate", args
        args = args[1:]
    parse_dataclass(jobs[name], args, prog=f"flexmoba {name}")


def parse_benchmark(args: list[str], monkeypatch) -> None:
    import importlib

    from benchmarks.common import OneLineArgumentParser

    def parse_then_stop(parser, *call_args, **kwargs):
        parsed = original(parser, *call_args, **kwargs)
        raise Parsed(parsed)

    original = OneLineArgumentParser.parse_known_args
    monkeypatch.setattr(OneLineArgumentParser, "parse_known_args", parse_then_stop)
    module = importlib.import_module(f"benchmarks.{args[0]}")
    with pytest.raises(Parsed):
        module.main(args[1:])


def test_the_docs_show_commands_of_every_kind():
    shown = {shlex.split(command)[1] for _, command in documented()}
    assert {"fit", "validate", "compare", "sweep", "generate", "export-hf", "retrieval"} <= shown, shown


@pytest.mark.parametrize("where, command", documented(), ids=[f"{w}: {c}"[:90] for w, c in documented()])
def test_every_command_in_the_docs_parses(where, command, monkeypatch, capsys):
    parse(command, monkeypatch, capsys)


def run_folder(command: str, monkeypatch) -> str | None:
    """The folder a fresh ``fit`` or a ``compare`` writes (None for a resume and other subcommands)."""
    name, *args = shlex.split(command)[1:]
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    if name == "fit" and "--ckpt_path" not in args:
        from lit.training.launch import read_config

        return read_config(args)["trainer"]["default_root_dir"]
    if name == "compare" and "--help" not in args:
        from lit.experiments import compare

        return compare.parse(args)["out"]
    return None


def assert_folders_differ(commands: list[str], monkeypatch) -> None:
    """Commands run top to bottom are not refused for a folder an earlier one made."""
    written: dict[str, str] = {}
    for command in commands:
        folder = run_folder(command, monkeypatch)
        if folder is None or command in written.values():
            continue  # the same compare again resumes the same study
        assert folder not in written, f"{command!r} writes into {folder}, as {written.get(folder)!r} did"
        written[folder] = command


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_commands_of_a_page_run_in_order_write_different_folders(path, monkeypatch):
    assert_folders_differ(commands_in(code_blocks(path)), monkeypatch)


HELP_PAGES = [["--help"], *[[name, "--help"] for name in SUBCOMMANDS if name != "bench"],
              *[["bench", name, "--help"] for name in BENCHMARKS]]


@pytest.mark.parametrize("argv", HELP_PAGES, ids=" ".join)
def test_every_command_a_help_page_shows_parses(argv, monkeypatch, capsys):
    text = usage() if argv == ["--help"] else help_text(argv, capsys)
    assert "%%" not in text, "a help text shows a doubled percent sign"
    for command in commands_in(text):
        parse(command, monkeypatch, capsys)
    assert_folders_differ(commands_in(text), monkeypatch)
