"""MoBA at a million tokens on this machine: forward and forward+backward through the public API, their
time and peak memory, and sampled query rows against an independent per-row reference.

Random fp32 ``q: [1, H, S, D]``, ``k, v: [1, H_kv, S, D]``; :func:`flexmoba.moba_attention` with the chosen
backend (default ``gather``). The reference recomputes each sampled row from scratch, with none of the
library's gate or kernels: the chunk means of the keys, the row's scores against the chunks before its own,
the best ``top_k - 1`` of them (of equal scores the later chunk), then softmax attention over those chunks'
keys and its own chunk up to itself. Forward: the rows' outputs; backward: the rows' query gradients for a
random upstream gradient (a query's gradient depends on its own row only). Key and value gradients mix every
row and are left to the test suites at small S.

    flexmoba bench million [--seq_len 1048576] [--heads 1] [--rows 32] [--out DIR]
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_OUT, OUT_HELP, OneLineArgumentParser, finish_report, peak_extra_mb, print_row

COLUMNS = [("pass", "pass"), ("seq_len", "S"), ("heads", "H"), ("kv_heads", "H_kv"), ("backend", "backend"),
           ("seconds", "seconds"), ("peak_mib", "peak (MiB)"), ("inputs_mib", "inputs (MiB)"),
           ("rows_checked", "rows checked"), ("max_error", "max error vs reference")]


def sampled_rows(seq_len: int, chunk_size: int, count: int, gen: torch.Generator) -> list[int]:
    """The first and last rows, a row at each end of the last chunks, and random rows in between."""
    fixed = [0, chunk_size - 1, chunk_size, seq_len // 2, seq_len - chunk_size, seq_len - 1]
    drawn = torch.randint(0, seq_len, (max(0, count - len(fixed)),), generator=gen).tolist()
    return sorted({t for t in fixed + drawn if 0 <= t < seq_len})


def reference_row(q_row, k, v, t: int, chunk_size: int, top_k: int, scale: float):
    """One query's MoBA output from scratch: ``q_row: [D]`` (query head h), ``k, v: [S, D]`` (its KV head)."""
    own = t // chunk_size
    if own and top_k > 1:
        means = k[: own * chunk_size].view(own, chunk_size, -1).mean(1)
        scores = means @ q_row.detach()
        order = sorted(range(own), key=lambda c: (float(scores[c]), c), reverse=True)  # ties: the later chunk
        past = [c for c in order[: top_k - 1] if not math.isnan(float(scores[c])) and float(scores[c]) > -math.inf]
    else:
        past = []
    keys = torch.cat([torch.arange(c * chunk_size, (c + 1) * chunk_size) for c in sorted(past)]
                     + [torch.arange(own * chunk_size, t + 1)])
    weights = torch.softmax((k[keys] @ q_row) * scale, 0)
    return weights @ v[keys]


def check_rows(q, k, v, out, rows, args, upstream=None) -> float:
    """Largest difference between ``out`` (or, with ``upstream``, ``q.grad``) and the reference on ``rows``."""
    H, H_kv = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5
    worst = 0.0
    for h in range(H):
        kv = h // (H // H_kv)
        for t in rows:
            q_row = q[0, h, t].detach().clone().requires_grad_(upstream is not None)
            expected = reference_row(q_row, k[0, kv].detach(), v[0, kv].detach(), t, args.chunk_size, args.top_k,
                                     scale)
            if upstream is None:
                got = out[0, h, t]
            else:
                (expected @ upstream[0, h, t]).backward()
                expected, got = q_row.grad, q.grad[0, h, t]
            worst = max(worst, float((got - expected).abs().max()))
    return worst


def measure_pass(attention, q, k, v, spec, upstream) -> dict:
    """One forward (``upstream`` None, no gradients) or forward+backward of ``upstream``: its output, seconds and
    peak memory over what was held before (q, k, v's gradients included)."""
    for x in (q, k, v):
        x.requires_grad_(upstream is not None)
        x.grad = None
    result = {}

    def run():
        with torch.set_grad_enabled(upstream is not None):
            out = attention(q, k, v, spec)
            if upstream is not None:
                out.backward(upstream)
        result["out"] = out.detach()

    began = time.perf_counter()
    peak = peak_extra_mb(run, q.device)
    return {"seconds": time.perf_counter() - began, "peak_mib": peak, "out": result["out"]}


def main(argv=None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_len", type=int, default=2**20)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--kv_heads", type=int, default=None, help="H_kv (default: --heads)")
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--moba_chunk_size", dest="chunk_size", type=int, default=512)
    parser.add_argument("--moba_top_k", dest="top_k", type=int, default=3)
    parser.add_argument("--backend", default="gather")
    parser.add_argument("--rows", type=int, default=32, help="query rows checked per head (default: 32)")
    parser.add_argument("--passes", nargs="+", choices=("forward", "forward+backward"),
                        default=["forward", "forward+backward"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.threads:
        torch.set_num_threads(args.threads)
    import flexmoba

    spec = flexmoba.MobaSpec(args.chunk_size, args.top_k, backend=args.backend)
    gen = torch.Generator().manual_seed(0)
    B, S, D = 1, args.seq_len, args.head_dim
    q = torch.randn(B, args.heads, S, D, generator=gen)
    k, v = (torch.randn(B, args.kv_heads, S, D, generator=gen) for _ in range(2))
    rows = sampled_rows(S, args.chunk_size, args.rows, gen)
    inputs_mib = sum(x.numel() * x.element_size() for x in (q, k, v)) / 2**20
    report = []
    for which in args.passes:
        upstream = None if which == "forward" else torch.randn(q.shape, generator=gen)
        row = measure_pass(flexmoba.moba_attention, q, k, v, spec, upstream)
        row.update(pass_=which, seq_len=S, heads=args.heads, kv_heads=args.kv_heads, backend=args.backend,
                   inputs_mib=inputs_mib, rows_checked=len(rows) * args.heads)
        row["pass"] = row.pop("pass_")
        row["max_error"] = check_rows(q, k, v, row.pop("out"), rows, args, upstream)
        print_row(row, COLUMNS)
        report.append(row)
    finish_report(f"million_h{args.heads}", report, COLUMNS, args.out)


if __name__ == "__main__":
    main()
