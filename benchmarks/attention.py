"""Attention speed of MoBA's backends against full causal attention.

For each S and MoBA config (chunk/top-k), times the forward, and forward+backward where
the device allows (flex has no CPU backward), of:

    moba_flex         MoBA, token granularity (the paper), compiled flex over regrouped queries
                      (flexmoba.backends.flex.plan; on CPU with the sink key for the log-sum-exp)
    moba_flex_union   the same through the union BlockMask in the original query order
    moba_flex_tile    the union BlockMask at tile granularity (--tile, default 128): exactly sparse
    moba_sdpa         MoBA as a dense [B, H, S, S] bool mask into SDPA (skipped past --dense_max_seq)
    moba_gather       MoBA by regrouping queries per selected chunk (flexmoba.backends.gather.kernel)
    full_flex_causal  compiled flex with a causal BlockMask built from tables
    sdpa_causal       F.scaled_dot_product_attention(is_causal=True), the reference for speedups

MoBA times are end to end (gating + mask/plan + attention: what ``moba_attention`` costs a
model); ``kernel`` is the attention alone with the mask or plan prebuilt; ``build`` is the
gating + mask or plan alone (gather: its pairs sorted by chunk, in blocks), timed in turns with
``kernel`` (build / kernel: their ratio, as both saw the same machine). The causal flex mask is
static, so it is built once, outside the timing. speedup = sdpa_causal time / time. FLOP ideal
= causal (query, key) pairs / pairs MoBA attends, from the real selection. achieved = forward
speedup / ideal. Block density = blocks the flex kernel visits / causal blocks;
visited/attended = (query, key) pairs in those blocks / pairs MoBA attends (1.0 is perfectly
sparse; the sink key's block excluded).
Peak memory: extra memory during one call over what was live before it
(:func:`benchmarks.common.peak_extra_mb`). With ``--inputs checkpoint``, q/k/v are each
layer's own (:func:`flexmoba.model.capture_attention_inputs` on Python source bytes) and a
second table gives the locality of the real selections.

    flexmoba bench attention [--seq_lens 2048 4096] [--configs 512:3 4096:12] [--repeats 3]
    flexmoba bench attention --inputs checkpoint --ckpt runs/moba/checkpoints/last.ckpt
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from benchmarks.common import (
    BLOCK,
    DEFAULT_OUT,
    OUT_HELP,
    OneLineArgumentParser,
    block_density,
    capture_qkv,
    causal_block_mask,
    interleaved_median_seconds,
    load_checkpoint_model,
    markdown_table,
    median_seconds,
    peak_extra_mb,
    print_row,
    settle_malloc,
    timing_repeats,
    write_report,
)
from benchmarks.verdict import one_line
from flexmoba import compiled_flex_attention, moba_attention, select_chunks, selection_block_mask
from flexmoba.backends.flex.plan import plan_from_selection
from flexmoba.backends.gather.kernel import gather_plan
from flexmoba.masks import dense_moba_mask
from flexmoba.pair_counts import selection_pairs

METHODS = ("sdpa_causal", "full_flex_causal", "moba_flex", "moba_flex_union", "moba_flex_tile", "moba_sdpa",
           "moba_gather")
BASELINES = ("sdpa_causal", "full_flex_causal")
CPU_SEQ_LENS = [2048, 4096, 8192, 16384, 32768]
CUDA_SEQ_LENS = [4096, 16384, 65536, 131072, 262144]
DISTANCE_BINS = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 8), (9, 16), (17, 32), (33, None)]

COLUMNS = [
    ("seq_len", "S"), ("config", "chunk/top-k"), ("method", "method"),
    ("fwd_ms", "fwd (ms)"), ("kernel_ms", "kernel (ms)"), ("build_ms", "build (ms)"), ("build_share", "build / kernel"),
    ("fwd_bwd_ms", "fwd+bwd (ms)"), ("speedup_fwd", "speedup fwd"), ("speedup_kernel", "speedup kernel"),
    ("speedup_fwd_bwd", "speedup fwd+bwd"), ("flop_ideal", "FLOP ideal"), ("achieved", "achieved"),
    ("block_density", "block density"), ("visited_ratio", "visited/attended"), ("peak_fwd_mb", "peak fwd (MB)"),
    ("peak_fwd_bwd_mb", "peak fwd+bwd (MB)"), ("note", "note"),
]


def bin_label(lo: int, hi: int | None) -> str:
    return f"d{lo}" if hi == lo else (f"d{lo}+" if hi is None else f"d{lo}-{hi}")


LOCALITY_COLUMNS = [
    ("inputs", "inputs"), ("layer", "layer"), ("seq_len", "S"), ("chunk_size", "chunk"), ("top_k", "top-k"),
    ("mean_distance", "mean distance"), ("frac_prev", "frac prev chunk"),
    ("frac_prev_uniform", "frac prev (uniform)"),
] + [(bin_label(lo, hi), bin_label(lo, hi)) for lo, hi in DISTANCE_BINS]


@dataclass
class Case:
    """One row to measure: the inputs and what to run on them."""

    method: str
    q: torch.Tensor  # [B, H, S, D]
    k: torch.Tensor  # [B, H_kv, S, D]
    v: torch.Tensor  # [B, H_kv, S, D]
    chunk_size: int = 0
    top_k: int = 0
    tile: int = BLOCK


@dataclass
class Runner:
    """``forward(q, k, v)`` end to end; ``kernel()`` with prebuilt state; ``build()`` the state alone."""

    forward: Callable
    kernel: Callable | None
    build: Callable | None
    backward_ok: bool
    block_mask: BlockMask | None = None
    selection: object = None
    visited: int | None = None  # (query, key) pairs in the blocks a flex kernel visits


# -- FLOPs and locality ---------------------------------------------------------------------


def flop_ideal(selection, seq_len: int) -> float:
    """Causal (query, key) pairs / pairs the selection attends, over all batches and heads."""
    B, H = selection.past_chunks.shape[:2]
    return B * H * seq_len * (seq_len + 1) / 2 / selection_pairs(selection)


@torch.no_grad()
def locality(q: torch.Tensor, k: torch.Tensor, chunk_size: int, top_k: int) -> dict:
    """How far back MoBA's selected past chunks are, for ``q: [B, H, S, D]``, ``k: [B, H_kv, S, D]``.

    distance = own chunk - selected chunk (>= 1). Returns the mean distance, the fraction of
    selected past chunks at distance 1 (the immediately preceding chunk), that fraction if
    each query picked its past chunks uniformly at random, and a histogram (fractions of
    the selected past chunks per distance bin).
    """
    sel = select_chunks(q, k, chunk_size=chunk_size, top_k=top_k)
    own = sel.layout.local_chunk[:, None, :, None]  # [B, 1, S, 1]
    dist = (own - sel.past_chunks)[sel.past_valid].float()
    n = max(dist.numel(), 1)
    # Uniform baseline: a query with m past chunks picks min(top_k - 1, m) of them, the
    # preceding one with probability min(top_k - 1, m) / m; as a share of all picks:
    m = sel.layout.local_chunk.float()  # [B, S]
    picks = m.clamp(max=top_k - 1)
    uniform = float((picks / m.clamp(min=1)).sum() / picks.sum().clamp(min=1))
    row = {
        "chunk_size": chunk_size, "top_k": top_k, "selected_past": int(dist.numel()),
        "mean_distance": float(dist.mean()) if dist.numel() else 0.0,
        "frac_prev": float((dist == 1).sum() / n),
        "frac_prev_uniform": uniform,
    }
    for lo, hi in DISTANCE_BINS:
        in_bin = (dist >= lo) & (dist <= (hi if hi is not None else float("inf")))
        row[bin_label(lo, hi)] = float(in_bin.sum() / n)
    return row


def union_visited_area(block_mask: BlockMask, heads: int) -> int:
    """(query, key) pairs in the blocks a union mask visits, over all batches and heads."""
    Bq, Bk = block_mask.BLOCK_SIZE
    blocks = block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum()
    return int(blocks) * Bq * Bk * (heads if block_mask.kv_num_blocks.shape[1] == 1 else 1)


# -- runners --------------------------------------------------------------------------------


def expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, S, D]`` -> ``[B, H, S, D]`` (GQA heads repeated) for baselines without GQA."""
    group = q.shape[1] // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def baseline_runner(case: Case) -> Runner:
    q = case.q
    if case.method == "sdpa_causal":
        def forward(q, k, v):
            return F.scaled_dot_product_attention(q, expand_kv(q, k), expand_kv(q, v), is_causal=True)
        return Runner(forward, None, None, backward_ok=True)
    mask = causal_block_mask(q.shape[2], q.device)
    flex = compiled_flex_attention()

    def forward(q, k, v):
        return flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return Runner(forward, None, lambda: causal_block_mask(q.shape[2], q.device),
                  backward_ok=q.device.type == "cuda", block_mask=mask)


MOBA_BACKENDS = {"moba_flex": "flex", "moba_flex_union": "flex_union", "moba_flex_tile": "flex",
                 "moba_sdpa": "sdpa", "moba_gather": "gather"}


def moba_runner(case: Case) -> Runner:
    q, k, v = case.q, case.k, case.v
    granularity = case.tile if case.method == "moba_flex_tile" else "token"
    backend = MOBA_BACKENDS[case.method]
    kw = dict(chunk_size=case.chunk_size, top_k=case.top_k, granularity=granularity)
    gqa = q.shape[1] != k.shape[1]
    scale = q.shape[-1] ** -0.5
    regrouped = case.method == "moba_flex"

    def build():
        selection = select_chunks(q, k, **kw)
        if regrouped:
            return plan_from_selection(selection, k.shape[1], block_size=BLOCK, sink=q.device.type == "cpu")
        if backend.startswith("flex"):
            return selection_block_mask(selection, BLOCK, compute_q_blocks=False)
        return dense_moba_mask(selection) if backend == "sdpa" else gather_plan(selection, k, v)

    def forward(q, k, v):
        return moba_attention(q, k, v, backend=backend, **kw)

    selection = select_chunks(q, k, **kw)
    state = build()
    if regrouped:
        kernel = lambda: state.attention(q, k, v, scale=scale)  # noqa: E731
    elif backend.startswith("flex"):
        kernel = lambda: compiled_flex_attention()(q, k, v, block_mask=state, scale=scale, enable_gqa=gqa)  # noqa: E731
    elif backend == "sdpa":
        kernel = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=state, enable_gqa=gqa)  # noqa: E731
    else:
        kernel = lambda: state.attention(q, k, v, scale=scale)  # noqa: E731
    block_mask = state.block_mask if regrouped else state if backend.startswith("flex") else None
    runner = Runner(forward, kernel, build, backward_ok=not backend.startswith("flex") or q.device.type == "cuda",
                    block_mask=block_mask, selection=selection)
    if regrouped:
        runner.visited = state.visited_area()
    elif block_mask is not None:
        runner.visited = union_visited_area(block_mask, q.shape[1])
    return runner


# -- measuring ------------------------------------------------------------------------------


def forward_backward(forward: Callable, q, k, v) -> Callable[[], None]:
    """A step running ``forward`` on fresh leaves and back-propagating a fixed random gradient."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    grad = torch.randn_like(q)

    def step():
        for t in leaves:
            t.grad = None
        forward(*leaves).backward(grad)
    return step


def measure(case: Case, args, want_backward: bool) -> dict:
    """Times and memory of one case; see the module docstring for the meaning of each field."""
    device = case.q.device
    runner = baseline_runner(case) if case.method in BASELINES else moba_runner(case)
    row: dict = {}
    with torch.no_grad():
        row["fwd_ms"] = 1e3 * median_seconds(lambda: runner.forward(case.q, case.k, case.v), args.repeats)
        if runner.kernel is not None and runner.build is not None:  # their ratio is the point: timed in turns
            kernel_s, build_s = interleaved_median_seconds([runner.kernel, runner.build], args.repeats)
            row.update(kernel_ms=1e3 * kernel_s, build_ms=1e3 * build_s, build_share=build_s / kernel_s)
        else:
            for name, fn in (("kernel_ms", runner.kernel), ("build_ms", runner.build)):
                if fn is not None:
                    row[name] = 1e3 * median_seconds(fn, args.repeats)
        row["peak_fwd_mb"] = peak_extra_mb(lambda: runner.forward(case.q, case.k, case.v), device)
    if runner.block_mask is not None and case.method != "moba_flex":
        row["block_density"] = block_density(runner.block_mask, case.q.shape[2])
    if runner.visited is not None and runner.selection is not None:
        row["visited_ratio"] = runner.visited / selection_pairs(runner.selection)
    if runner.selection is not None:
        row["flop_ideal"] = flop_ideal(runner.selection, case.q.shape[2])
    if want_backward and runner.backward_ok:
        step = forward_backward(runner.forward, case.q, case.k, case.v)
        row["fwd_bwd_ms"] = 1e3 * median_seconds(step, args.repeats)
        row["peak_fwd_bwd_mb"] = peak_extra_mb(step, device)
    elif want_backward:
        row["note"] = "no CPU flex backward"
    return {k: v for k, v in row.items() if v is not None}


def memory_skip(case: Case, args, device) -> str | None:
    """Why a case would not fit (a rough estimate), or None."""
    B, H, S, _ = case.q.shape
    if case.method == "moba_sdpa" and S > args.dense_max_seq:
        return "skipped (memory)"
    if case.method == "moba_gather":
        # Groups hold [S·top_k/128, 128, chunk] logits per head; backward keeps ~5 such fp32 tensors.
        need = 5 * 4 * B * H * S * min(case.top_k, -(-S // case.chunk_size)) * case.chunk_size
        if need > args.gather_cap_gb * 2**30:
            return "skipped (memory)"
    return None


def add_ratios(row: dict, reference: dict | None) -> None:
    """Speedups over SDPA causal (its time / this time) and the achieved fraction of the FLOP ideal."""
    if not reference:
        return
    pairs = (("speedup_fwd", "fwd_ms", "fwd_ms"), ("speedup_kernel", "kernel_ms", "fwd_ms"),
             ("speedup_fwd_bwd", "fwd_bwd_ms", "fwd_bwd_ms"))
    for key, own, ref in pairs:
        if own in row and ref in reference:
            row[key] = reference[ref] / row[own]
    if "speedup_fwd" in row and "flop_ideal" in row:
        row["achieved"] = row["speedup_fwd"] / row["flop_ideal"]


# -- inputs ---------------------------------------------------------------------------------


def random_inputs(seq_len: int, args, device, dtype) -> tuple[torch.Tensor, ...]:
    """q ``[B, H, S, D]``, k/v ``[B, H_kv, S, D]``, standard normal."""
    gen = torch.Generator().manual_seed(seq_len)
    kv_shape = (args.batch, args.kv_heads, seq_len, args.head_dim)
    shapes = [(args.batch, args.heads, seq_len, args.head_dim), kv_shape, kv_shape]
    return tuple(torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes)


def configs_for(seq_len: int, args) -> list[tuple[int, int]]:
    """(chunk, top-k) pairs for this S: --configs, else 512/3 plus 4096/12 from S >= 64K."""
    if args.configs:
        configs = [tuple(map(int, c.split(":"))) for c in args.configs]
    else:
        configs = [(512, 3)] + ([(4096, 12)] if seq_len >= 65536 else [])
    return [(c, k) for c, k in configs if c < seq_len]


# -- main -----------------------------------------------------------------------------------


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_lens", type=int, nargs="+",
                   help=f"sequence lengths S (default: {CPU_SEQ_LENS} on CPU, {CUDA_SEQ_LENS} on CUDA)")
    p.add_argument("--configs", nargs="+",
                   help="MoBA chunk:top_k pairs for every S, e.g. 512:3 4096:12 "
                        "(default: 512:3, plus 4096:12 for S >= 64K)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="what to time (default: all)")
    p.add_argument("--inputs", choices=("random", "checkpoint"), default="random",
                   help="q/k/v: standard normal, or captured from --ckpt (default: random)")
    p.add_argument("--ckpt", type=Path, help="flexmoba checkpoint for --inputs checkpoint")
    p.add_argument("--layer", type=int, default=0, help="checkpoint layer whose q/k/v are timed (default: 0)")
    p.add_argument("--batch", type=int, default=1, help="B (random inputs; default: 1)")
    p.add_argument("--heads", type=int, default=4, help="H (random inputs; default: 4)")
    p.add_argument("--kv_heads", type=int, default=None, help="H_kv (random inputs; default: --heads)")
    p.add_argument("--head_dim", type=int, default=64, help="D (random inputs; default: 64)")
    p.add_argument("--tile", type=int, default=128, help="tile of moba_flex_tile (default: 128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16" if cuda else "float32",
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="default: cuda if available")
    p.add_argument("--repeats", type=timing_repeats, default=3, help="timed calls per measurement, median (default: 3)")
    p.add_argument("--no_backward", action="store_true", help="forward only")
    p.add_argument("--dense_max_seq", type=int, default=32768 if cuda else 16384,
                   help="skip moba_sdpa (dense S x S mask) above this S (default: 16384 on CPU, 32768 on CUDA)")
    p.add_argument("--gather_cap_gb", type=float, default=None,
                   help="skip moba_gather when its estimated memory exceeds this "
                        "(default: 40%% of GPU memory, 16 on CPU)")
    p.add_argument("--time_budget", type=float, default=None,
                   help="seconds; rows that would start later are reported as skipped (default: none)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    args.seq_lens = args.seq_lens or (CUDA_SEQ_LENS if args.device.startswith("cuda") else CPU_SEQ_LENS)
    if args.gather_cap_gb is None:
        args.gather_cap_gb = (0.4 * torch.cuda.get_device_properties(torch.device(args.device)).total_memory / 2**30
                              if args.device.startswith("cuda") else 16.0)
    if args.inputs == "checkpoint" and args.ckpt is None:
        p.error("--inputs checkpoint needs --ckpt PATH")
    return args


class Inputs:
    """Source of q/k/v per S: random, or captured from a checkpoint (with locality rows)."""

    def __init__(self, args, device, dtype):
        self.args, self.device, self.dtype = args, device, dtype
        self.model = None
        if args.inputs == "checkpoint":
            self.model = load_checkpoint_model(args.ckpt, device)
            cfg = self.model.config
            print(f"checkpoint {args.ckpt}: {cfg}", flush=True)
            if not 0 <= args.layer < cfg.n_layers:
                raise SystemExit(f"--layer {args.layer} out of range for {cfg.n_layers} layers")

    def get(self, seq_len: int) -> tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
        """(q/k/v of every layer for locality, the q/k/v to time)."""
        if self.model is None:
            qkv = random_inputs(seq_len, self.args, self.device, self.dtype)
            return [qkv], qkv
        layers = capture_qkv(self.model, seq_len, self.device)
        timed = tuple(t.to(self.dtype).contiguous() for t in layers[self.args.layer])
        return layers, timed

    def locality_configs(self, seq_len: int) -> list[tuple[int, int]]:
        configs = configs_for(seq_len, self.args)
        if self.model is not None:
            own = (self.model.config.moba.chunk_size, self.model.config.moba.top_k)
            configs = [own] + [c for c in configs if c != own]
        return [(c, k) for c, k in configs if c < seq_len]


def locality_rows(inputs: Inputs, layers, seq_len: int) -> list[dict]:
    """Locality of the selections of every layer (one layer for random inputs), per config."""
    rows = []
    for layer, (q, k, _) in enumerate(layers):
        for chunk, top_k in inputs.locality_configs(seq_len):
            row = {"table": "locality", "inputs": inputs.args.inputs, "layer": layer, "seq_len": seq_len}
            rows.append({**row, **locality(q, k, chunk, top_k)})
    return rows


def report(rows: list[dict], locality_table: list[dict], args, device_name: str) -> Path:
    table = markdown_table(rows, COLUMNS)
    if locality_table:
        table += "\n\nLocality of selected past chunks (distance = own chunk - selected chunk):\n\n"
        table += markdown_table(locality_table, LOCALITY_COLUMNS)
    name = f"attention_{device_name}" + ("_checkpoint" if args.inputs == "checkpoint" else "")
    return write_report(name, rows + locality_table, table, args.out)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows, localities = run(args)
    path = report(rows, localities, args, torch.device(args.device).type)
    print(f"written to {path} and {path.with_suffix('.json')}")


def run(args, not_timed: dict[str, str] | None = None) -> tuple[list[dict], list[dict]]:
    """(attention rows, locality rows) of ``args``; the report is rewritten after every row.

    ``not_timed``: method -> why it is reported but not timed (e.g. it failed its oracle check).
    """
    not_timed = not_timed or {}
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    want_backward = not args.no_backward
    if device.type == "cpu":
        settle_malloc()
    compiled_flex_attention()
    inputs = Inputs(args, device, dtype)
    started = time.perf_counter()
    rows: list[dict] = []
    localities: list[dict] = []
    for seq_len in args.seq_lens:
        layers, (q, k, v) = inputs.get(seq_len)
        localities += locality_rows(inputs, layers, seq_len)
        del layers
        reference = None
        cases = [("-", Case(m, q, k, v)) for m in args.methods if m in BASELINES]
        cases += [(f"{c}/{t}", Case(m, q, k, v, c, t, args.tile))
                  for c, t in configs_for(seq_len, args) for m in args.methods if m not in BASELINES]
        for config, case in cases:
            row = {"table": "attention", "seq_len": seq_len, "config": config, "method": case.method,
                   "heads": q.shape[1], "kv_heads": k.shape[1], "head_dim": q.shape[-1], "dtype": args.dtype,
                   "inputs": args.inputs}
            if case.method in not_timed:
                row["note"] = not_timed[case.method]
            else:
                row.update(run_case(case, args, device, want_backward, started))
            if case.method == "sdpa_causal":
                reference = row
            add_ratios(row, reference)
            rows.append(row)
            print_row(row, COLUMNS)
            report(rows, localities, args, device.type)
        del q, k, v
    return rows, localities


def run_case(case: Case, args, device, want_backward: bool, started: float) -> dict:
    """Measure one case unless it would not fit or the time budget is spent; never raises."""
    if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
        return {"note": "skipped (time budget)"}
    skip = memory_skip(case, args, device)
    if skip:
        return {"note": skip}
    try:
        return measure(case, args, want_backward)
    except Exception as error:  # one broken row is reported and must not hide the others
        if device.type == "cuda":
            torch.cuda.empty_cache()
        message = str(error).lower()
        if "out of memory" in message or "can't allocate" in message:  # CUDA OOM and CPU allocator failures
            return {"note": "out of memory"}
        return {"note": f"error: {one_line(error, 160)}"}


if __name__ == "__main__":
    sys.exit(main())
