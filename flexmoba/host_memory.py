"""glibc's malloc thresholds for CPU training: an explicit, process-wide opt-in.

A training step frees and allocates the same tensors every step. glibc maps blocks of 128 KiB
and more afresh (``mmap``) and hands freed memory at the top of its heap back to the kernel
beyond a trim threshold; it raises both thresholds only as large blocks are freed, and never
past 32 MiB. Memory given back is paid for again as page faults the next time it is used. The
``gather`` backend allocates many block-sized temporaries (each chunk's gathered queries, keys
and gradients), so on CPU it pays more of those faults than one fused SDPA call: at
``flexmoba compare``'s size its attention took about 1.25x as long under glibc's defaults as
with both thresholds fixed (docs/performance.md#host-memory).

:func:`keep_freed_memory` fixes both thresholds at the top of glibc's own range, so freed
blocks stay in the process. Nothing here runs on import; the ``flexmoba`` launcher calls it
for runs on CPU.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory", "set_malloc_thresholds",
           "user_chose_malloc_settings"]

# glibc's own ceiling for its adaptive mmap threshold; the trim threshold twice that, as glibc pairs them.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
# What a user sets to choose these thresholds (or the allocator) for a process: left alone.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def set_malloc_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc's mmap and trim thresholds (bytes) for this process; False where the C library
    is not glibc or refuses them."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False


def user_chose_malloc_settings(environ: dict[str, str] | None = None) -> bool:
    """True where the environment sets glibc's malloc thresholds or tunables, or preloads a library
    (jemalloc, tcmalloc, ...)."""
    env = os.environ if environ is None else environ
    return (any(name in env for name in _USER_SETTINGS) or "glibc.malloc." in env.get("GLIBC_TUNABLES", "")
            or bool(env.get("LD_PRELOAD")))


def keep_freed_memory() -> bool:
    """Fix glibc's thresholds at :data:`MMAP_THRESHOLD` and :data:`TRIM_THRESHOLD` for the rest of the
    process, unless the environment chose its own (:func:`user_chose_malloc_settings`). Returns
    whether it did. Costs up to ``TRIM_THRESHOLD`` of freed memory kept at the heap's top."""
    if user_chose_malloc_settings():
        return False
    return set_malloc_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)
