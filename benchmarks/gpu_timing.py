"""The attention timing of ``benchmarks/gpu.sh``: :mod:`benchmarks.attention`, for checked methods only.

A method is timed only if the oracle part (:mod:`benchmarks.gpu_check`) checked it and every
one of its checks passed; any other is reported in the table with why it was not timed.
Every other option is :mod:`benchmarks.attention`'s.

    python -m benchmarks.gpu_timing --checks runs/benchmarks/gpu/checks.json [attention options]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from benchmarks import attention
from benchmarks.common import OneLineArgumentParser
from benchmarks.device import describe
from benchmarks.gpu_check import not_timed
from benchmarks.verdict import verdict


def summary(rows: list[dict], skipped: dict[str, str]) -> tuple[str, str]:
    timed = [r for r in rows if "fwd_ms" in r]
    errors = [r for r in rows if r.get("note", "").startswith("error")]
    budget = [r for r in rows if r.get("note") == "skipped (time budget)"]
    memory = [r for r in rows if r.get("note") in ("skipped (memory)", "out of memory")]
    parts = [f"timed {len(timed)} of {len(rows)} rows"]
    if budget:
        parts.append(f"{len(budget)} skipped (time budget)")
    if memory:
        parts.append(f"{len(memory)} skipped (memory)")
    for method, why in skipped.items():
        parts.append(f"{method} {why}")
    for r in errors[:3]:
        parts.append(f"{r['method']} S{r['seq_len']} {r['config']}: {r['note']}")
    return ("FAIL" if errors or not timed else "PASS"), "; ".join(parts)


def main(argv=None) -> int:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--checks", type=Path, default=Path("runs/benchmarks/gpu/checks.json"),
                   help="the oracle part's JSON (benchmarks.gpu_check --out)")
    own, rest = p.parse_known_args(argv)
    args = attention.parse_args(rest)
    print(describe(args.device), flush=True)
    skipped = not_timed(own.checks, args.methods)
    rows, localities = attention.run(args, skipped)
    path = attention.report(rows, localities, args, torch.device(args.device).type)
    print(f"written to {path}")
    return verdict("timing", *summary(rows, skipped))


if __name__ == "__main__":
    sys.exit(main())
