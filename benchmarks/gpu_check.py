"""Every method ``benchmarks/gpu.sh`` times, checked against the fp32 oracle on the device first.

The methods (``moba_flex``: the regrouped plan, ``moba_flex_union``, ``moba_gather``,
``sdpa_causal``) run through the very runners :mod:`benchmarks.attention` times. The oracle is
:func:`flexmoba.moba_reference`: dense fp32 math, given the inputs in their own dtype so that it
gates exactly as the method does (chunk means rounded to that dtype); causal attention is
``moba_reference`` with one chunk covering the sequence. Compared: the output, and dq/dk/dv for
a random output gradient where the method has a backward on the device (flex has none on CPU),
as ``max |x - ref| / max |ref|`` per tensor against a tolerance per dtype. The first dtype (the
timed one) is checked on every config, the others on the first config (each new shape and dtype
compiles new flex kernels). One more case runs ``moba_flex`` with documents at a length off the
block grid (the first dtype only).

The last case, ``union_compact``, checks the union mask's compact tables (``compact=True``, only as
wide as a query tile can read; CUDA's default) against the same mask at torch's full width through the
same compiled kernel, forward and backward, at a length where compact is narrower (``--compact_seq_len``,
65536, chunk 128, top-2: 259 columns of 512).

``--out`` (JSON) is rewritten after every check, so a part cut short still tells the timing
part which methods passed; :func:`not_timed` reads it. A Markdown table goes beside it.

    python -m benchmarks.gpu_check --out runs/benchmarks/gpu/checks.json
    python -m benchmarks.gpu_check --device cpu --seq_len 256 --heads 2 --kv_heads 1 --head_dim 16 \\
        --configs 64:2 --dtypes float32 --docs_seq_len 256 --out /tmp/checks.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.attention import BASELINES, MOBA_BACKENDS, Case, baseline_runner, moba_runner
from benchmarks.common import OneLineArgumentParser, markdown_table
from benchmarks.device import describe
from benchmarks.verdict import one_line, verdict
from flexmoba import moba_attention, moba_reference, select_chunks, selection_block_mask
from flexmoba.backends.flex.compiled import active_flex_attention

METHODS = ("moba_flex", "moba_flex_union", "moba_gather", "sdpa_causal")  # what gpu.sh times
TOLERANCE = {"float32": 5e-3, "bfloat16": 3e-2, "float16": 1e-2}  # of max |ref|
TENSORS = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    chunk_size: int
    top_k: int
    documents: bool = False

    @property
    def label(self) -> str:
        moba = f"{self.chunk_size}/{self.top_k}" if self.chunk_size else "causal"
        docs = " docs" if self.documents else ""
        return f"B{self.batch} H{self.heads}/{self.kv_heads} S{self.seq_len} D{self.head_dim} {moba}{docs}"


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6))


def make_inputs(shape: Shape, dtype, device, seed: int):
    """q ``[B, H, S, D]``, k/v ``[B, H_kv, S, D]``, and ``[B, S]`` document ids (three per row) or None."""
    B, S = shape.batch, shape.seq_len
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, shape.heads, S, shape.head_dim, generator=gen)
    k, v = (torch.randn(B, shape.kv_heads, S, shape.head_dim, generator=gen) for _ in range(2))
    doc = None
    if shape.documents:
        cuts = torch.sort(torch.randint(1, S, (B, 2), generator=gen), dim=1).values
        doc = (torch.arange(S)[None, :, None] >= cuts[:, None, :]).sum(-1).to(device)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], doc


def outputs_and_grads(fn, q, k, v, grad, backward: bool) -> list[torch.Tensor]:
    """``[out]`` or ``[out, dq, dk, dv]`` of ``fn(q, k, v)`` on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    with torch.set_grad_enabled(backward):
        out = fn(*leaves)
        if not backward:
            return [out.detach()]
        out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def union_mask_call(shape: Shape, compact: bool):
    """flex over the union mask of ``q``'s selection, its tables compact or as wide as every key block."""
    def forward(q, k, v):
        selection = select_chunks(q, k, chunk_size=shape.chunk_size, top_k=shape.top_k)
        block_mask = selection_block_mask(selection, compute_q_blocks=q.requires_grad, compact=compact)
        return active_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return forward


def method_under_test(method: str, shape: Shape, q, k, v, doc):
    """(forward(q, k, v), whether it has a backward here, the oracle's forward)."""
    if method == "union_compact":
        return union_mask_call(shape, True), q.device.type == "cuda", union_mask_call(shape, False)
    if method == "sdpa_causal":
        runner = baseline_runner(Case(method, q, k, v))
        return runner.forward, runner.backward_ok, lambda q, k, v: moba_reference(
            q, k, v, chunk_size=shape.seq_len, top_k=1)  # one chunk: causal attention
    kw = dict(chunk_size=shape.chunk_size, top_k=shape.top_k, document_ids=doc)

    def oracle(q, k, v):
        return moba_reference(q, k, v, **kw)

    if doc is None:
        runner = moba_runner(Case(method, q, k, v, shape.chunk_size, shape.top_k))
        return runner.forward, runner.backward_ok, oracle
    backend = MOBA_BACKENDS[method]

    def forward(q, k, v):
        return moba_attention(q, k, v, backend=backend, **kw)
    return forward, not backend.startswith("flex") or q.device.type == "cuda", oracle


def check(method: str, shape: Shape, dtype_name: str, device: torch.device) -> dict:
    """One check's record: errors per tensor, ``ok``, and ``error`` if it raised."""
    record = {"method": method, "shape": shape.label, "dtype": dtype_name, "tolerance": TOLERANCE[dtype_name],
              "backward": False, "errors": {}, "ok": False, "error": None}
    try:
        (q, k, v), doc = make_inputs(shape, getattr(torch, dtype_name), device, seed=shape.seq_len)
        forward, backward, oracle = method_under_test(method, shape, q, k, v, doc)
        grad = torch.randn_like(q)
        got = outputs_and_grads(forward, q, k, v, grad, backward)
        ref = outputs_and_grads(oracle, q, k, v, grad, backward)
        record["backward"] = backward
        record["errors"] = {name: relative_error(g, r) for name, g, r in zip(TENSORS[:len(got)], got, ref, strict=True)}
        record["ok"] = all(e <= record["tolerance"] for e in record["errors"].values())
    except Exception as error:  # reported; the other checks go on
        record["error"] = one_line(error)
    return record


def describe_record(r: dict) -> str:
    if r["error"]:
        return f"{r['method']} {r['dtype']} {r['shape']}: {r['error']}"
    detail = ", ".join(f"{name} {e:.1e}" for name, e in r["errors"].items())
    fwd_only = "" if r["backward"] else " (forward only)"
    return f"{r['method']} {r['dtype']} {r['shape']}: {detail} (tol {r['tolerance']:.0e}){fwd_only}"


def write(records: list[dict], device_line: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device_line, "checks": records}, indent=2))
    rows = [{"result": "FAIL" if r["error"] or not r["ok"] else "ok", "check": describe_record(r)} for r in records]
    out.with_suffix(".md").write_text(markdown_table(rows, [("result", "result"), ("check", "check")]) + "\n")


def not_timed(path: Path, methods) -> dict[str, str]:
    """method -> why it must not be timed, by the checks in ``path``: a failed check, or none at all."""
    try:
        records = json.loads(Path(path).read_text())["checks"]
    except (OSError, ValueError, KeyError) as error:
        return {m: f"not timed: no oracle checks ({one_line(error, 80)})" for m in methods}
    why = {}
    for method in methods:
        own = [r for r in records if r["method"] == method]
        failed = [r for r in own if r["error"] or not r["ok"]]
        if failed:
            why[method] = f"not timed: failed its oracle check ({describe_record(failed[0])})"
        elif not own:
            why[method] = "not timed: no oracle check ran"
    return why


def summary(records: list[dict]) -> tuple[str, str]:
    failed = [r for r in records if r["error"] or not r["ok"]]
    if not records:
        return "FAIL", "no checks ran"
    if failed:
        return "FAIL", f"{len(failed)}/{len(records)} checks failed: " + "; ".join(map(describe_record, failed[:3]))
    worst = max(records, key=lambda r: max(r["errors"].values()) / r["tolerance"])
    methods = sorted({r["method"] for r in records})
    fwd_only = sorted({r["method"] for r in records if not r["backward"]})
    note = f"; forward only: {', '.join(fwd_only)}" if fwd_only else ""
    return "PASS", (f"{len(records)} checks of {', '.join(methods)} within tolerance{note}; "
                    f"closest to its tolerance: {describe_record(worst)}")


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--configs", nargs="+", default=["512:3", "128:8"], help="chunk:top_k pairs")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(TOLERANCE),
                   help="the first on every config, the others on the first config")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--docs_seq_len", type=int, default=3000,
                   help="S of the documents case (moba_flex, first config and dtype); 0: none")
    p.add_argument("--compact_seq_len", type=int, default=65536,
                   help="S of the union mask's compact-tables case (chunk 128, top-2, first dtype; CUDA only: "
                        "compiled CPU flex refuses compact tables); 0: none")
    p.add_argument("--out", type=Path, default=Path("runs/benchmarks/gpu/checks.json"),
                   help="the checks' JSON file (default %(default)s)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    device_line = describe(device)
    print(device_line, flush=True)
    configs = [tuple(map(int, c.split(":"))) for c in args.configs]
    plan = [(m, Shape(args.batch, args.heads, args.kv_heads, args.seq_len, args.head_dim, c, t), d)
            for i, d in enumerate(args.dtypes) for c, t in (configs if i == 0 else configs[:1])
            for m in args.methods if m not in BASELINES]
    plan += [(m, Shape(args.batch, args.heads, args.kv_heads, args.seq_len, args.head_dim, 0, 0), d)
             for d in args.dtypes for m in args.methods if m in BASELINES]
    if args.docs_seq_len and "moba_flex" in args.methods:
        c, t = configs[0]
        plan.append(("moba_flex", Shape(args.batch, args.heads, args.kv_heads, args.docs_seq_len, args.head_dim,
                                        c, t, documents=True), args.dtypes[0]))
    if args.compact_seq_len and "moba_flex_union" in args.methods and device.type == "cuda":
        plan.append(("union_compact", Shape(args.batch, 2, 1, args.compact_seq_len, 64, 128, 2), args.dtypes[0]))
    records: list[dict] = []
    for method, shape, dtype_name in plan:
        record = check(method, shape, dtype_name, device)
        records.append(record)
        print(f"{'ok  ' if record['ok'] else 'FAIL'} {describe_record(record)}", flush=True)
        write(records, device_line, args.out)
    return verdict("oracle", *summary(records))


if __name__ == "__main__":
    sys.exit(main())
