"""Sparse, exact, differentiable MoBA: each query's chunks attended apart, merged by log-sum-exp.

A query's MoBA output is one softmax over the union of its selected chunks. Attending each
chunk apart gives a partial output and its log-sum-exp; merging the parts by log-sum-exp
gives the exact output. Two kinds of part:

- **own chunk**, causal inside: block-diagonal causal attention. Without documents the
  chunks sit on a fixed grid, so ``[B, H, S, D]`` is viewed as ``[B * H * n_chunks, c, D]``
  and one fused causal call covers every chunk, without copying anything. With
  documents each chunk is one causal call on views of q, k and v.
- **past chunks**, whole and wholly in the past: (query, chunk) pairs are sorted by the
  keys they read, as the official efficient kernel does, so each chunk is one dense call of
  the queries that selected it against a view of its keys. Query heads that share a KV
  head (GQA) share the call.

On CPU every call is torch's fused flash-attention kernel, which also returns the
log-sum-exp; elsewhere the same math runs unfused. The backward pass is FlashAttention's:
each part's gradient is computed from the *merged* output and log-sum-exp, which makes it
the exact gradient of one softmax over the union of the selected keys; key and value
gradients land in views of dk, dv. Work and memory are O(S * top_k * chunk_size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexmoba import validation
from flexmoba.gate import Selection

__all__ = ["gather_moba_attention"]


def selected_pairs(selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
    """Global chunk of every (query, slot) pair and whether it is used: ``[B, H, S, P + 1]`` each.

    The last slot is the own chunk.
    """
    layout = selection.layout
    first = layout.first_global_chunk[:, None, :, None]  # [B, 1, S, 1]
    past = first + selection.past_chunks
    own = layout.global_chunk[:, None, :, None].expand(*selection.past_chunks.shape[:3], 1)
    valid = torch.cat([selection.past_valid, torch.ones_like(own, dtype=torch.bool)], -1)
    return torch.cat([past, own], -1), valid


@dataclass(frozen=True)
class Segment:
    """One dense call: ``count`` queries from ``offset`` against keys ``[start, start + length)``
    of KV row ``kv_row`` (``b * H_kv + kv head``); causal calls attend up to the query."""

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


def sort_key_dtype(max_value: int) -> torch.dtype:
    """The smallest integer type holding ``0 .. max_value``, for sort keys."""
    return torch.int16 if max_value < 2**15 else torch.int32 if max_value < 2**31 else torch.long


def past_pairs(selection: Selection, kv_heads: int) -> PastPairs:
    """Sort the selected past pairs by (KV row, global chunk); one host read sizes the segments.

    Segment starts are the chunks' key positions (``layout.doc_start`` is in key positions, so
    queries may sit at an offset of longer keys, as in :mod:`flexmoba.context_parallel`).
    """
    layout = selection.layout
    B, H, S, P = selection.past_chunks.shape
    n_global = layout.n_global_chunks
    device = selection.past_chunks.device
    kv_row = (torch.arange(B, device=device)[:, None] * kv_heads
              + torch.arange(H, device=device) // (H // kv_heads))[:, :, None, None]  # [B, H, 1, 1]
    global_chunk = layout.first_global_chunk[:, None, :, None] + selection.past_chunks  # [B, H, S, P]
    n_buckets = B * kv_heads * n_global
    bucket = torch.where(selection.past_valid, kv_row * n_global + global_chunk, n_buckets).flatten()
    counts = torch.bincount(bucket, minlength=n_buckets + 1)[:n_buckets]
    slot = torch.argsort(bucket.to(sort_key_dtype(n_buckets)), stable=True)  # "unused" is bucket n_buckets
    start = layout.doc_start[:, None, :, None] + selection.past_chunks * layout.chunk_size  # [B, H, S, P]
    starts = torch.zeros(n_buckets + 1, dtype=torch.long, device=device).scatter_(0, bucket, start.flatten())
    used = counts.nonzero().squeeze(1)
    segments, offset = [], 0
    for b, count, start in zip(used.tolist(), counts[used].tolist(), starts[used].tolist(), strict=True):
        segments.append(Segment(offset, count, b // n_global, start, layout.chunk_size))
        offset += count
    slot = slot[:offset]  # flat index in [B, H, S, P]
    return PastPairs(torch.div(slot, P, rounding_mode="floor") if P else slot, segments)


def own_segments(selection: Selection, heads: int, kv_heads: int) -> list[Segment]:
    """One causal segment per (batch, query head, chunk), for layouts with documents.

    ``offset`` indexes the rows of ``q.reshape(B * H * S, D)``.
    """
    layout = selection.layout
    B, S = layout.global_chunk.shape
    is_first = torch.ones_like(layout.global_chunk, dtype=torch.bool)
    is_first[:, 1:] = layout.global_chunk[:, 1:] != layout.global_chunk[:, :-1]
    b, start = is_first.nonzero(as_tuple=True)
    end = torch.cat([start[1:], start.new_tensor([S])])
    row_ends = torch.cat([b[1:] != b[:-1], torch.ones(1, dtype=torch.bool, device=b.device)])
    end = torch.where(row_ends, S, end)
    group = heads // kv_heads
    segments = []
    for b_i, s_i, e_i in zip(b.tolist(), start.tolist(), end.tolist(), strict=True):
        for h in range(heads):
            row = b_i * heads + h
            segments.append(Segment(row * S + s_i, e_i - s_i, b_i * kv_heads + h // group, s_i, e_i - s_i))
    return segments


def _fused_cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _causal_mask(n: int, m: int, device) -> torch.Tensor:
    return torch.ones(n, m, dtype=torch.bool, device=device).tril()


def dense_attention(q, k, v, causal: bool, scale: float):
    """``q: [N, 1, L, D]``, ``k, v: [N, 1, M, D]`` -> (out ``[N, 1, L, Dv]``, lse ``[N, 1, L]`` fp32)."""
    if _fused_cpu(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    logits = (q @ k.transpose(-1, -2)).float() * scale
    if causal:
        logits = logits.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return (torch.exp(logits - lse[..., None]).to(v.dtype) @ v), lse


def dense_attention_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of :func:`dense_attention` given the *merged* ``out`` and ``lse`` of its queries."""
    if _fused_cpu(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    logits = (q @ k.transpose(-1, -2)).float() * scale
    if causal:
        logits = logits.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    probs = torch.exp(logits - lse[..., None])
    grad_probs = grad_out.float() @ v.float().transpose(-1, -2)
    delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
    grad_logits = probs * (grad_probs - delta) * scale
    dq = grad_logits @ k.float()
    dk = grad_logits.transpose(-1, -2) @ q.float()
    dv = probs.transpose(-1, -2) @ grad_out.float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# The fused CPU backward parallelises over the batch only: in the backward pass a chunk's queries
# run as a batch of blocks of this many rows against one (broadcast) copy of its keys (the
# forward parallelises over query blocks itself and takes them in one call).
QUERY_BLOCK = 128


def _row_blocks(n: int, block: int) -> list[tuple[int, int, int]]:
    """``(first row, batch, rows per item)``: n rows as a batch of whole blocks plus the rest."""
    whole = n // block * block
    parts = [(0, n // block, block)] if whole else []
    return parts + ([(whole, 1, n - whole)] if n > whole else [])


def past_chunk_attention_backward(grad_out, q, k, v, out, lse, scale: float, block: int = QUERY_BLOCK):
    """Gradients ``(dq [n, D], dk [c, D], dv [c, Dv])`` of ``q: [n, D]``'s attention over the
    whole chunk ``k, v: [c, D]``, given the merged ``out`` and ``lse`` of its queries."""
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


# Past pairs run as one batch of query blocks, each with a copy of its chunk's keys and values,
# when those copies take at most this many bytes; above it, one call per chunk reads its keys in place.
BATCHED_PAIRS_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class PairBlocks:
    """The past pairs cut into blocks of ``R`` rows, each block one chunk's, padded with zero rows.

    Attributes:
        keys: ``[n_blocks, c]`` flat index of each block's keys in ``[B * H_kv * T]``.
        query_of_row: ``[n_blocks, R]`` the query row of each block row (0 for padding rows).
        used: ``[n_blocks, R]`` bool, the rows that hold a pair.
        query: ``[n_used]`` the used rows' queries, in block order.
    """

    keys: torch.Tensor
    query_of_row: torch.Tensor
    used: torch.Tensor
    query: torch.Tensor

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [B * H * S, *]`` per query -> ``[n_blocks, R, *]`` per block row (zeros for padding)."""
        used = self.used.view(*self.used.shape, *[1] * (x.dim() - 1))
        return x[self.query_of_row].masked_fill_(~used, 0)

    def keys_and_values(self, k_rows: torch.Tensor, v_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k_rows, v_rows: [B * H_kv, T, D]`` -> each block's copy ``[n_blocks, 1, c, D]``."""
        return (k_rows.reshape(-1, k_rows.shape[-1])[self.keys][:, None],
                v_rows.reshape(-1, v_rows.shape[-1])[self.keys][:, None])


def pair_blocks(pairs: PastPairs, key_len: int, chunk: int, rows: int, width: int) -> PairBlocks | None:
    """:class:`PairBlocks` of the pairs, or None where a segment is not a whole chunk or the copies of
    keys and values (``width`` = D + Dv fp32 columns per key) would exceed :data:`BATCHED_PAIRS_MAX_BYTES`."""
    segments = pairs.segments
    if not segments or any(seg.length != chunk for seg in segments):
        return None
    n_blocks = sum(-(-seg.count // rows) for seg in segments)
    if n_blocks * chunk * width * 4 > BATCHED_PAIRS_MAX_BYTES:
        return None
    device = pairs.query.device
    per_segment = lambda f: torch.tensor([f(seg) for seg in segments], device=device)  # noqa: E731
    blocks = per_segment(lambda seg: -(-seg.count // rows))
    segment = torch.repeat_interleave(torch.arange(len(segments), device=device), blocks)  # [n_blocks]
    first_block = torch.cumsum(blocks, 0) - blocks
    block_in_segment = torch.arange(n_blocks, device=device) - first_block[segment]
    row = block_in_segment[:, None] * rows + torch.arange(rows, device=device)  # [n_blocks, R] row in the segment
    used = row < per_segment(lambda seg: seg.count)[segment][:, None]
    pair = torch.where(used, per_segment(lambda seg: seg.offset)[segment][:, None] + row, len(pairs.query))
    first_key = per_segment(lambda seg: seg.kv_row * key_len + seg.start)[segment]
    query_of_row = torch.where(used, pairs.query[pair.clamp(max=len(pairs.query) - 1)], 0)
    return PairBlocks(first_key[:, None] + torch.arange(chunk, device=device), query_of_row, used,
                      pairs.query[pair[used]])


class _GatheredMoBA(torch.autograd.Function):
    """``q: [B, H, S, D]`` over ``k, v: [B, H_kv, T, D]``, T >= S; the queries' own chunks lie in
    keys ``[key_offset, key_offset + S)`` (0 and T = S unless queries sit at the end of longer keys)."""

    @staticmethod
    def forward(ctx, q, k, v, pairs: PastPairs, own: list[Segment] | None, chunk: int, scale: float, block: int,
                key_offset: int = 0):
        B, H, S, D = q.shape
        H_kv, Dv = k.shape[1], v.shape[-1]
        own_out, own_lse = _own_forward(q, k.narrow(2, key_offset, S), v.narrow(2, key_offset, S), own, chunk, scale)
        q_rows, k_rows, v_rows = q.reshape(-1, D), k.reshape(B * H_kv, -1, D), v.reshape(B * H_kv, -1, Dv)
        blocks = pair_blocks(pairs, k_rows.shape[1], chunk, block, D + Dv)
        if blocks is None:
            pair_q = q_rows[pairs.query]
            pair_out = q.new_empty(len(pairs.query), Dv)
            pair_lse = torch.empty(len(pairs.query), device=q.device)
            for seg in pairs.segments:
                rows = slice(seg.offset, seg.offset + seg.count)
                seg_out, seg_lse = dense_attention(pair_q[rows][None, None], *_keys(k_rows, v_rows, seg), False, scale)
                pair_out[rows], pair_lse[rows] = seg_out[0, 0], seg_lse[0, 0]
            query = pairs.query
        else:
            keys, values = blocks.keys_and_values(k_rows, v_rows)
            block_out, block_lse = dense_attention(blocks.rows(q_rows)[:, None], keys, values, False, scale)
            pair_out, pair_lse, query = block_out[:, 0][blocks.used], block_lse[:, 0][blocks.used], blocks.query
        out, lse = merge_pairs(own_out.reshape(-1, Dv), own_lse.flatten(), query, pair_out, pair_lse)
        out = out.view(B, H, S, Dv)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pairs, ctx.blocks, ctx.own, ctx.chunk, ctx.scale, ctx.block = pairs, blocks, own, chunk, scale, block
        ctx.key_offset = key_offset
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, S, D = q.shape
        H_kv, Dv = k.shape[1], v.shape[-1]
        pairs, scale = ctx.pairs, ctx.scale
        grad_out = grad_out.contiguous()
        k_own, v_own = k.narrow(2, ctx.key_offset, S), v.narrow(2, ctx.key_offset, S)
        dq, dk, dv = _own_backward(grad_out, q, k_own, v_own, out, lse.view(B, H, S), ctx.own, ctx.chunk, scale)
        dk, dv = _embed_keys(dk, k, ctx.key_offset), _embed_keys(dv, v, ctx.key_offset)
        q_rows, k_rows, v_rows = q.reshape(-1, D), k.reshape(B * H_kv, -1, D), v.reshape(B * H_kv, -1, Dv)
        dk_rows, dv_rows = dk.view(B * H_kv, -1, D), dv.view(B * H_kv, -1, Dv)
        blocks = ctx.blocks
        if blocks is not None:
            dq_b, dk_b, dv_b = dense_attention_backward(
                blocks.rows(grad_out.reshape(-1, Dv))[:, None], blocks.rows(q_rows)[:, None],
                *blocks.keys_and_values(k_rows, v_rows), blocks.rows(out.reshape(-1, Dv))[:, None],
                blocks.rows(lse[:, None])[:, None, :, 0], False, scale)
            dq.view(-1, D).index_add_(0, blocks.query, dq_b[:, 0][blocks.used])
            dk.view(-1, D).index_add_(0, blocks.keys.flatten(), dk_b.reshape(-1, D))
            dv.view(-1, Dv).index_add_(0, blocks.keys.flatten(), dv_b.reshape(-1, Dv))
            return dq, dk, dv, None, None, None, None, None, None
        index = pairs.query
        pair_grad, pair_q = grad_out.reshape(-1, Dv)[index], q_rows[index]
        pair_out, pair_lse = out.reshape(-1, Dv)[index], lse[index]
        pair_dq = torch.empty_like(pair_q)
        for seg in pairs.segments:
            rows, keys = slice(seg.offset, seg.offset + seg.count), slice(seg.start, seg.start + seg.length)
            pair_dq[rows], dk_s, dv_s = past_chunk_attention_backward(
                pair_grad[rows], pair_q[rows], k_rows[seg.kv_row, keys], v_rows[seg.kv_row, keys],
                pair_out[rows], pair_lse[rows], scale, ctx.block)
            dk_rows[seg.kv_row, keys] += dk_s
            dv_rows[seg.kv_row, keys] += dv_s
        dq.view(-1, D).index_add_(0, index, pair_dq)
        return dq, dk, dv, None, None, None, None, None, None


def _keys(k_rows, v_rows, seg: Segment):
    """Views ``[1, 1, length, D]`` of a segment's keys and values."""
    keys = slice(seg.start, seg.start + seg.length)
    return k_rows[seg.kv_row, keys][None, None], v_rows[seg.kv_row, keys][None, None]


def _own_forward(q, k, v, own: list[Segment] | None, chunk: int, scale: float):
    """Own-chunk attention: (out ``[B, H, S, Dv]``, lse ``[B, H, S]`` fp32)."""
    B, H, S, D = q.shape
    H_kv, Dv = k.shape[1], v.shape[-1]
    if own is None:
        group = H // H_kv
        out, lse = dense_attention(_chunk_view(q, chunk), _chunk_view(k, chunk, group), _chunk_view(v, chunk, group),
                                   True, scale)
        return _unchunk(out, B, H, S), _unchunk(lse, B, H, S)
    q_rows, k_rows, v_rows = q.reshape(-1, D), k.reshape(B * H_kv, S, D), v.reshape(B * H_kv, S, Dv)
    out = q.new_empty(B * H * S, Dv)
    lse = torch.empty(B * H * S, device=q.device)
    for seg in own:
        rows = slice(seg.offset, seg.offset + seg.count)
        seg_out, seg_lse = dense_attention(q_rows[rows][None, None], *_keys(k_rows, v_rows, seg), True, scale)
        out[rows], lse[rows] = seg_out[0, 0], seg_lse[0, 0]
    return out.view(B, H, S, Dv), lse.view(B, H, S)


def _own_backward(grad_out, q, k, v, out, lse, own: list[Segment] | None, chunk: int, scale: float):
    """Own-chunk gradients ``(dq, dk, dv)`` given the merged ``out`` and ``lse``."""
    B, H, S, D = q.shape
    H_kv, Dv = k.shape[1], v.shape[-1]
    group = H // H_kv
    if own is None:
        dq, dk, dv = dense_attention_backward(
            _chunk_view(grad_out, chunk), _chunk_view(q, chunk), _chunk_view(k, chunk, group),
            _chunk_view(v, chunk, group), _chunk_view(out, chunk), _chunk_view(lse[..., None], chunk)[..., 0],
            True, scale)
        dk = _unchunk(dk, B, H, S).reshape(B, H_kv, group, S, D).sum(2)
        dv = _unchunk(dv, B, H, S).reshape(B, H_kv, group, S, Dv).sum(2)
        return _unchunk(dq, B, H, S).contiguous(), dk.contiguous(), dv.contiguous()
    q_rows, k_rows, v_rows = q.reshape(-1, D), k.reshape(B * H_kv, S, D), v.reshape(B * H_kv, S, Dv)
    g_rows, o_rows, l_rows = grad_out.reshape(-1, Dv), out.reshape(-1, Dv), lse.reshape(-1)
    dq, dk, dv = torch.zeros_like(q_rows), torch.zeros_like(k_rows), torch.zeros_like(v_rows)
    for seg in own:
        rows = slice(seg.offset, seg.offset + seg.count)
        keys = slice(seg.start, seg.start + seg.length)
        dq_s, dk_s, dv_s = dense_attention_backward(
            g_rows[rows][None, None], q_rows[rows][None, None], *_keys(k_rows, v_rows, seg),
            o_rows[rows][None, None], l_rows[rows][None, None], True, scale)
        dq[rows] = dq_s[0, 0]
        dk[seg.kv_row, keys] += dk_s[0, 0]
        dv[seg.kv_row, keys] += dv_s[0, 0]
    return dq.view_as(q), dk.view_as(k), dv.view_as(v)


def merge_pairs(own_out, own_lse, query, pair_out, pair_lse):
    """Merge each query's own part (``[N, Dv]``, ``[N]``) with its past pairs (``pair_out: [n, Dv]``,
    ``pair_lse: [n]`` of queries ``query: [n]``) by log-sum-exp, accumulated per query.

    Returns (out ``[N, Dv]`` in own_out's dtype, lse ``[N]`` fp32).
    """
    top = own_lse.scatter_reduce(0, query, pair_lse, "amax")
    top = torch.where(torch.isfinite(top), top, 0.0)
    total = torch.exp(own_lse - top).index_add_(0, query, torch.exp(pair_lse - top[query]))
    lse = top + torch.log(total)
    weight_of = lambda part_lse, rows: torch.exp(part_lse - lse[rows])[:, None]  # noqa: E731
    out = own_out.float() * weight_of(own_lse, slice(None))
    out.index_add_(0, query, pair_out.float() * weight_of(pair_lse, query))
    return out.to(own_out.dtype), lse


def gather_moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
    scale: float | None = None,
    query_block: int = QUERY_BLOCK,
) -> torch.Tensor:
    """MoBA attention of ``q: [B, H, S, D]`` over ``k, v: [B, H_kv, S, D]`` -> ``[B, H, S, Dv]``.

    ``query_block``: in the backward pass a past chunk's queries run as a batch of blocks of this many rows.
    """
    scale = validation.softmax_scale(scale, q)
    with torch.no_grad():
        pairs = past_pairs(selection, k.shape[1])
        own = own_segments(selection, q.shape[1], k.shape[1]) if selection.layout.has_documents else None
    return _GatheredMoBA.apply(q, k, v, pairs, own, selection.layout.chunk_size, scale, query_block)
