"""Errors of a run and of how it was asked for (importable without Lightning).

Code at any floor below the command (training, experiments) raises these; it never prints or exits.
The ``flexmoba`` command (:func:`lit.cli.errors.one_line_errors`) turns a :class:`UsageError` or a
:class:`ConfigError` into one ``flexmoba: error: ...`` line and exit code 2, a
:class:`TrainingDiverged` into one line and exit code 1, a :class:`RunInterrupted` (Ctrl-C) into one line
saying how to resume and exit code 130.
"""

from __future__ import annotations

import os


class TrainingDiverged(RuntimeError):
    """A training loss or gradient norm became NaN or infinite at ``step`` (the first such step).

    ``value`` is None on a process that saw only finite values (another one did not).
    """

    def __init__(self, step: int, name: str, value: float | None):
        self.step, self.name, self.value = step, name, value
        shown = f"{name} = {value}" if value is not None else "non-finite on another process"
        super().__init__(f"training diverged at step {step}: {shown}")


class RunInterrupted(Exception):
    """Ctrl-C (SIGINT) stopped a run at ``step``; ``resumable``: its folder ``run_dir`` holds a checkpoint to
    resume from, of step ``saved_step`` (None: unknown, or none). Not a KeyboardInterrupt: the command
    ends with one line saying how to resume (:mod:`lit.cli.errors`)."""

    def __init__(self, step: int | None, saved_step: int | None, run_dir: str | None = None,
                 resumable: bool | None = None):
        self.step, self.saved_step, self.run_dir = step, saved_step, run_dir
        self.resumable = saved_step is not None if resumable is None else resumable
        at = f" at step {step}" if step is not None else ""
        super().__init__(f"interrupted{at}")


class UsageError(ValueError):
    """A mistake in how a job was called: the option to change, what is wrong with it, what to do."""

    def __init__(self, option: str, problem: str, fix: str = ""):
        self.option, self.problem, self.fix = option, problem, fix
        super().__init__(f"{option}: {problem}" + (f"; {fix}" if fix else ""))


class BadArguments(UsageError):
    """Arguments a job's parser refused, said as one line already (argparse's or jsonargparse's
    message, with the option a mistyped one may mean)."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.option, self.problem, self.fix = "", message, ""


class ConfigError(Exception):
    """A ``flexmoba fit``-style config the launcher's parser refused (:mod:`lit.training.launch`).

    ``message`` is the parser's own, as jsonargparse words it (nested, several lines) or a line naming
    the option (the launcher's checks); ``options`` are every option the parser takes, for the nearest
    one to a mistyped name. Not a ValueError: jsonargparse catches those while it parses.
    """

    def __init__(self, message: str, options: list[str]):
        self.message, self.options = message, list(options)
        super().__init__(message)


def is_rank_zero() -> bool:
    """Whether this process speaks for the run: rank 0 of a distributed launch, or the only process."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0
