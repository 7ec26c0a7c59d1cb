"""Two identical flex forward+backward runs, bitwise equal in deterministic mode.

With ``torch.use_deterministic_algorithms(True)`` and inductor's deterministic mode
(``torch._inductor.config.deterministic``: no on-device benchmarking that changes numerics,
no autotuning; torch 2.13 also turns it on with the former, it is set here explicitly all the
same, for this process only), MoBA through ``backend="flex"`` (gate,
regrouped plan, compiled flex, log-sum-exp merge) runs twice on the same inputs and output
gradient; out, dq, dk and dv must be bitwise equal. Forward only where flex has no backward
(CPU).

    python -m benchmarks.gpu_determinism [--seq_len 4096 --config 512:3 --dtype bfloat16]
"""

from __future__ import annotations

import os
import sys

import torch
import torch._inductor.config as inductor_config

from benchmarks.common import OneLineArgumentParser
from benchmarks.device import describe
from benchmarks.gpu_check import outputs_and_grads
from benchmarks.verdict import one_line, verdict
from flexmoba import moba_attention

TENSORS = ("out", "dq", "dk", "dv")


def differences(first: list[torch.Tensor], second: list[torch.Tensor]) -> dict[str, float]:
    """Max absolute difference of each tensor pair that is not bitwise equal (NaNs in place count as equal)."""
    diff = {}
    for name, a, b in zip(TENSORS[:len(first)], first, second, strict=True):
        if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a.nan_to_num(), b.nan_to_num()):
            diff[name] = float((a.float() - b.float()).abs().nan_to_num(float("inf")).max())
    return diff


def compare_runs(run, repeats: int = 2) -> tuple[str, str]:
    """Run ``run()`` (returning a list of tensors) ``repeats`` times; the verdict on their equality."""
    first = run()
    for i in range(1, repeats):
        diff = differences(first, run())
        if diff:
            detail = ", ".join(f"{name} max |diff| {d:.2e}" for name, d in diff.items())
            return "FAIL", f"run {i + 1} differs from run 1: {detail}"
    names = "/".join(TENSORS[:len(first)])
    return "PASS", f"{repeats} runs bitwise equal ({names})"


def main(argv=None) -> int:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--config", default="512:3", help="chunk:top_k")
    args = p.parse_args(argv)
    # Deterministic cuBLAS needs a fixed workspace, read when the first handle is made (no CUDA work yet).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device(args.device)
    print(describe(device), flush=True)
    chunk, top_k = map(int, args.config.split(":"))
    dtype = getattr(torch, args.dtype)
    backward = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    B, H, H_kv, S, D = args.batch, args.heads, args.kv_heads, args.seq_len, args.head_dim
    q = torch.randn(B, H, S, D, generator=gen).to(device, dtype)
    k, v = (torch.randn(B, H_kv, S, D, generator=gen).to(device, dtype) for _ in range(2))
    grad = torch.randn(B, H, S, D, generator=gen).to(device, dtype)

    def flex(q, k, v):
        return moba_attention(q, k, v, chunk_size=chunk, top_k=top_k, backend="flex")

    shape = f"moba flex {args.dtype} B{B} H{H}/{H_kv} S{S} D{D} {chunk}/{top_k}"
    try:
        torch.use_deterministic_algorithms(True)
        with inductor_config.patch(deterministic=True):
            mode = (f"deterministic algorithms {torch.are_deterministic_algorithms_enabled()}, "
                    f"inductor deterministic {inductor_config.deterministic}")
            status, why = compare_runs(lambda: outputs_and_grads(flex, q, k, v, grad, backward))
    except Exception as error:
        return verdict("determinism", "FAIL", f"{shape}: {one_line(error)}")
    fwd_only = "" if backward else " (forward only: no flex backward on CPU)"
    return verdict("determinism", status, f"{shape}: {why}{fwd_only}; {mode}")


if __name__ == "__main__":
    sys.exit(main())
