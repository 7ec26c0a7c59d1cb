"""Context parallelism: memory per rank of one MoBA attention layer, and work per rank.

    python -m benchmarks.context_parallel --out benchmarks/results

- Measured: peak extra memory (CPU: resident high-water mark, :func:`benchmarks.common.peak_extra_mb`)
  of one forward and backward of the attention layer (gather backend, fp32) at 32K, in one
  process (context parallelism 1) and in each of 2 gloo processes under torchrun (2); the
  all-gathered keys and values and their gradients are part of it, this rank's q, k, v are not.
- Work per rank: (query, key) pairs each rank's selection attends at 32K (chunk 512, top-3),
  2 and 4 ranks, max / mean; full causal attention's for comparison (closed form).
- Computed, not measured: memory per rank at 128K / 512K / 1M for 1, 2, 4 and 8 ranks from
  the shapes (:func:`modelled_bytes`), checked against the measurement at 32K.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import DEFAULT_OUT, OUT_HELP, OneLineArgumentParser, peak_extra_mb, settle_malloc
from flexmoba import MobaSpec
from flexmoba.context_parallel import ContextParallel, attended_pairs_per_rank, context_parallel_attention

SEQ = 32768
SHAPE = {"B": 1, "H": 8, "H_kv": 2, "D": 128}
SPEC = MobaSpec(512, 3, backend="gather")


def inputs(seq_len: int, cp: ContextParallel, seed: int = 0):
    """This rank's ``q [B, H, S / n, D]``, ``k, v [B, H_kv, S / n, D]`` and output gradient (fp32)."""
    gen = torch.Generator().manual_seed(seed + cp.rank)
    B, H, H_kv, D = SHAPE["B"], SHAPE["H"], SHAPE["H_kv"], SHAPE["D"]
    local = seq_len // cp.size
    q, k, v = (torch.randn(B, h, local, D, generator=gen).requires_grad_() for h in (H, H_kv, H_kv))
    return q, k, v, torch.randn(B, H, local, D, generator=gen)


def layer_peak_mb(seq_len: int, cp: ContextParallel) -> float:
    q, k, v, grad_out = inputs(seq_len, cp)

    def step():
        out = context_parallel_attention(q, k, v, cp, SPEC)
        out.backward(grad_out)

    return peak_extra_mb(step, torch.device("cpu"))


def rank_main(out: Path) -> None:
    """One rank under torchrun: its peak, to ``out/rank<r>.json``."""
    settle_malloc()
    dist.init_process_group("gloo")
    cp = ContextParallel.of()
    peak = layer_peak_mb(SEQ, cp)
    (out / f"rank{cp.rank}.json").write_text(json.dumps({"rank": cp.rank, "peak_mb": peak}))
    dist.destroy_process_group()


def measured_two_ranks(tmp: Path) -> list[float]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "benchmarks.context_parallel", "--rank", str(tmp)], check=True, env=env)
    return [json.loads((tmp / f"rank{r}.json").read_text())["peak_mb"] for r in (0, 1)]


def work_balance(seq_len: int = SEQ) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, SHAPE["H"], seq_len, SHAPE["D"], generator=gen)
    k = torch.randn(1, SHAPE["H_kv"], seq_len, SHAPE["D"], generator=gen)
    rows = []
    for n in (2, 4):
        work = attended_pairs_per_rank(q, k, SPEC, n)
        local = seq_len // n
        full = [sum(t + 1 for t in range(r * local, (r + 1) * local)) for r in range(n)]
        rows.append({"ranks": n, "moba_pairs": work, "moba_max_over_mean": max(work) / (sum(work) / n),
                     "full_max_over_mean": max(full) / (sum(full) / n)})
    return rows


def modelled_bytes(seq_len: int, ranks: int, H: int, H_kv: int, D: int, chunk: int, top_k: int,
                   act_bytes: int) -> dict[str, float]:
    """Peak per rank of one layer's forward and backward (gather backend), from the shapes.

    - keys and values all-gathered, and their gradients before the reduce-scatter: ``4 S H_kv D``;
    - the gate on the local queries: fp32 scores and their int64 tie-broken keys, two of each
      alive at once, over every chunk: ``24 H (S / n) (S / chunk)`` bytes;
    - the query side: output, dq, and per (query, past chunk) pair a copy of its query, output
      and gradient: ``(3 (top_k - 1) + 3) H (S / n) D``.
    """
    local, chunks = seq_len // ranks, seq_len / chunk
    return {"kv": 4 * seq_len * H_kv * D * act_bytes,
            "gate": 24 * H * local * chunks,
            "queries": (3 * (top_k - 1) + 3) * H * local * D * act_bytes}


def cpu_model_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def report(out: Path) -> Path:
    settle_malloc()
    one = layer_peak_mb(SEQ, ContextParallel(0, 1))
    two = measured_two_ranks(out / "context_parallel_ranks")
    balance = work_balance()
    shape = {**SHAPE, "chunk": SPEC.chunk_size, "top_k": SPEC.top_k}
    model = {n: sum(modelled_bytes(SEQ, n, SHAPE["H"], SHAPE["H_kv"], SHAPE["D"], 512, 3, 4).values()) / 2**20
             for n in (1, 2)}
    big = {"H": 32, "H_kv": 8, "D": 128, "chunk": 512, "top_k": 3, "act_bytes": 2}
    lines = [
        "# Context parallelism: memory and work per rank",
        "",
        f"CPU: {cpu_model_name()} ({os.cpu_count()} cores), torch {torch.__version__}. "
        "`python -m benchmarks.context_parallel --out benchmarks/results`.",
        "",
        f"## Measured: one MoBA attention layer at {SEQ} tokens, forward + backward",
        "",
        f"B={SHAPE['B']}, H={SHAPE['H']}, H_kv={SHAPE['H_kv']}, D={SHAPE['D']}, chunk 512, top-3, gather backend, "
        "fp32. Peak extra resident memory over the rank's own q, k, v (all-gathered keys and values, "
        "the gate, the attention and every gradient included); 2 ranks: 2 gloo processes under torchrun.",
        "",
        "| ranks | peak per rank (MiB), measured | modelled (MiB) |",
        "|---|---|---|",
        f"| 1 | {one:.0f} | {model[1]:.0f} |",
        f"| 2 | {max(two):.0f} (rank 0: {two[0]:.0f}, rank 1: {two[1]:.0f}) | {model[2]:.0f} |",
        "",
        f"Ratio 1 rank / 2 ranks: **{one / max(two):.2f}** measured, {model[1] / model[2]:.2f} modelled.",
        "",
        f"## Work per rank at {SEQ} tokens (chunk 512, top-3), from the selection",
        "",
        "| ranks | MoBA pairs per rank | MoBA max / mean | full attention max / mean |",
        "|---|---|---|---|",
        *[f"| {r['ranks']} | {', '.join(f'{w:,}' for w in r['moba_pairs'])} | {r['moba_max_over_mean']:.3f} | "
          f"{r['full_max_over_mean']:.3f} |" for r in balance],
        "",
        "## Computed from the shapes (not measured): memory per rank of one layer",
        "",
        f"H={big['H']}, H_kv={big['H_kv']}, D={big['D']}, chunk 512, top-3, bf16 activations, fp32 gate "
        "(`modelled_bytes`: gathered K/V and their gradients, the gate, the query side), GiB:",
        "",
        "| tokens | 1 rank | 2 ranks | 4 ranks | 8 ranks |",
        "|---|---|---|---|---|",
    ]
    for seq in (131072, 524288, 1048576):
        cells = [sum(modelled_bytes(seq, n, big["H"], big["H_kv"], big["D"], 512, 3, 2).values()) / 2**30
                 for n in (1, 2, 4, 8)]
        lines.append(f"| {seq // 1024}K | " + " | ".join(f"{c:,.1f}" for c in cells) + " |")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "context_parallel.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "context_parallel.json").write_text(json.dumps(
        {"shape": shape, "seq_len": SEQ, "peak_mb": {"1": one, "2": two}, "balance": balance}, indent=2))
    print(path.read_text())
    return path


def main(argv: list[str] | None = None) -> None:
    parser = OneLineArgumentParser(prog="flexmoba bench context_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    parser.add_argument("--rank", type=Path, help=argparse.SUPPRESS)  # one rank under torchrun
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank)
    else:
        report(args.out)


if __name__ == "__main__":
    main()
