"""The default process group ends with the command that made it.

Left to interpreter exit, a gloo process group's worker threads can abort a process that has finished its work
("terminate called without an active exception", exit -6), and torchrun then reports the whole run failed.
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def process_group_destroyed_at_end():
    """Inside: a command. At its end, however it ends, the default process group it initialised (if any) is
    destroyed while the interpreter is whole. torch is not imported here: ``--help`` stays light."""
    try:
        yield
    finally:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
