"""The one line each part of ``benchmarks/gpu.sh`` ends with: ``VERDICT <part> <STATUS> <why>``.

A part decides PASS, FAIL or SKIP itself; TIMEOUT, and FAIL for a part that died without a
verdict, are the script's (it reads the last verdict line of the part's output).
"""

from __future__ import annotations

STATUSES = ("PASS", "FAIL", "SKIP")


def verdict(part: str, status: str, why: str) -> int:
    """Print the verdict line; the exit code for it (1 for FAIL, else 0)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    print(f"VERDICT {part} {status} {' '.join(why.split())}", flush=True)
    return 1 if status == "FAIL" else 0


def one_line(error: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}"[:limit]
