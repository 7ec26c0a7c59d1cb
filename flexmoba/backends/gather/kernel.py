"""Sparse, exact, differentiable MoBA: each query's chunks attended apart, merged by log-sum-exp.

A query's MoBA output is one softmax over the union of its selected chunks. Attending each
chunk apart gives a partial output and its log-sum-exp; merging the parts by log-sum-exp
gives the exact output. Two kinds of part:

- **own chunk**, causal inside: block-diagonal causal attention. Without documents the
  chunks sit on a fixed grid, so ``[B, H, S, D]`` is viewed as ``[B * H * n_chunks, c, D]``
  and one fused causal call covers every chunk, without copying anything; chunks of 256
  keys or more run as two causal halves plus the second half's queries over the first half
  (the CPU kernel would compute the whole square of a chunk). With documents chunks are
  gathered into the same ``[n, c]`` form (a document's shorter last chunk padded), so one
  call covers them too.
- **past chunks**, whole and wholly in the past: (query, chunk) pairs are sorted by the
  keys they read, as the official efficient kernel does. Query heads that share a KV head
  (GQA) share a chunk's pairs. At training sizes the pairs run in blocks of 768, 512, 256,
  128 and 64 rows, each block one chunk's queries with a copy of that chunk's keys, one batched
  call per block size; on long sequences each chunk is one call of the queries that
  selected it against a view of its keys, merged into the output before the next.

On CPU every call is torch's fused flash-attention kernel, which also returns the
log-sum-exp; elsewhere the same math runs unfused. The backward pass is FlashAttention's:
each part's gradient is computed from the *merged* output and log-sum-exp, which makes it
the exact gradient of one softmax over the union of the selected keys; key and value
gradients land in views of dk, dv. Work and memory are O(S * top_k * chunk_size).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import NamedTuple

import torch
import torch.nn.functional as F

from flexmoba import validation
from flexmoba.dense import dense_attention, dense_attention_backward, nan_where_nothing_attended
from flexmoba.gate import Selection
from flexmoba.index_math import exclusive_cumsum, floor_divide, sort_key_dtype
from flexmoba.lse_merge import index_add_parts, merge_in_place, merge_into, merge_pairs
from flexmoba.tuning import tuning_for

__all__ = ["GatherPlan", "gather_moba_attention", "gather_plan"]


class Segment(NamedTuple):
    """One dense call: ``count`` queries from ``offset`` (in :attr:`PastPairs.query`) against keys
    ``[start, start + length)`` of KV row ``kv_row`` (``b * H_kv + kv head``), all of them. A named
    tuple: a plan makes one per (KV row, chunk), at a third of a frozen dataclass's cost."""

    offset: int
    count: int
    kv_row: int
    start: int
    length: int


@dataclass(frozen=True)
class PastPairs:
    """(query, past chunk) pairs sorted by the keys they read.

    Attributes:
        query: ``[n]`` flat index of each pair's query in ``[B * H * S]``.
        segments: one per (KV row, chunk), covering the pairs in order.
    """

    query: torch.Tensor
    segments: list[Segment]


def past_pairs(selection: Selection, kv_heads: int) -> PastPairs:
    """Sort the selected past pairs by (KV row, global chunk); one host read sizes the segments.

    Segment starts are the chunks' key positions (``layout.doc_start`` is in key positions, so
    queries may sit at an offset of longer keys, as in :mod:`flexmoba.context_parallel`).
    """
    layout = selection.layout
    B, H, S, P = selection.past_chunks.shape
    n_global = layout.n_global_chunks
    device = selection.past_chunks.device
    n_buckets = B * kv_heads * n_global
    key_type = sort_key_dtype(n_buckets)  # "unused" is bucket n_buckets
    kv_row = (torch.arange(B, device=device)[:, None] * kv_heads
              + torch.arange(H, device=device) // (H // kv_heads))  # [B, H]
    first_bucket = kv_row[:, :, None] * n_global  # [B, H, 1]: on the grid, every chunk counts from 0
    if layout.has_documents:  # [B, H, S]: local chunks count from each document's first
        first_bucket = first_bucket + layout.first_global_chunk[:, None, :]
    first_bucket = first_bucket.to(key_type)[..., None]
    bucket = torch.where(selection.past_valid, selection.past_chunks.to(key_type) + first_bucket, n_buckets).flatten()
    slot = torch.argsort(bucket, stable=True)  # flat index in [B, H, S, P]
    counts = torch.bincount(bucket, minlength=n_buckets + 1)[:n_buckets]
    used = counts.nonzero().squeeze(1)
    count = counts[used]
    offset = exclusive_cumsum(count, 0)
    rows = used.tolist()
    if layout.has_documents:  # a chunk's start from each segment's first pair
        b, h, s, p = torch.unravel_index(slot[offset], (B, H, S, P))
        starts = (layout.doc_start[b, s] + selection.past_chunks[b, h, s, p] * layout.chunk_size).tolist()
    else:  # a bucket's chunk is its global chunk
        starts = [row % n_global * layout.chunk_size for row in rows]
    segments = [Segment(o, c, row // n_global, start, layout.chunk_size) for o, c, row, start
                in zip(offset.tolist(), count.tolist(), rows, starts, strict=True)]
    slot = slot[:sum(seg.count for seg in segments)]
    return PastPairs(floor_divide(slot, P) if P else slot, segments)


@dataclass(frozen=True)
class OwnChunks:
    """The own chunks of a layout with documents, each padded to ``chunk`` rows: one item per
    (chunk, query head), so that one causal call covers them all, as on the grid.

    A chunk of ``L < chunk`` positions repeats its last row in the padding: a real query (place
    ``< L``) attends only keys before it, and a padding row is a copy of a real query over copies of
    real keys, so its results stay finite and are dropped.

    Attributes:
        query_rows: ``[n, chunk]`` rows of ``q.reshape(B * H * S, D)``.
        key_rows: ``[n, chunk]`` rows of ``k.reshape(B * H_kv * S, D)``.
        place: ``[B * H * S]`` each query's row in the padded ``[n * chunk]`` layout.
    """

    query_rows: torch.Tensor
    key_rows: torch.Tensor
    place: torch.Tensor

    def padded(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``x: [N, *]`` -> ``[n, 1, chunk, *]``, the rows ``rows`` (``query_rows`` or ``key_rows``)."""
        return x.index_select(0, rows.flatten()).view(*rows.shape[:1], 1, rows.shape[1], *x.shape[1:])

    def padded_zeros(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B * H * S, *]`` per query -> ``[n, 1, chunk, *]`` with zeros in the padding rows."""
        n, chunk = self.query_rows.shape
        out = x.new_zeros(n * chunk, *x.shape[1:]).index_copy_(0, self.place, x)
        return out.view(n, 1, chunk, *x.shape[1:])

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, 1, chunk, *]`` -> ``[B * H * S, *]`` per query."""
        return x.reshape(-1, *x.shape[3:]).index_select(0, self.place)


def own_chunks(selection: Selection, heads: int, kv_heads: int) -> OwnChunks:
    """:class:`OwnChunks` of the selection's layout (a chunk is a run of one global chunk in a row)."""
    layout = selection.layout
    B, S = layout.global_chunk.shape
    chunk, device = layout.chunk_size, layout.global_chunk.device
    is_first = torch.ones_like(layout.global_chunk, dtype=torch.bool)
    is_first[:, 1:] = layout.global_chunk[:, 1:] != layout.global_chunk[:, :-1]
    run = torch.cumsum(is_first.flatten(), 0) - 1  # [B * S] each position's chunk, row after row
    b, start = is_first.nonzero(as_tuple=True)  # [R]
    length = torch.bincount(run, minlength=len(b))
    place_in_run = torch.minimum(torch.arange(chunk, device=device), length[:, None] - 1)  # [R, chunk]
    head = torch.arange(heads, device=device)
    q_first = (b[:, None] * heads + head) * S + start[:, None]  # [R, H]
    k_first = (b[:, None] * kv_heads + head // (heads // kv_heads)) * S + start[:, None]
    in_run = torch.arange(S, device=device) - start[run].view(B, S)  # [B, S]
    place = (run.view(B, 1, S) * heads + head[:, None]) * chunk + in_run[:, None, :]  # [B, H, S]
    return OwnChunks((q_first[..., None] + place_in_run[:, None]).flatten(0, 1),
                     (k_first[..., None] + place_in_run[:, None]).flatten(0, 1), place.flatten())


def _row_blocks(n: int, block: int) -> list[tuple[int, int, int]]:
    """``(first row, batch, rows per item)``: n rows as a batch of whole blocks plus the rest."""
    whole = n // block * block
    parts = [(0, n // block, block)] if whole else []
    return parts + ([(whole, 1, n - whole)] if n > whole else [])


def past_chunk_attention_backward(grad_out, q, k, v, out, lse, scale: float, block: int):
    """Gradients ``(dq [n, D], dk [c, D], dv [c, Dv])`` of ``q: [n, D]``'s attention over the
    whole chunk ``k, v: [c, D]``, given the merged ``out`` and ``lse`` of its queries. The fused CPU
    backward parallelises over the batch only, so the queries run as a batch of ``block``-row blocks
    against one (broadcast) copy of the keys."""
    dqs, dk, dv = [], 0, 0
    for first, batch, rows in _row_blocks(q.shape[0], block):
        grad_b, q_b, out_b, lse_b = (x[first:first + batch * rows].view(batch, 1, rows, *x.shape[1:])
                                     for x in (grad_out, q, out, lse))
        dq_p, dk_p, dv_p = dense_attention_backward(
            grad_b, q_b, k.expand(batch, 1, *k.shape), v.expand(batch, 1, *v.shape), out_b, lse_b, False, scale)
        dqs.append(dq_p.reshape(batch * rows, -1))
        dk, dv = dk + dk_p.sum((0, 1)), dv + dv_p.sum((0, 1))
    return torch.cat(dqs), dk, dv


def _chunk_view(x: torch.Tensor, chunk: int, group: int = 1) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B * H * group * n, 1, chunk, D]``, S zero-padded to ``n * chunk``,
    heads repeated ``group`` times (GQA)."""
    B, H, S, D = x.shape
    n = -(-S // chunk)
    if n * chunk != S:
        x = F.pad(x, (0, 0, 0, n * chunk - S))
    if group > 1:
        x = x.repeat_interleave(group, dim=1)
    return x.reshape(-1, 1, chunk, D)


def _unchunk(x: torch.Tensor, B: int, H: int, S: int) -> torch.Tensor:
    """Inverse of :func:`_chunk_view` for one group: ``[B * H * n, 1, chunk, *]`` -> ``[B, H, S, *]``."""
    return x.reshape(B, H, -1, *x.shape[3:])[:, :, :S]


def _embed_keys(d_own: torch.Tensor, like: torch.Tensor, key_offset: int) -> torch.Tensor:
    """Gradient ``[B, H_kv, S, D]`` of keys ``[key_offset, key_offset + S)`` as one of all keys ``like``."""
    if d_own.shape == like.shape:
        return d_own
    full = torch.zeros_like(like)
    full.narrow(2, key_offset, d_own.shape[2]).copy_(d_own)
    return full


# A segment's pairs fill blocks of this many units (each unit ``query_block`` rows), largest first:
# as many of the largest as fit, then at most one of each smaller size (the rest, under 12 units, in
# binary), the last padded. The CPU kernel runs large query blocks faster: from 768 rows it splits them
# into 256-row tiles (measured against 512-row blocks: forward a fifth and backward a quarter faster),
# and the small ones keep the padding under one unit per segment.
BLOCK_UNITS = (12, 8, 4, 2, 1)


@dataclass(frozen=True)
class PairBlocks:
    """The past pairs in blocks of rows, each block one chunk's queries (:data:`BLOCK_UNITS`).
    Padding rows repeat their segment's last pair; their results count for nothing (a log-sum-exp of
    -inf in the merge, a zero output gradient in the backward).

    Attributes:
        sizes: ``(rows per block, blocks)`` of each block size, in row order.
        query_of_row: ``[rows]`` the query of each block row, in ``[B * H * S]``, block after block.
        key_of_row: ``[blocks * c]`` each block's keys, flat in ``[B * H_kv * T]``, block after block.
        padding: the padding rows.
    """

    sizes: tuple[tuple[int, int], ...]
    query_of_row: torch.Tensor
    key_of_row: torch.Tensor
    padding: torch.Tensor

    def rows(self, x: torch.Tensor, zero_padding: bool = False) -> list[torch.Tensor]:
        """``x: [B * H * S, *]`` per query -> per block size ``[blocks, 1, R, *]`` per block row;
        ``zero_padding``: an output gradient whose padding rows move no gradient."""
        rows = x.index_select(0, self.query_of_row)
        if zero_padding:
            rows.index_fill_(0, self.padding, 0)
        return self._split(rows, [R for R, _ in self.sizes])

    def keys(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x: [B * H_kv * T, D]`` per key -> per block size each block's copy of its chunk, ``[blocks, 1, c, D]``."""
        chunk = len(self.key_of_row) // sum(n for _, n in self.sizes)
        return self._split(x.index_select(0, self.key_of_row), [chunk] * len(self.sizes))

    def _split(self, x: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        parts = x.split([L * n for L, (_, n) in zip(lengths, self.sizes, strict=True)])
        return [p.view(n, 1, L, *x.shape[1:]) for p, L, (_, n) in zip(parts, lengths, self.sizes, strict=True)]

    def row_lse(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per block size ``[blocks, 1, R]`` log-sum-exp -> ``[rows]``, -inf on the padding rows."""
        return torch.cat([p.reshape(-1) for p in parts]).index_fill_(0, self.padding, float("-inf"))


def _block_table(segments: list[Segment], unit: int, key_len: int) -> tuple[tuple[tuple[int, int], ...], array]:
    """The blocks of each size (:data:`BLOCK_UNITS`) segment after segment, largest size first, on the host:
    ``(sizes, table)``, ``sizes`` as :attr:`PairBlocks.sizes` and ``table`` int64 ``[4, blocks]``: each
    block's first pair less its first row, its segment's last pair, its units (of ``unit`` rows) and its
    chunk's first key (flat in ``[B * H_kv * T]``). A few hundred blocks: host arithmetic costs less than
    the tensor calls it replaces, and an array reaches a tensor at a tenth of the cost of a list."""
    firsts, lasts, keys = ([[] for _ in BLOCK_UNITS] for _ in range(3))
    largest = BLOCK_UNITS[0] * unit
    for seg in segments:
        whole, rest = divmod(-(-seg.count // unit), BLOCK_UNITS[0])  # the rest, under 12 units: binary digits
        first, last, key = seg.offset, seg.offset + seg.count - 1, seg.kv_row * key_len + seg.start
        firsts[0].extend(range(first, first + whole * largest, largest))
        lasts[0].extend([last] * whole)
        keys[0].extend([key] * whole)
        first += whole * largest
        for size, u in enumerate(BLOCK_UNITS[1:], 1):
            if rest & u:
                firsts[size].append(first)
                lasts[size].append(last)
                keys[size].append(key)
                first += u * unit
    units = [u for u, blocks in zip(BLOCK_UNITS, keys, strict=True) for _ in blocks]
    rows = list(accumulate((u * unit for u in units[:-1]), initial=0))  # each block's first row
    offsets = [first - row for first, row in zip(chain.from_iterable(firsts), rows, strict=True)]
    sizes = tuple((u * unit, len(blocks)) for u, blocks in zip(BLOCK_UNITS, keys, strict=True) if blocks)
    return sizes, array("q", [*offsets, *chain.from_iterable(lasts), *units, *chain.from_iterable(keys)])


def pair_blocks(pairs: PastPairs, key_len: int, chunk: int, unit: int, width: int) -> PairBlocks | None:
    """:class:`PairBlocks` of the pairs (blocks of ``unit * BLOCK_UNITS`` rows), or None where a segment
    is not a whole chunk or the copies of keys and values (``width`` = D + Dv fp32 columns per key)
    would exceed the profile's ``gather_batched_pairs_max_bytes`` (:mod:`flexmoba.tuning`); then one call
    per chunk reads its keys in place."""
    segments = pairs.segments
    if not segments or any(seg.length != chunk for seg in segments):
        return None
    sizes, table = _block_table(segments, unit, key_len)
    if sum(n for _, n in sizes) * chunk * width * 4 > tuning_for(pairs.query.device).gather_batched_pairs_max_bytes:
        return None
    device = pairs.query.device
    n_units = sum(R * n for R, n in sizes) // unit
    offset_last, units, first_key = torch.frombuffer(table, dtype=torch.long).view(4, -1).to(device).split([2, 1, 1])
    unit_offset, unit_last = torch.repeat_interleave(offset_last, units[0], dim=1, output_size=n_units)
    pair = torch.arange(n_units * unit, device=device).view(n_units, unit) + unit_offset[:, None]  # each row's pair
    is_padding = torch.gt(pair, unit_last[:, None])
    torch.minimum(pair, unit_last[:, None], out=pair)  # padding rows: the segment's last pair
    query_of_row = torch.index_select(pairs.query, 0, pair.view(-1))  # index_select: 2.4x faster than indexing
    keys = (first_key.view(-1, 1) + torch.arange(chunk, device=device)).view(-1)
    return PairBlocks(sizes, query_of_row, keys, is_padding.view(-1).nonzero().squeeze(1))


@dataclass(frozen=True)
class GatherPlan:
    """What the gather backend reads besides q, k, v, built once per selection (:func:`gather_plan`)
    and read by the forward and the backward pass.

    Attributes:
        pairs: the past (query, chunk) pairs sorted by the keys they read.
        blocks: the pairs in blocks of rows (:func:`pair_blocks`); None: one call per segment.
        own: the padded own chunks of a layout with documents; None on the grid.
        chunk: tokens per chunk.
        query_shape: ``(B, H, S)`` of the queries the plan is for.
        key_len: T, the keys' length.
        query_block: rows of the smallest block of pairs (backward: twice that per block; the
            profile's ``gather_query_block``).
        key_offset: where the queries' own chunks start in the keys (0 unless queries sit at
            the end of longer keys, as in :mod:`flexmoba.context_parallel`).
    """

    pairs: PastPairs
    blocks: PairBlocks | None
    own: OwnChunks | None
    chunk: int
    query_shape: tuple[int, int, int]
    key_len: int
    query_block: int
    key_offset: int = 0

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  scale: float | None = None) -> torch.Tensor:
        """MoBA of ``q: [B, H, S, D]`` over ``k, v: [B, H_kv, T, D]`` -> ``[B, H, S, Dv]``."""
        if tuple(q.shape[:3]) != self.query_shape:
            raise ValueError(f"q is [B, H, S] = {list(q.shape[:3])} but the plan is for {list(self.query_shape)}")
        if k.shape[2] != self.key_len or v.shape[2] != self.key_len:
            raise ValueError(f"k and v must hold the plan's {self.key_len} keys, got {k.shape[2]} and {v.shape[2]}")
        return _GatheredMoBA.apply(q, k, v, self, validation.softmax_scale(scale, q))


def plan_pairs(pairs: PastPairs, own: OwnChunks | None, chunk: int, query_shape: tuple[int, int, int],
               kv_shape: tuple[int, ...], value_dim: int, query_block: int | None = None,
               key_offset: int = 0) -> GatherPlan:
    """The :class:`GatherPlan` of pairs already sorted (``kv_shape``: k's ``[B, H_kv, T, D]``;
    ``query_block`` None: the profile's)."""
    query_block = query_block or tuning_for(pairs.query.device).gather_query_block
    blocks = pair_blocks(pairs, kv_shape[2], chunk, query_block, kv_shape[3] + value_dim)
    return GatherPlan(pairs, blocks, own, chunk, tuple(query_shape), kv_shape[2], query_block, key_offset)


def gather_plan(selection: Selection, k: torch.Tensor, v: torch.Tensor, query_block: int | None = None) -> GatherPlan:
    """The :class:`GatherPlan` of a selection for keys and values shaped as ``k, v: [B, H_kv, S, D]``
    (only their shapes are read)."""
    B, H, S, _ = selection.past_chunks.shape
    with torch.no_grad():
        pairs = past_pairs(selection, k.shape[1])
        own = own_chunks(selection, H, k.shape[1]) if selection.layout.has_documents else None
        return plan_pairs(pairs, own, selection.layout.chunk_size, (B, H, S), tuple(k.shape), v.shape[-1], query_block)


class _GatheredMoBA(torch.autograd.Function):
    """``q: [B, H, S, D]`` over ``k, v: [B, H_kv, T, D]``, T >= S, as the :class:`GatherPlan` says; the
    queries' own chunks lie in keys ``[key_offset, key_offset + S)``."""

    @staticmethod
    def forward(ctx, q, k, v, plan: GatherPlan, scale: float):
        B, H, S, _ = q.shape
        Dv = v.shape[-1]
        k_own, v_own = k.narrow(2, plan.key_offset, S), v.narrow(2, plan.key_offset, S)
        own_out, own_lse = _own_forward(q, k_own, v_own, plan.own, plan.chunk, scale)
        out, lse = own_out.reshape(-1, Dv).float(), own_lse.reshape(-1)  # the past parts are merged into these
        if plan.blocks is None:
            _merge_segments(out, lse, q, k, v, plan.pairs, scale)
        else:
            out, lse = _merge_blocks(out, lse, q, k, v, plan.blocks, scale)
        out = out.to(q.dtype).view(B, H, S, Dv)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        B, H, S, _ = q.shape
        grad_out = grad_out.contiguous()
        k_own, v_own = k.narrow(2, plan.key_offset, S), v.narrow(2, plan.key_offset, S)
        dq, dk, dv = _own_backward(grad_out, q, k_own, v_own, out, lse.view(B, H, S), plan.own, plan.chunk, scale)
        dk, dv = _embed_keys(dk, k, plan.key_offset), _embed_keys(dv, v, plan.key_offset)
        past = (grad_out, q, k, v, out, lse, dq, dk, dv, scale)
        if plan.blocks is None:
            _backward_segments(*past, plan.pairs, 2 * plan.query_block)
        else:
            _backward_blocks(*past, plan.blocks)
        return dq, dk, dv, None, None


def _merge_segments(out, lse, q, k, v, pairs: PastPairs, scale: float) -> None:
    """Attend each segment's queries to its keys in place and merge it into ``out: [N, Dv]``, ``lse: [N]``."""
    q_rows, k_rows, v_rows = _rows(q, k, v)
    for seg in pairs.segments:
        query = pairs.query[seg.offset:seg.offset + seg.count]
        seg_out, seg_lse = dense_attention(q_rows.index_select(0, query)[None, None], *_keys(k_rows, v_rows, seg),
                                           False, scale)
        merge_into(out, lse, query, seg_out[0, 0], seg_lse[0, 0])
    nan_where_nothing_attended(out, lse)


def _merge_blocks(out, lse, q, k, v, blocks: PairBlocks, scale: float):
    """Attend every block of past pairs (one call per block size) and merge them with ``out: [N, Dv]``,
    ``lse: [N]``; returns the merged (out, lse)."""
    D, Dv = q.shape[-1], v.shape[-1]
    parts = [dense_attention(*qkv, False, scale) for qkv in zip(
        blocks.rows(q.reshape(-1, D)), blocks.keys(k.reshape(-1, D)), blocks.keys(v.reshape(-1, Dv)), strict=True)]
    return merge_pairs(out, lse, blocks.query_of_row, blocks.row_lse([part_lse for _, part_lse in parts]),
                       [part_out.reshape(-1, Dv) for part_out, _ in parts])


def _backward_segments(grad_out, q, k, v, out, lse, dq, dk, dv, scale: float, pairs: PastPairs, block: int) -> None:
    """Add the past pairs' gradients to ``dq, dk, dv``, one segment at a time."""
    q_rows, k_rows, v_rows = _rows(q, k, v)
    g_rows, o_rows = grad_out.reshape(-1, v.shape[-1]), out.reshape(-1, v.shape[-1])
    kv_rows = k.shape[0] * k.shape[1]
    dq_rows = dq.view(-1, q.shape[-1])
    dk_rows, dv_rows = dk.view(kv_rows, -1, k.shape[-1]), dv.view(kv_rows, -1, v.shape[-1])  # views: written in place
    for seg in pairs.segments:
        query = pairs.query[seg.offset:seg.offset + seg.count]
        keys = slice(seg.start, seg.start + seg.length)
        dq_s, dk_s, dv_s = past_chunk_attention_backward(
            *(x.index_select(0, query) for x in (g_rows, q_rows)), k_rows[seg.kv_row, keys], v_rows[seg.kv_row, keys],
            *(x.index_select(0, query) for x in (o_rows, lse)), scale, block)
        dq_rows.index_add_(0, query, dq_s)
        dk_rows[seg.kv_row, keys] += dk_s
        dv_rows[seg.kv_row, keys] += dv_s


def _backward_blocks(grad_out, q, k, v, out, lse, dq, dk, dv, scale: float, blocks: PairBlocks) -> None:
    """Add the past pairs' gradients to ``dq, dk, dv``, one call per block size."""
    D, Dv = q.shape[-1], v.shape[-1]
    inputs = (blocks.rows(grad_out.reshape(-1, Dv), zero_padding=True), blocks.rows(q.reshape(-1, D)),
              blocks.keys(k.reshape(-1, D)), blocks.keys(v.reshape(-1, Dv)), blocks.rows(out.reshape(-1, Dv)),
              blocks.rows(lse[:, None]))
    grads = [dense_attention_backward(g, q_b, k_b, v_b, o, lse_b[..., 0], False, scale)
             for g, q_b, k_b, v_b, o, lse_b in zip(*inputs, strict=True)]
    index_add_parts(dq.view(-1, D), blocks.query_of_row, [dq_b for dq_b, _, _ in grads])
    index_add_parts(dk.view(-1, D), blocks.key_of_row, [dk_b for _, dk_b, _ in grads])
    index_add_parts(dv.view(-1, Dv), blocks.key_of_row, [dv_b for _, _, dv_b in grads])


def _rows(q, k, v):
    """``q: [B, H, S, D]`` as ``[B * H * S, D]`` rows, ``k, v: [B, H_kv, T, *]`` as ``[B * H_kv, T, *]``."""
    B, H_kv = k.shape[:2]
    return q.reshape(-1, q.shape[-1]), k.reshape(B * H_kv, -1, k.shape[-1]), v.reshape(B * H_kv, -1, v.shape[-1])


def _keys(k_rows, v_rows, seg: Segment):
    """Views ``[1, 1, length, D]`` of a segment's keys and values."""
    keys = slice(seg.start, seg.start + seg.length)
    return k_rows[seg.kv_row, keys][None, None], v_rows[seg.kv_row, keys][None, None]


def _split_own(q: torch.Tensor) -> bool:
    """Whether own chunks ``[M, 1, c, D]`` attend as two causal halves plus the second half's queries
    over the first half's keys: the CPU kernel reads every key of a causal call's key block (up to
    512 wide), so one causal call per chunk pays for its upper triangle too (measured: 16% less time)."""
    chunk = q.shape[2]
    return chunk >= tuning_for(q.device).gather_split_own_min and chunk % 2 == 0


def _halves(x: torch.Tensor) -> torch.Tensor:
    """``[M, 1, c, *]`` -> ``[2M, 1, c/2, *]``, each chunk's two halves as two items."""
    return x.reshape(2 * x.shape[0], 1, x.shape[2] // 2, *x.shape[3:])


def _causal_chunks(q, k, v, scale: float):
    """Causal attention inside each chunk of chunk views ``[M, 1, c, *]`` -> (out ``[M, 1, c, Dv]`` in
    q's dtype or fp32, lse ``[M, 1, c]`` fp32)."""
    chunk = q.shape[2]
    if not _split_own(q):
        return dense_attention(q, k, v, True, scale)
    half = chunk // 2
    out, lse = dense_attention(_halves(q), _halves(k), _halves(v), True, scale)
    out = out.float().view(q.shape[0], 1, chunk, -1)  # merged in place below, in fp32 like every part
    lse = lse.view(q.shape[0], 1, chunk)
    cross_out, cross_lse = dense_attention(q[:, :, half:], k[:, :, :half], v[:, :, :half], False, scale)
    merge_in_place(out[:, :, half:], lse[..., half:], cross_out, cross_lse)
    return out, lse


def _causal_chunks_backward(grad_out, q, k, v, out, lse, scale: float):
    """Gradients of :func:`_causal_chunks` (chunk views ``[M, 1, c, *]``, lse ``[M, 1, c]``)."""
    if not _split_own(q):
        return dense_attention_backward(grad_out, q, k, v, out, lse, True, scale)
    half = q.shape[2] // 2
    dq, dk, dv = dense_attention_backward(*map(_halves, (grad_out, q, k, v, out)), _halves(lse[..., None])[..., 0],
                                          True, scale)
    dq, dk, dv = (x.view(q.shape[0], 1, q.shape[2], -1) for x in (dq, dk, dv))
    first, second = slice(0, half), slice(half, None)
    dq_c, dk_c, dv_c = dense_attention_backward(grad_out[:, :, second], q[:, :, second], k[:, :, first],
                                                v[:, :, first], out[:, :, second], lse[..., second], False, scale)
    dq[:, :, second] += dq_c
    dk[:, :, first] += dk_c
    dv[:, :, first] += dv_c
    return dq, dk, dv


def _own_forward(q, k, v, own: OwnChunks | None, chunk: int, scale: float):
    """Own-chunk attention: (out ``[B, H, S, Dv]`` in q's dtype or fp32, lse ``[B, H, S]`` fp32);
    ``own``: the padded chunks of a layout with documents, None on the grid."""
    B, H, S, D = q.shape
    H_kv, Dv = k.shape[1], v.shape[-1]
    if own is None:
        group = H // H_kv
        out, lse = _causal_chunks(_chunk_view(q, chunk), _chunk_view(k, chunk, group), _chunk_view(v, chunk, group),
                                  scale)
        return _unchunk(out, B, H, S), _unchunk(lse, B, H, S)
    out, lse = _causal_chunks(own.padded(q.reshape(-1, D), own.query_rows), own.padded(k.reshape(-1, D), own.key_rows),
                              own.padded(v.reshape(-1, Dv), own.key_rows), scale)
    return own.unpadded(out).view(B, H, S, Dv), own.unpadded(lse[..., None]).view(B, H, S)


def _own_backward(grad_out, q, k, v, out, lse, own: OwnChunks | None, chunk: int, scale: float):
    """Own-chunk gradients ``(dq, dk, dv)`` given the merged ``out`` and ``lse``."""
    B, H, S, D = q.shape
    H_kv, Dv = k.shape[1], v.shape[-1]
    group = H // H_kv
    if own is None:
        dq, dk, dv = _causal_chunks_backward(
            _chunk_view(grad_out, chunk), _chunk_view(q, chunk), _chunk_view(k, chunk, group),
            _chunk_view(v, chunk, group), _chunk_view(out, chunk), _chunk_view(lse[..., None], chunk)[..., 0], scale)
        dk = _unchunk(dk, B, H, S).reshape(B, H_kv, group, S, D).sum(2)
        dv = _unchunk(dv, B, H, S).reshape(B, H_kv, group, S, Dv).sum(2)
        return _unchunk(dq, B, H, S).contiguous(), dk.contiguous(), dv.contiguous()
    rows, keys = own.query_rows, own.key_rows
    dq, dk, dv = _causal_chunks_backward(
        own.padded_zeros(grad_out.reshape(-1, Dv)), own.padded(q.reshape(-1, D), rows),
        own.padded(k.reshape(-1, D), keys), own.padded(v.reshape(-1, Dv), keys), own.padded(out.reshape(-1, Dv), rows),
        own.padded(lse.reshape(-1, 1), rows)[..., 0], scale)
    dk = k.new_zeros(B * H_kv * S, D).index_add_(0, keys.flatten(), dk.reshape(-1, D))
    dv = v.new_zeros(B * H_kv * S, Dv).index_add_(0, keys.flatten(), dv.reshape(-1, Dv))
    return own.unpadded(dq).view_as(q), dk.view(B, H_kv, S, D), dv.view(B, H_kv, S, Dv)


def gather_moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
    scale: float | None = None,
    query_block: int | None = None,
) -> torch.Tensor:
    """MoBA attention of ``q: [B, H, S, D]`` over ``k, v: [B, H_kv, S, D]`` -> ``[B, H, S, Dv]``.

    ``query_block``: rows of the smallest block of past pairs (:data:`BLOCK_UNITS`; None: the profile's); on
    long sequences a past chunk's queries run backward as a batch of blocks of twice this many rows.
    """
    return gather_plan(selection, k, v, query_block).attention(q, k, v, scale=scale)
