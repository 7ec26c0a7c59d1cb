"""Correctness of the flex paths on the benchmark device, before timing them.

For a few shapes (block 128, GQA, a sequence length that is not a multiple of 128,
token and tile granularity, documents) and dtypes fp32 and bf16, compares against
``flexmoba.moba_reference`` (dense fp32 math on the same inputs):

- MoBA ``backend="flex"``: output, and dq/dk/dv for a random output gradient (the
  reference gets the inputs in their own dtype, so that it gates, rounding chunk means to
  that dtype, exactly as flex does; its attention math is fp32 all the same);
- the benchmark's causal flex BlockMask (from tables) against SDPA causal.

The error measure is ``max |x - ref| / max |ref|`` per tensor, against a tolerance per
dtype. Without CUDA only forwards are checked (FlexAttention has no CPU backward).
Exits 1 if any check fails.

    flexmoba bench gpu_check [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import causal_block_mask
from flexmoba import compiled_flex_attention, moba_attention, moba_reference

# (B, H, H_kv, S, D, chunk, top_k, granularity, documents)
SHAPES = [
    (1, 4, 2, 2048, 64, 256, 3, "token", False),
    (2, 4, 4, 4096, 128, 512, 4, 128, False),
    (1, 2, 2, 1500, 64, 300, 2, "token", True),
]
TOLERANCE = {"float32": 5e-3, "bfloat16": 3e-2, "float16": 1e-2}  # of max |ref|


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6))


def make_inputs(shape, dtype, device, seed: int):
    """q ``[B, H, S, D]``, k/v ``[B, H_kv, S, D]``, optional document ids ``[B, S]``."""
    B, H, H_kv, S, D, *_, documents = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen)
    k, v = (torch.randn(B, H_kv, S, D, generator=gen) for _ in range(2))
    doc = None
    if documents:  # three documents per row, cut at random points
        cuts = torch.sort(torch.randint(1, S, (B, 2), generator=gen), dim=1).values
        doc = (torch.arange(S)[None, :, None] >= cuts[:, None, :]).sum(-1).to(device)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], doc


def outputs_and_grads(fn, q, k, v, grad, backward: bool) -> list[torch.Tensor]:
    """``[out]`` or ``[out, dq, dk, dv]`` of ``fn(q, k, v)`` on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    with torch.set_grad_enabled(backward):
        out = fn(*leaves)
        if not backward:
            return [out]
        out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def check(name: str, got: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> bool:
    errors = [relative_error(g, r) for g, r in zip(got, ref, strict=True)]
    ok = all(e <= tol for e in errors)
    labels = ["out", "dq", "dk", "dv"][: len(errors)]
    detail = ", ".join(f"{lab} {e:.2e}" for lab, e in zip(labels, errors, strict=True))
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail} (tol {tol:.0e})", flush=True)
    return ok


def check_shape(shape, dtype_name: str, device, backward: bool) -> bool:
    B, H, H_kv, S, D, chunk, top_k, granularity, documents = shape
    dtype = getattr(torch, dtype_name)
    (q, k, v), doc = make_inputs(shape, dtype, device, seed=S)
    grad = torch.randn_like(q)
    kw = dict(chunk_size=chunk, top_k=top_k, granularity=granularity, document_ids=doc)
    tol = TOLERANCE[dtype_name]
    name = f"{dtype_name} B{B} H{H}/{H_kv} S{S} D{D} chunk {chunk} top-k {top_k} {granularity}"
    name += " docs" if documents else ""

    def flex(q, k, v):
        return moba_attention(q, k, v, backend="flex", **kw)

    def reference(q, k, v):  # fp32 math inside; gating sees the same dtype, hence the same selection
        return moba_reference(q, k, v, **kw)

    ok = check(f"moba flex   {name}", outputs_and_grads(flex, q, k, v, grad, backward),
               outputs_and_grads(reference, q, k, v, grad, backward), tol)
    if documents:
        return ok
    mask = causal_block_mask(S, device)

    def causal_flex(q, k, v):
        return compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=H != H_kv)

    def causal_sdpa(q, k, v):
        g = H // H_kv
        return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                              v.float().repeat_interleave(g, 1), is_causal=True)

    return check(f"causal flex {name}", outputs_and_grads(causal_flex, q, k, v, grad, backward),
                 outputs_and_grads(causal_sdpa, q, k, v, grad.float(), backward), tol) and ok


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(TOLERANCE))
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--max_seq", type=int, default=None, help="skip shapes longer than this")
    p.add_argument("--shapes", type=int, nargs="+", default=list(range(len(SHAPES))),
                   help=f"indices into SHAPES (B, H, H_kv, S, D, chunk, top_k, granularity, documents): {SHAPES}")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    backward = device.type == "cuda"
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ", forward only"), flush=True)
    ok = True
    for shape in (SHAPES[i] for i in args.shapes):
        if args.max_seq is not None and shape[3] > args.max_seq:
            continue
        for dtype_name in args.dtypes:
            try:
                ok = check_shape(shape, dtype_name, device, backward) and ok
            except Exception as error:  # report and go on: one broken shape should not hide the rest
                print(f"FAIL {dtype_name} {shape}: {type(error).__name__}: {error}", flush=True)
                ok = False
    print("all checks passed" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
