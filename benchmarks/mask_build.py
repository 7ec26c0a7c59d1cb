"""Mask build time next to the attention time it serves.

For each S, chunk 512, top-k 3, both granularities: time to gate and build what the flex
backend runs (token granularity: the regrouped plan; tiles: the union BlockMask), and
the time of the compiled flex attention it serves (inference, fp32), beside SDPA causal
attention on the same inputs.

    flexmoba bench mask_build [--seq_lens 4096 8192 16384 32768] [--out benchmarks/results]
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    DEFAULT_OUT,
    OUT_HELP,
    OneLineArgumentParser,
    block_density,
    finish_report,
    median_seconds,
    print_row,
    timing_repeats,
)
from flexmoba import compiled_flex_attention, moba_block_mask, moba_flex_plan

COLUMNS = [
    ("seq_len", "S"), ("granularity", "granularity"), ("build_ms", "mask build (ms)"),
    ("flex_ms", "flex attention (ms)"), ("build_share", "build / attention"),
    ("sdpa_causal_ms", "SDPA causal (ms)"), ("block_density", "block density"),
]


def measure(seq_len: int, granularity, heads: int, head_dim: int, chunk_size: int, top_k: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(seq_len)
    q, k, v = (torch.randn(1, heads, seq_len, head_dim, generator=gen) for _ in range(3))
    kw = dict(chunk_size=chunk_size, top_k=top_k, granularity=granularity)
    flex = compiled_flex_attention()
    with torch.no_grad():
        if granularity == "token":
            def build():
                return moba_flex_plan(q, k, **kw)
            plan = build()
            block_mask, attend = plan.block_mask, lambda: plan.attention(q, k, v)
        else:
            def build():
                return moba_block_mask(q, k, **kw)
            block_mask = build()
            attend = lambda: flex(q, k, v, block_mask=block_mask)  # noqa: E731
        build_s = median_seconds(build, repeats)
        attend_s = median_seconds(attend, repeats)
        sdpa = median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)
    row = dict(seq_len=seq_len, granularity=str(granularity), build_ms=build_s * 1e3, flex_ms=attend_s * 1e3,
               build_share=build_s / attend_s, sdpa_causal_ms=sdpa * 1e3)
    if granularity != "token":
        row["block_density"] = block_density(block_mask, seq_len)
    return row


def main(argv=None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--moba_chunk_size", dest="chunk_size", type=int, default=512)
    parser.add_argument("--moba_top_k", dest="top_k", type=int, default=3)
    parser.add_argument("--tile", type=int, default=128, help="tile size of the tile-granularity rows")
    parser.add_argument("--repeats", type=timing_repeats, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    args = parser.parse_args(argv)

    compiled_flex_attention()
    rows = []
    for seq_len in args.seq_lens:
        for granularity in ("token", args.tile):
            row = measure(seq_len, granularity, args.heads, args.head_dim, args.chunk_size, args.top_k, args.repeats)
            print_row(row, COLUMNS)
            rows.append(row)
    finish_report("mask_build", rows, COLUMNS, args.out)


if __name__ == "__main__":
    main()
