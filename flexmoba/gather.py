"""Sparse, exact, differentiable MoBA by regrouping queries per selected chunk.

Queries can be processed in any order, so (as the official efficient kernel does) every
(query, selected chunk) pair is sorted by chunk and packed into groups of up to
``group_size`` queries that attend the same chunk. Each group is one small dense
attention ``[group_size, chunk_size]``; the partial results of a query's chunks are merged
with their log-sum-exp. Work and memory follow the real selection, O(S · top_k ·
chunk_size), not the union over a tile, and autograd gives exact gradients through plain
tensor ops, so it trains on CPU where FlexAttention has no backward.

Pairs of query heads that share a KV head (GQA) are grouped together, so a chunk's keys are
read once per KV head.
"""

from __future__ import annotations

import torch

from flexmoba.selection import Selection

DEFAULT_GROUP_SIZE = 128


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


def _chunk_bounds(selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, G]`` start position and length of every global chunk."""
    layout = selection.layout
    B, S = layout.global_chunk.shape
    G = layout.n_global_chunks
    positions = torch.arange(S, device=layout.global_chunk.device).expand(B, S)
    start = torch.full((B, G), S, dtype=torch.long, device=positions.device)
    start.scatter_reduce_(1, layout.global_chunk, positions, reduce="amin")
    length = torch.zeros(B, G, dtype=torch.long, device=positions.device)
    length.scatter_add_(1, layout.global_chunk, torch.ones_like(positions))
    return start, length


def gather_moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
    scale: float | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> torch.Tensor:
    """MoBA attention of ``q: [B, H, S, D]`` over ``k, v: [B, H_kv, S, D]`` -> ``[B, H, S, Dv]``."""
    B, H, S, D = q.shape
    H_kv, Dv = k.shape[1], v.shape[-1]
    heads_per_kv = H // H_kv
    c, G = selection.layout.chunk_size, selection.layout.n_global_chunks
    scale = D ** -0.5 if scale is None else scale
    device = q.device

    # 1. Every used (b, h, t, slot) pair, keyed by the (b, kv head, chunk) whose keys it reads.
    chunk, valid = selected_pairs(selection)  # [B, H, S, K]
    K = chunk.shape[-1]
    b_idx = torch.arange(B, device=device).view(B, 1, 1, 1)
    kv_head = (torch.arange(H, device=device) // heads_per_kv).view(1, H, 1, 1)
    segment = ((b_idx * H_kv + kv_head) * G + chunk).expand(B, H, S, K)
    pair = valid.flatten().nonzero().squeeze(1)  # flat index into [B, H, S, K]
    order = torch.argsort(segment.flatten()[pair], stable=True)
    pair, pair_segment = pair[order], segment.flatten()[pair][order]

    # 2. Pack each segment's pairs into groups of at most group_size.
    n_segments = B * H_kv * G
    count = torch.bincount(pair_segment, minlength=n_segments)
    groups_per_segment = (count + group_size - 1) // group_size
    first_group = torch.cumsum(groups_per_segment, 0) - groups_per_segment
    first_pair = torch.cumsum(count, 0) - count
    rank = torch.arange(pair.numel(), device=device) - first_pair[pair_segment]
    group = first_group[pair_segment] + rank // group_size
    slot = rank % group_size
    n_groups = int(groups_per_segment.sum())  # host sync: sizes the packed batch

    # 3. Queries into [n_groups, group_size, D]; each group's chunk keys into [n_groups, c, D].
    bhs = pair // K  # flat (b, h, t)
    query_pos = bhs % S
    packed_q = q.new_zeros(n_groups, group_size, D)
    packed_q[group, slot] = q.reshape(B * H * S, D)[bhs]
    packed_pos = torch.full((n_groups, group_size), -1, dtype=torch.long, device=device)
    packed_pos[group, slot] = query_pos

    group_segment = torch.repeat_interleave(torch.arange(n_segments, device=device), groups_per_segment,
                                            output_size=n_groups)
    group_chunk = group_segment % G
    group_row = group_segment // G  # b * H_kv + kv head
    starts, lengths = _chunk_bounds(selection)
    group_b = group_row // H_kv
    key_pos = starts[group_b, group_chunk][:, None] + torch.arange(c, device=device)  # [n_groups, c]
    key_real = torch.arange(c, device=device) < lengths[group_b, group_chunk][:, None]
    key_index = group_row[:, None] * S + key_pos.clamp(max=S - 1)
    packed_k = k.reshape(B * H_kv * S, D)[key_index]  # [n_groups, c, D]
    packed_v = v.reshape(B * H_kv * S, Dv)[key_index]

    # 4. One dense causal attention per group, then its log-sum-exp for the merge.
    logits = (packed_q @ packed_k.transpose(-1, -2)).float() * scale  # [n_groups, group_size, c]
    allowed = key_real[:, None, :] & (key_pos[:, None, :] <= packed_pos[:, :, None])
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [n_groups, group_size]; -inf on padding rows
    probs = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0)[..., None])
    partial = probs.to(v.dtype) @ packed_v  # [n_groups, group_size, Dv]

    # 5. Back to [B, H, S, K] pair order and merge each query's chunks.
    pair_out = q.new_zeros(B * H * S * K, Dv).index_put((pair,), partial[group, slot].to(q.dtype))
    pair_lse = torch.full((B * H * S * K,), float("-inf"), device=device).index_put((pair,), lse[group, slot])
    weights = torch.softmax(pair_lse.view(B, H, S, K), dim=-1)
    return (weights[..., None].to(q.dtype) * pair_out.view(B, H, S, K, Dv)).sum(3)
