"""``"gather"``: queries regrouped per selected chunk, dense attention per group, the parts merged by
log-sum-exp (the kernel: :mod:`flexmoba.backends.gather.kernel`). Differentiable on every device, fused on CPU,
work and memory O(S * top_k * chunk_size). Decodes by reading each query's selected keys
(:func:`flexmoba.backends.gather.decode.gather_decode`).

Queries at ``query_start > 0`` (context parallelism): past chunks are whole and read from all the
keys; the own chunk runs on the local keys, causal; an own chunk that starts before
``query_start`` (a document or a chunk crossing the boundary) adds its earlier part as one more
non-causal part.
"""

from __future__ import annotations

import torch

from flexmoba.backends.gather.decode import gather_decode
from flexmoba.backends.gather.kernel import (
    PastPairs,
    Segment,
    gather_moba_attention,
    own_chunks,
    past_pairs,
    plan_pairs,
)
from flexmoba.backends.registry import Backend
from flexmoba.gate import Selection

__all__ = ["BACKENDS", "attend"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Selection, scale: float, *,
           query_start: int = 0) -> torch.Tensor:
    """``q: [B, H, S, D]`` at ``[query_start, query_start + S)``, ``k, v: [B, H_kv, query_start + S, D]``
    -> ``[B, H, S, Dv]``."""
    if query_start == 0:
        return gather_moba_attention(q, k, v, selection, scale)
    layout = selection.layout
    H, H_kv = q.shape[1], k.shape[1]
    with torch.no_grad():
        pairs = join_pairs(past_pairs(selection, H_kv), own_chunk_prefixes(selection, H, H_kv, query_start))
        on_grid = not layout.has_documents and query_start % layout.chunk_size == 0
        own = None if on_grid else own_chunks(selection, H, H_kv)
        plan = plan_pairs(pairs, own, layout.chunk_size, tuple(q.shape[:3]), tuple(k.shape), v.shape[-1],
                          key_offset=query_start)
    return plan.attention(q, k, v, scale=scale)


def own_chunk_prefixes(selection: Selection, heads: int, kv_heads: int, query_start: int) -> PastPairs:
    """The part before ``query_start`` of the local queries' own chunks, as non-causal pairs.

    Only the first run of local queries can have it: those whose chunk started before
    ``query_start``. One segment per (batch row, KV head) that has one.
    """
    layout = selection.layout
    B, S = layout.global_chunk.shape
    group = heads // kv_heads
    run = (layout.global_chunk == layout.global_chunk[:, :1]).sum(1)  # [B] the first chunk's queries
    starts = layout.chunk_start[:, 0]
    queries, segments, offset = [], [], 0
    for b, (start, count) in enumerate(zip(starts.tolist(), run.tolist(), strict=True)):
        if start >= query_start:
            continue
        for g in range(kv_heads):
            rows = (b * heads + g * group + torch.arange(group, device=layout.global_chunk.device))[:, None]
            queries.append((rows * S + torch.arange(count, device=rows.device)).flatten())
            segments.append(Segment(offset, group * count, b * kv_heads + g, start, query_start - start))
            offset += group * count
    empty = torch.zeros(0, dtype=torch.long, device=layout.global_chunk.device)
    query = torch.cat(queries) if queries else empty
    return PastPairs(query, segments)


def join_pairs(first: PastPairs, second: PastPairs) -> PastPairs:
    """Both pair lists in one, ``second``'s segments after ``first``'s."""
    shift = len(first.query)
    moved = [seg._replace(offset=seg.offset + shift) for seg in second.segments]
    return PastPairs(torch.cat([first.query, second.query]), first.segments + moved)


BACKENDS = {"gather": Backend(attend, decode=gather_decode)}
