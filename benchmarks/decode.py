"""Single-token decoding throughput: MoBA from the KV cache vs dense attention (issue 7).

Bare attention of one layer with Llama-3-8B-like heads (32 query heads, 8 KV heads,
head dim 128), batch 1, fp32. The cache is filled with ``S`` random keys and values (the
prefill), then each step appends one token and attends with it:

- dense: write K/V into a preallocated buffer, SDPA of the new query over all keys;
- MoBA: :class:`flexmoba.decode.MoBAKVCache` update (K/V plus O(D) chunk-sum update),
  gate over the chunk means, gather the top-k chunks' keys, attend.

    python -m benchmarks.decode [--seq-lens 8192 32768] [--threads N] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import finish_report, median_seconds, print_row
from flexmoba import moba_reference
from flexmoba.decode import MoBAKVCache, moba_decode_attention

COLUMNS = [
    ("seq_len", "context"), ("dense_ms", "dense step (ms)"), ("moba_ms", "MoBA step (ms)"),
    ("dense_tok_s", "dense tok/s"), ("moba_tok_s", "MoBA tok/s"), ("speedup", "MoBA / dense"),
    ("keys_attended", "keys attended (MoBA)"), ("max_err", "max err vs reference"),
]


class DenseCache:
    """A preallocated K/V buffer: the dense baseline's cache."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, extra: int):
        B, H_kv, S, D = k.shape
        self.k = torch.cat([k, k.new_zeros(B, H_kv, extra, D)], dim=2)
        self.v = torch.cat([v, v.new_zeros(B, H_kv, extra, D)], dim=2)
        self.length = S

    def step(self, q, k_new, v_new):
        self.k[:, :, self.length] = k_new[:, :, 0]
        self.v[:, :, self.length] = v_new[:, :, 0]
        self.length += 1
        keys, values = self.k[:, :, : self.length], self.v[:, :, : self.length]
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=q.shape[1] != keys.shape[1])


def moba_step(cache: MoBAKVCache, q, k_new, v_new, top_k: int):
    cache.update(k_new, v_new)
    return moba_decode_attention(q, cache, top_k=top_k)


def max_error_vs_reference(args, seq_len: int) -> float:
    """Decode the last 4 tokens of a short sequence and compare with moba_reference's rows."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, args.heads, seq_len, args.head_dim, generator=gen)
    k, v = (torch.randn(1, args.kv_heads, seq_len, args.head_dim, generator=gen) for _ in range(2))
    ref = moba_reference(q, k, v, chunk_size=args.chunk_size, top_k=args.top_k)
    cache = MoBAKVCache(args.chunk_size)
    cache.update(k[:, :, :-4], v[:, :, :-4])
    rows = [moba_step(cache, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], args.top_k)
            for t in range(seq_len - 4, seq_len)]
    return float((torch.cat(rows, dim=2) - ref[:, :, -4:]).abs().max())


def measure(args, seq_len: int) -> dict:
    gen = torch.Generator().manual_seed(seq_len)
    k, v = (torch.randn(1, args.kv_heads, seq_len, args.head_dim, generator=gen) for _ in range(2))
    heads = (args.heads, args.kv_heads, args.kv_heads)  # q, k, v of one new token
    steps = [tuple(torch.randn(1, h, 1, args.head_dim, generator=gen) for h in heads) for _ in range(args.steps)]
    extra = args.steps * (args.repeats + 2)
    dense = DenseCache(k, v, extra)
    moba = MoBAKVCache(args.chunk_size)
    moba.update(k, v)
    moba.update(k[:, :, :1], v[:, :, :1])  # grow the buffers now, not inside a timed step
    with torch.no_grad():
        dense_s = median_seconds(lambda: [dense.step(*s) for s in steps], args.repeats) / args.steps
        moba_s = median_seconds(lambda: [moba_step(moba, *s, args.top_k) for s in steps], args.repeats) / args.steps
        check = seq_len <= args.check_up_to
        err = max_error_vs_reference(args, seq_len) if check else float("nan")
    return dict(seq_len=seq_len, dense_ms=dense_s * 1e3, moba_ms=moba_s * 1e3, dense_tok_s=1 / dense_s,
                moba_tok_s=1 / moba_s, speedup=dense_s / moba_s,
                keys_attended=min(seq_len, args.top_k * args.chunk_size), max_err=err if check else "-")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-up-to", type=int, default=4096,
                        help="compare with moba_reference (dense, O(S^2) memory) up to this context")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = []
    for seq_len in args.seq_lens:
        row = measure(args, seq_len)
        print_row(row, COLUMNS)
        rows.append(row)
    finish_report("decode", rows, COLUMNS, args.out)


if __name__ == "__main__":
    main()
