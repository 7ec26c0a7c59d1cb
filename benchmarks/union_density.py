"""How sparse MoBA's BlockMask really is, layer by layer: union (original query order) vs regrouped.

A union ``BlockMask`` visits, for each tile of ``Bq`` consecutive queries, every key block
any of them selected. For each layer of a checkpoint (or random inputs) and each query
tile size, this reports:

    union density     blocks the union mask visits / causal blocks
    union visited     (query, key) pairs in those blocks / pairs MoBA attends
    regrouped visited the same for the regrouped plan (flexmoba.backends.flex.plan, block 128)

1.0 visited/attended is perfectly sparse; a dense causal kernel sits at the FLOP ideal.
No timing: the counts come from the block tables.

    flexmoba bench union_density --ckpt runs/moba/checkpoints/last.ckpt --seq_len 8192
    flexmoba bench union_density --seq_len 32768            # random inputs, 4 heads
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import (
    BLOCK,
    DEFAULT_OUT,
    OUT_HELP,
    OneLineArgumentParser,
    capture_qkv,
    finish_report,
    load_checkpoint_model,
    print_row,
)
from flexmoba import select_chunks, selection_block_mask
from flexmoba.backends.flex.plan import plan_from_selection
from flexmoba.pair_counts import selection_pairs

COLUMNS = [
    ("inputs", "inputs"), ("layer", "layer"), ("seq_len", "S"), ("config", "chunk/top-k"), ("tile", "query tile"),
    ("union_density", "union density"), ("union_visited", "union visited/attended"),
    ("regrouped_visited", "regrouped visited/attended"), ("flop_ideal", "FLOP ideal"),
]


@torch.no_grad()
def layer_rows(q, k, chunk_size: int, top_k: int, tiles: list[int]) -> list[dict]:
    B, H, S, _ = q.shape
    selection = select_chunks(q, k, chunk_size=chunk_size, top_k=top_k)
    attended = selection_pairs(selection)
    plan = plan_from_selection(selection, k.shape[1], block_size=BLOCK)
    rows = []
    for tile in tiles:
        mask = selection_block_mask(selection, (tile, BLOCK), compute_q_blocks=False)
        blocks = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
        n_tiles, n_blocks = -(-S // tile), -(-S // BLOCK)
        causal = B * H * sum(min(n_blocks, (t * tile + tile - 1) // BLOCK + 1) for t in range(n_tiles))
        rows.append(dict(seq_len=S, config=f"{chunk_size}/{top_k}", tile=tile, union_density=blocks / causal,
                         union_visited=blocks * tile * BLOCK / attended,
                         regrouped_visited=plan.visited_area() / attended,
                         flop_ideal=B * H * S * (S + 1) / 2 / attended))
    return rows


def main(argv=None) -> None:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", type=Path, help="flexmoba checkpoint (default: random inputs)")
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--tiles", type=int, nargs="+", default=[128, 64, 32, 16])
    p.add_argument("--moba_chunk_size", dest="chunk_size", type=int, help="default: the checkpoint's, else 512")
    p.add_argument("--moba_top_k", dest="top_k", type=int, help="default: the checkpoint's, else 3")
    p.add_argument("--heads", type=int, default=4, help="H for random inputs")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    args = p.parse_args(argv)
    if args.ckpt is not None:
        model = load_checkpoint_model(args.ckpt, torch.device("cpu"))
        layers = capture_qkv(model, args.seq_len, torch.device("cpu"))
        chunk, top_k, inputs = model.config.moba.chunk_size, model.config.moba.top_k, "checkpoint"
    else:
        gen = torch.Generator().manual_seed(args.seq_len)
        layers = [tuple(torch.randn(1, args.heads, args.seq_len, 64, generator=gen) for _ in range(3))]
        chunk, top_k, inputs = 512, 3, "random"
    chunk, top_k = args.chunk_size or chunk, args.top_k or top_k
    rows = []
    for layer, (q, k, _) in enumerate(layers):
        for row in layer_rows(q, k, chunk, top_k, args.tiles):
            row = dict(inputs=inputs, layer=layer, **row)
            print_row(row, COLUMNS)
            rows.append(row)
    finish_report(f"union_density_{inputs}", rows, COLUMNS, args.out)


if __name__ == "__main__":
    main()
