"""How the ``flexmoba`` command ends on an error: one line on stderr, from one process.

A user mistake (a bad value, a path that is not there, a file that is not a checkpoint, a device this
machine lacks, output that would be overwritten) is ``flexmoba: error: --option: what is wrong; what
to do`` and exit code 2. Code anywhere below the command raises :class:`UsageError`; the command's
entry (:func:`one_line_errors`) turns it into that line. A diverged run is one line and exit code 1.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

from lit.training.errors import TrainingDiverged


class UsageError(ValueError):
    """A mistake in how the command was called: the option to change, what is wrong with it, what to do."""

    def __init__(self, option: str, problem: str, fix: str = ""):
        self.option, self.problem, self.fix = option, problem, fix
        super().__init__(f"{option}: {problem}" + (f"; {fix}" if fix else ""))


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0


def fail(message: str) -> NoReturn:
    """End the command: ``flexmoba: error: message`` as one line (from rank 0) and exit code 2."""
    if is_rank_zero():
        sys.stderr.write(f"flexmoba: error: {' '.join(str(message).split())}\n")
        sys.stderr.flush()
    raise SystemExit(2)


@contextlib.contextmanager
def one_line_errors():
    """A :class:`UsageError` ends the command with exit code 2, a diverged run with exit code 1, each
    as one ``flexmoba: error: ...`` line (every process stops; rank 0 says why)."""
    try:
        yield
    except UsageError as error:
        fail(str(error))
    except TrainingDiverged as diverged:
        if is_rank_zero():
            sys.stderr.write(f"flexmoba: error: {diverged}\n")
        raise SystemExit(1) from None
