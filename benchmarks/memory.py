"""Peak memory of each MoBA path by sequence length, each measurement in a fresh process.

Random inputs (fp32 unless ``--dtype``) ``q: [1, H, S, D]``, ``k, v: [1, H_kv, S, D]``; MoBA at ``chunk_size``
/ ``top_k``. A measurement is the peak resident memory of one call over what the process held once its inputs existed
(:func:`benchmarks.common.peak_extra_mb`), and the call's wall time. Paths:

- ``gate``: :func:`flexmoba.select_chunks` (the Selection it returns included);
- ``gather_fwd``, ``gather_fwd_bwd``: :func:`flexmoba.moba_attention` with ``backend="gather"``, without
  gradients, and forward plus ``backward`` of its sum (q, k, v's gradients included);
- ``flex_plan``: :func:`flexmoba.moba_flex_plan` (the regrouped plan and its block tables);
- ``flex_fwd``: :func:`flexmoba.moba_attention` with ``backend="flex"`` without gradients (the compiled
  kernel; measured on a second call, after the first one compiled it);
- ``flex_fwd_bwd``: the same call, forward plus ``backward``, on the GPU's code path (no sink key, flex's own
  log-sum-exp, each piece recomputed in the backward) with the kernel replaced by its footprint
  (:func:`flex_kernel_footprint`: what the kernel returns, saves and hands back, without its arithmetic), so
  everything around the kernel is measured and the kernel's own tensors are counted, not its workspace;
- ``flex_merge``: the plan's log-sum-exp merge (:func:`flexmoba.lse_merge.merge_by_lse`), forward plus
  ``backward``, on random virtual outputs of a plan built before the call;
- ``block_mask``: :func:`flexmoba.moba_block_mask` (the union BlockMask) as CPU builds it: tables as wide as
  every key block (torch's format, quadratic), the backward's transposed tables included;
- ``block_mask_compact``: the same mask's forward tables as CUDA builds them, compact (``compact=True``,
  ``compute_q_blocks=False``);
- ``decode``: one decoding step (one new token) after an S-token prefill of a
  :class:`flexmoba.MoBAKVCache` and one step more (which grows its buffers and builds the chunk state's
  key blocks); the cache's own bytes (keys, values, chunk state, at their capacity) are reported apart.

Each doubling of S should grow a path's peak at most 2.2x (memory linear in S); the report fits
``peak = a * S + b`` per path (least squares over its points from ``--fit_from`` tokens) and gives every
point's error against the fit.

    flexmoba bench memory [--paths gate gather_fwd ...] [--seq_lens 32768 ... 1048576] [--heads 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_OUT, OUT_HELP, OneLineArgumentParser, finish_report, peak_extra_mb, print_row

PATHS = ("gate", "gather_fwd", "gather_fwd_bwd", "flex_plan", "flex_fwd", "flex_fwd_bwd", "flex_merge", "block_mask",
         "block_mask_compact", "decode")
SEQ_LENS = [2**15, 2**16, 2**17, 2**18, 2**19, 2**20]
COLUMNS = [("path", "path"), ("seq_len", "S"), ("heads", "H"), ("peak_mib", "peak (MiB)"),
           ("growth", "x per doubling"), ("fit_mib", "fit (MiB)"), ("fit_error", "fit error"),
           ("seconds", "seconds"), ("cache_mib", "KV cache (MiB)")]


def inputs(args, seq_len: int, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(seq_len)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(1, args.heads, seq_len, args.head_dim, generator=gen, dtype=dtype)
    k, v = (torch.randn(1, args.kv_heads, seq_len, args.head_dim, generator=gen, dtype=dtype) for _ in range(2))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def call_of(args, path: str, seq_len: int):
    """``(fn, extra)``: the call to measure on fresh inputs, and what to report beside it."""
    import flexmoba

    spec = flexmoba.MobaSpec(args.chunk_size, args.top_k, backend="gather")
    flex_spec = flexmoba.MobaSpec(args.chunk_size, args.top_k, backend="flex")
    q, k, v = inputs(args, seq_len, requires_grad=path.endswith("_bwd"))
    if path == "gate":
        return lambda: flexmoba.select_chunks(q, k, spec), {}
    if path == "gather_fwd":
        return lambda: torch.no_grad()(flexmoba.moba_attention)(q, k, v, spec), {}
    if path == "gather_fwd_bwd":
        return lambda: flexmoba.moba_attention(q, k, v, spec).sum().backward(), {}
    if path == "flex_plan":
        return lambda: flexmoba.moba_flex_plan(q, k, spec), {}
    if path == "flex_fwd":
        flex = torch.no_grad()(lambda: flexmoba.moba_attention(q, k, v, flex_spec))
        flex()  # compiles the kernel for this shape
        return flex, {}
    if path == "flex_fwd_bwd":
        def flex_fwd_bwd():
            with flexmoba.use_flex_attention(flex_kernel_footprint):
                flexmoba.moba_attention(q, k, v, flex_spec).sum().backward()
        return flex_fwd_bwd, {}
    if path == "flex_merge":
        return merge_step(args, q, k, spec)
    if path == "block_mask":
        return lambda: flexmoba.moba_block_mask(q, k, spec), {}
    if path == "block_mask_compact":
        return lambda: flexmoba.moba_block_mask(q, k, spec, compute_q_blocks=False, compact=True), {}
    return decode_step(args, k, v, spec)


class _KernelFootprint(torch.autograd.Function):
    """FlexAttention's tensors without its arithmetic: forward returns the output ``[B, H_kv, L, Dv]`` (q's
    dtype) and log-sum-exp ``[B, H_kv, L]`` (fp32) and saves them with q, k, v; backward allocates its fp32
    row sums ``[B, H_kv, L]`` and returns dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = torch.zeros(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        row_sums = torch.zeros_like(lse)  # noqa: F841 - allocated as the kernel does, alive until it returns
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def flex_kernel_footprint(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, *,
                          return_aux=None, **_):
    """A ``flex_attention`` with the compiled kernel's memory (:class:`_KernelFootprint`), for measuring."""
    from torch.nn.attention.flex_attention import AuxOutput

    out, lse = _KernelFootprint.apply(q, k, v)
    return (out, AuxOutput(lse=lse, max_scores=None)) if return_aux is not None else out


def merge_step(args, q, k, spec):
    """The merge's forward and backward over random virtual outputs of the plan of ``q, k``."""
    import flexmoba
    from flexmoba.lse_merge import merge_by_lse

    plan = flexmoba.moba_flex_plan(q, k, spec)
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(*plan.source.shape, q.shape[-1], generator=gen, dtype=q.dtype).requires_grad_()
    lse = torch.randn(plan.source.shape, generator=gen).requires_grad_()
    return lambda: merge_by_lse(out, lse, plan.rows, plan.valid).sum().backward(), {}


def decode_step(args, k, v, spec):
    """One new token's decoding step after the prefill ``k, v``; the cache's bytes beside it."""
    import flexmoba

    cache = flexmoba.MoBAKVCache(args.chunk_size)
    cache.update(k, v)
    new = [x[:, :, -1:].detach().clone() for x in inputs(args, 1)]

    def step():
        cache.update(new[1], new[2])
        with torch.no_grad():
            flexmoba.moba_decode_attention(new[0], cache, spec)

    step()  # the buffers double and the chunk state builds its key blocks now, not inside the measured step
    tensors = [*vars(cache).values(), *vars(cache.chunk_state).values()]
    cache_bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return step, {"cache_mib": cache_bytes / 2**20}


def measure_here(args, path: str, seq_len: int) -> dict:
    """One measurement in this process (the parent runs each in a fresh one), under the tuning profile
    ``args.profile`` (``cuda``: the code path a GPU runs, e.g. gather without the fused CPU kernel)."""
    from flexmoba.tuning import use_tuning

    changes = {"flex_table_entries": args.flex_table_entries} if args.flex_table_entries else {}
    with use_tuning(args.profile, **changes):
        return _measure(args, path, seq_len)


def _measure(args, path: str, seq_len: int) -> dict:
    fn, extra = call_of(args, path, seq_len)
    began = time.perf_counter()
    peak = peak_extra_mb(fn, torch.device("cpu"))
    return dict(path=path, seq_len=seq_len, heads=args.heads, peak_mib=peak, seconds=time.perf_counter() - began,
                **extra)


def measure_in_fresh_process(args, path: str, seq_len: int) -> dict:
    command = [sys.executable, "-m", "benchmarks.memory", "--one", path, str(seq_len), *settings(args)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return dict(path=path, seq_len=seq_len, heads=args.heads, peak_mib=None,
                    seconds=f"failed: {lines[-1] if lines else done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def settings(args) -> list[str]:
    return ["--heads", str(args.heads), "--kv_heads", str(args.kv_heads), "--head_dim", str(args.head_dim),
            "--dtype", args.dtype, "--profile", args.profile, "--flex_table_entries", str(args.flex_table_entries or 0),
            "--moba_chunk_size", str(args.chunk_size), "--moba_top_k", str(args.top_k)]


def fit_linear(rows: list[dict], fit_from: int = 0) -> None:
    """``fit_mib = a * S + b`` by least squares over a path's rows from ``fit_from`` tokens on (below, bounded
    buffers such as the gate's and gather's batched pairs are not yet full), each row's relative error to it;
    ``growth``: each row's peak over the previous (half as long) one's."""
    points = [(r["seq_len"], r["peak_mib"]) for r in rows
              if isinstance(r.get("peak_mib"), float) and r["seq_len"] >= fit_from]
    for previous, row in zip(rows, rows[1:], strict=False):
        if row["seq_len"] == 2 * previous["seq_len"] and previous.get("peak_mib") and row.get("peak_mib"):
            row["growth"] = row["peak_mib"] / previous["peak_mib"]
    if len(points) < 2:
        return
    x = torch.tensor([p[0] for p in points], dtype=torch.float64)
    y = torch.tensor([p[1] for p in points], dtype=torch.float64)
    a, b = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), y[:, None]).solution[:, 0].tolist()
    for row in rows:
        if isinstance(row.get("peak_mib"), float):
            row["fit_mib"] = a * row["seq_len"] + b
            row["fit_error"] = f"{100 * (row['fit_mib'] - row['peak_mib']) / row['peak_mib']:+.0f}%"
            row["bytes_per_token"] = a * 2**20


def main(argv=None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="what to measure (default: all)")
    parser.add_argument("--seq_lens", type=int, nargs="+", default=SEQ_LENS)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--kv_heads", type=int, default=None, help="H_kv (default: --heads)")
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--profile", choices=("cpu", "cuda"), default="cpu",
                        help="the tuning profile whose code paths run (cuda: a GPU's, here on the CPU)")
    parser.add_argument("--flex_table_entries", type=int, default=0,
                        help="the flex plan's table entries per piece (default: the profile's); smaller runs short "
                             "sequences in pieces as long ones run")
    parser.add_argument("--moba_chunk_size", dest="chunk_size", type=int, default=512)
    parser.add_argument("--moba_top_k", dest="top_k", type=int, default=3)
    parser.add_argument("--one", nargs=2, metavar=("PATH", "S"), help=argparse.SUPPRESS)  # one, in this process
    parser.add_argument("--fit_from", type=int, default=2**17, help="fit the points from this S on (default: 131072)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(measure_here(args, args.one[0], int(args.one[1]))))
        return
    rows = []
    for path in args.paths:
        measured = []
        for seq_len in sorted(args.seq_lens):
            measured.append(measure_in_fresh_process(args, path, seq_len))
            print_row(measured[-1], COLUMNS)
        fit_linear(measured, args.fit_from)
        rows += measured
    shape = f"h{args.heads}" if (args.kv_heads, args.head_dim, args.dtype) == (args.heads, 64, "float32") else \
        f"h{args.heads}_kv{args.kv_heads}_d{args.head_dim}_{args.dtype}"
    shape += "" if args.profile == "cpu" else f"_{args.profile}_profile"
    shape += f"_pieces_of_{args.flex_table_entries}" if args.flex_table_entries else ""
    finish_report(f"memory_{shape}", rows, COLUMNS, args.out)


if __name__ == "__main__":
    main()
