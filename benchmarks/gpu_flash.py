"""FlexAttention's Triton kernels against its FLASH backend (flash-attn's CuTe DSL), forward+backward.

Runs only where ``flash_attn.cute`` imports (otherwise "not available"), on CUDA, in bf16
with (128, 128) blocks and head dim 128: FLASH needs (128, 128) blocks on Hopper and a
BlockMask with full-block tables, which both masks here have. Two cases, each through
compiled flex with ``kernel_options={"BACKEND": "TRITON"}`` and ``{"BACKEND": "FLASH"}``:

- causal: a causal BlockMask built from tables (``benchmarks.common.causal_block_mask``);
- moba plan: MoBA's regrouped plan (``flexmoba.moba_flex_plan``), whose flex call also
  returns the log-sum-exp.

Each backend's out/dq/dk/dv is held to the fp32 oracle (``flexmoba.moba_reference``) and to
the other backend, as ``max |x - y| / max |oracle|``, and one forward+backward is timed
(median of --repeats). Not under deterministic mode: FLASH's block-sparse backward has no
deterministic version before SM100.

    python -m benchmarks.gpu_flash [--seq_len 8192 --config 512:3]
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.common import OneLineArgumentParser, causal_block_mask, markdown_table, median_seconds, timing_repeats
from benchmarks.device import describe
from benchmarks.gpu_check import outputs_and_grads
from benchmarks.verdict import one_line, verdict
from flexmoba import compiled_flex_attention, moba_flex_plan, moba_reference

BLOCK = (128, 128)
TOLERANCE = 3e-2  # bf16, of max |oracle|
TENSORS = ("out", "dq", "dk", "dv")


def flash_import_error() -> str | None:
    """Why ``flash_attn.cute`` does not import, or None when it does."""
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as error:  # ImportError, or a broken install raising anything at import
        return one_line(error)
    return None


def relative(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> float:
    return float((x.float() - y.float()).abs().max() / scale.float().abs().max().clamp(min=1e-6))


def compare(case: str, backends: dict[str, Callable], oracle: Callable, q, k, v, grad, *, backward: bool,
            tolerance: float = TOLERANCE, repeats: int = 3) -> dict:
    """Two backends of one case against the oracle and each other; times one forward+backward of each.

    Returns a row: ``<backend> vs oracle``, ``<a> vs <b>`` (worst tensor), ``<backend> ms``,
    ``ok`` and ``error`` (the first exception, if any).
    """
    row = {"case": case, "ok": False, "error": None}
    try:
        ref = outputs_and_grads(oracle, q, k, v, grad, backward)
        got = {}
        for name, fn in backends.items():
            got[name] = outputs_and_grads(fn, q, k, v, grad, backward)
            row[f"{name} vs oracle"] = max(relative(g, r, r) for g, r in zip(got[name], ref, strict=True))
        (a, ra), (b, rb) = got.items()
        row[f"{a} vs {b}"] = max(relative(x, y, r) for x, y, r in zip(ra, rb, ref, strict=True))
        row["ok"] = all(value <= tolerance for key, value in row.items() if " vs " in key)
        for name, fn in backends.items():
            step = partial(outputs_and_grads, fn, q, k, v, grad, backward)
            row[f"{name} ms"] = 1e3 * median_seconds(step, repeats=repeats)
    except Exception as error:  # reported; the other case goes on
        row["error"] = one_line(error)
    return row


def describe_row(row: dict) -> str:
    if row["error"]:
        return f"{row['case']}: {row['error']}"
    parts = [f"{key} {value:.1e}" for key, value in row.items() if " vs " in key]
    parts += [f"{key} {value:.2f}" for key, value in row.items() if key.endswith(" ms")]
    return f"{row['case']}: " + ", ".join(parts)


def main(argv=None) -> int:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--config", default="512:3", help="chunk:top_k of the moba plan case")
    p.add_argument("--repeats", type=timing_repeats, default=3)
    p.add_argument("--out", default=None, help="Markdown table of the comparison (default: none)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    print(describe(device), flush=True)
    missing = flash_import_error()
    if missing:
        return verdict("flash", "SKIP", f"not available: flash_attn.cute does not import ({missing})")
    if device.type != "cuda":
        return verdict("flash", "SKIP", f"not available on {device.type}: BACKEND='FLASH' is CUDA only")

    B, H, H_kv, S, D = args.batch, args.heads, args.kv_heads, args.seq_len, args.head_dim
    chunk, top_k = map(int, args.config.split(":"))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=gen).to(device, torch.bfloat16)
    k, v = (torch.randn(B, H_kv, S, D, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    grad = torch.randn(B, H, S, D, generator=gen).to(device, torch.bfloat16)
    flex = compiled_flex_attention()
    mask = causal_block_mask(S, device, block=BLOCK[0])
    options = {name: {"BACKEND": name} for name in ("TRITON", "FLASH")}

    def causal(opts):
        return lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=H != H_kv, kernel_options=opts)

    def plan(opts):
        def run(q, k, v):  # q is a leaf that needs grad here, so the plan builds its backward tables
            moba = moba_flex_plan(q, k, chunk_size=chunk, top_k=top_k, block_size=BLOCK, sink=False)
            return moba.attention(q, k, v, flex=partial(flex, kernel_options=opts))
        return run

    cases = [
        (f"causal S{S}", causal, lambda q, k, v: moba_reference(q, k, v, chunk_size=S, top_k=1)),
        (f"moba plan {chunk}/{top_k} S{S}", plan,
         lambda q, k, v: moba_reference(q, k, v, chunk_size=chunk, top_k=top_k)),
    ]
    rows = []
    for case, make, oracle in cases:
        row = compare(case, {name: make(opts) for name, opts in options.items()}, oracle, q, k, v, grad,
                      backward=True, repeats=args.repeats)
        rows.append(row)
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {describe_row(row)}", flush=True)
    if args.out:
        columns = [(key, key) for key in rows[0] if key not in ("ok", "error")] + [("error", "error")]
        with open(args.out, "w") as f:
            f.write(markdown_table(rows, columns) + "\n")
    shape = f"bf16 B{B} H{H}/{H_kv} D{D}, blocks {BLOCK}, tolerance {TOLERANCE:.0e}"
    failed = [r for r in rows if not r["ok"]]
    status = "FAIL" if failed else "PASS"
    return verdict("flash", status, f"{shape}: " + "; ".join(describe_row(r) for r in (failed or rows)))


if __name__ == "__main__":
    sys.exit(main())
