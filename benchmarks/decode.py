"""Single-token decoding: MoBA from the KV cache vs dense attention, by context length.

Bare attention of one layer with Llama-3-8B-like heads (32 query heads, 8 KV heads,
head dim 128), batch 1, fp32. Each cache is filled with ``S`` random keys and values (the
prefill), then each step appends one token and attends with it:

- dense (SDPA GQA): write K/V into a preallocated buffer, SDPA of the new query over all
  keys with ``enable_gqa=True`` (how transformers' sdpa attention calls it);
- dense (grouped): the same buffer, the 4 query heads of a KV head as 4 query rows of one
  SDPA call (flexmoba's dense decode; the faster dense on CPU);
- MoBA: :class:`flexmoba.kv_cache.MoBAKVCache` update (K/V, O(D) chunk state) and
  :func:`flexmoba.moba_decode_attention` with ``backend="auto"`` (dense below
  ``chunk_size * top_k``, the ``gather`` backend's decode kernel above).

The three are timed in interleaved rounds in one process after a warm-up; ratios are the
median over rounds of (dense time / MoBA time), against the faster dense. The ideal is
context / keys a MoBA query attends.

    flexmoba bench decode [--seq_lens 2048 8192 32768] [--threads N] [--out benchmarks/results]
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import DEFAULT_OUT, OUT_HELP, OneLineArgumentParser, finish_report, print_row
from flexmoba import MoBAKVCache, MobaSpec, moba_decode_attention, moba_reference

COLUMNS = [
    ("seq_len", "context"), ("dense_gqa_ms", "dense SDPA GQA (ms)"), ("dense_grouped_ms", "dense grouped (ms)"),
    ("moba_ms", "MoBA (ms)"), ("moba_tok_s", "MoBA tok/s"), ("speedup", "MoBA / best dense"),
    ("speedup_gqa", "MoBA / SDPA GQA"), ("ideal", "ideal"), ("of_ideal", "% of ideal"),
    ("keys_attended", "keys attended"), ("max_err", "max err vs reference"),
]


class DenseCache:
    """A preallocated K/V buffer: the dense baselines' cache."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, extra: int, grouped: bool):
        B, H_kv, S, D = k.shape
        self.k = torch.cat([k, k.new_zeros(B, H_kv, extra, D)], dim=2)
        self.v = torch.cat([v, v.new_zeros(B, H_kv, extra, D)], dim=2)
        self.length, self.grouped = S, grouped

    def step(self, q, k_new, v_new):
        """``q: [B, H, 1, D]``, ``k_new, v_new: [B, H_kv, 1, D]`` -> ``[B, H, 1, D]``."""
        self.k[:, :, self.length] = k_new[:, :, 0]
        self.v[:, :, self.length] = v_new[:, :, 0]
        self.length += 1
        keys, values = self.k[:, :, : self.length], self.v[:, :, : self.length]
        B, H, _, D = q.shape
        if self.grouped:
            return F.scaled_dot_product_attention(q.view(B, keys.shape[1], -1, D), keys, values).view(B, H, 1, D)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=H != keys.shape[1])


def moba_step(cache: MoBAKVCache, q, k_new, v_new, spec: MobaSpec):
    cache.update(k_new, v_new)
    return moba_decode_attention(q, cache, spec)


def spec_of(args) -> MobaSpec:
    return MobaSpec(chunk_size=args.chunk_size, top_k=args.top_k)


def max_error_vs_reference(args, seq_len: int) -> float:
    """Decode the last 4 tokens of a short sequence and compare with moba_reference's rows."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, args.heads, seq_len, args.head_dim, generator=gen)
    k, v = (torch.randn(1, args.kv_heads, seq_len, args.head_dim, generator=gen) for _ in range(2))
    ref = moba_reference(q, k, v, chunk_size=args.chunk_size, top_k=args.top_k)
    spec = spec_of(args)
    cache = MoBAKVCache(spec.chunk_size)
    cache.update(k[:, :, :-4], v[:, :, :-4])
    rows = [moba_step(cache, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], spec)
            for t in range(seq_len - 4, seq_len)]
    return float((torch.cat(rows, dim=2) - ref[:, :, -4:]).abs().max())


def interleaved_seconds(fns: dict, steps: int, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each ``fn`` (called ``steps`` times per round), the methods taking
    turns within every round so that machine noise hits all of them alike."""
    times = {name: [] for name in fns}
    for r in range(warmup + rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            if r >= warmup:
                times[name].append((time.perf_counter() - start) / steps)
    return times


def measure(args, seq_len: int) -> dict:
    gen = torch.Generator().manual_seed(seq_len)
    k, v = (torch.randn(1, args.kv_heads, seq_len, args.head_dim, generator=gen) for _ in range(2))
    heads = (args.heads, args.kv_heads, args.kv_heads)  # q, k, v of one new token
    steps = [tuple(torch.randn(1, h, 1, args.head_dim, generator=gen) for h in heads) for _ in range(args.steps)]
    extra = args.steps * (args.rounds + 2)
    gqa, grouped = DenseCache(k, v, extra, grouped=False), DenseCache(k, v, extra, grouped=True)
    spec = spec_of(args)
    moba = MoBAKVCache(spec.chunk_size)
    moba.update(k, v)
    moba.update(k[:, :, :1], v[:, :, :1])  # grow the buffers now, not inside a timed step
    inputs = {name: itertools.cycle(steps) for name in ("gqa", "grouped", "moba")}
    fns = {
        "gqa": lambda: gqa.step(*next(inputs["gqa"])),
        "grouped": lambda: grouped.step(*next(inputs["grouped"])),
        "moba": lambda: moba_step(moba, *next(inputs["moba"]), spec),
    }
    with torch.no_grad():
        times = interleaved_seconds(fns, args.steps, args.rounds)
        check = seq_len <= args.check_up_to
        err = max_error_vs_reference(args, seq_len) if check else "-"
    return summarise(seq_len, times, args, err)


def summarise(seq_len: int, times: dict[str, list[float]], args, err) -> dict:
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = [min(a, b) for a, b in zip(times["gqa"], times["grouped"], strict=True)]
    speedup = statistics.median(d / m for d, m in zip(best, times["moba"], strict=True))
    keys = min(seq_len, args.top_k * args.chunk_size)
    ideal = seq_len / keys
    return dict(seq_len=seq_len, dense_gqa_ms=med["gqa"] * 1e3, dense_grouped_ms=med["grouped"] * 1e3,
                moba_ms=med["moba"] * 1e3, moba_tok_s=1 / med["moba"], speedup=speedup,
                speedup_gqa=statistics.median(d / m for d, m in zip(times["gqa"], times["moba"], strict=True)),
                ideal=ideal, of_ideal=f"{100 * speedup / ideal:.0f}%", keys_attended=keys, max_err=err)


def main(argv=None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--moba_chunk_size", dest="chunk_size", type=int, default=512)
    parser.add_argument("--moba_top_k", dest="top_k", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (after 2 warm-up rounds)")
    parser.add_argument("--check_up_to", type=int, default=4096,
                        help="compare with moba_reference (dense, O(S^2) memory) up to this context")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
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
