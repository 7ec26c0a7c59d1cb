"""How the ``flexmoba`` command ends on an error: one line on stderr, from one process."""

from __future__ import annotations

import contextlib
import os
import sys

from lit.training.errors import TrainingDiverged


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0


@contextlib.contextmanager
def exit_on_divergence():
    """A diverged run ends with ``flexmoba: error: training diverged at step N: ...`` and exit code 1
    (every process stops; rank 0 says why)."""
    try:
        yield
    except TrainingDiverged as diverged:
        if is_rank_zero():
            sys.stderr.write(f"flexmoba: error: {diverged}\n")
        raise SystemExit(1) from None
