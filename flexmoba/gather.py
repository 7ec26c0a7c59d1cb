"""Sparse, exact, differentiable MoBA by regrouping queries per selected chunk.

Queries can be processed in any order, so (as the official efficient kernel does) every
(query, selected chunk) pair is sorted by chunk and packed into groups of up to
``group_size`` queries that attend the same chunk. Each group is one small dense attention
``[group_size, chunk_size]``; a query's partial results are merged with their
log-sum-exp. Work and memory follow the real selection, O(S · top_k · chunk_size), not
the union over a tile.

Past chunks are whole and wholly in the past, so their groups need no mask; own-chunk
groups carry a causal mask. On CPU each group batch runs torch's fused flash-attention
kernel, which also returns the log-sum-exp; elsewhere the same math runs unfused.

The backward pass is FlashAttention's: each group's gradient is computed with the merged
output and merged log-sum-exp, which makes it the exact gradient of one softmax over the
union of the selected keys. Query heads that share a KV head (GQA) share groups, so a
chunk's keys are gathered once per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexmoba.selection import Selection

DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True)
class GroupPlan:
    """How a set of (query, chunk) pairs is packed into ``[n_groups, group_size]`` groups.

    Attributes:
        pair: ``[P]`` flat index of each pair in ``[B, H, S, K]``.
        group, slot: ``[P]`` where each pair sits in the packed batch.
        query_pos: ``[n_groups, group_size]`` position of each packed query (padding: S).
        key_index: ``[n_groups, chunk_size]`` flat row of each group's keys in
            ``k.reshape(B * H_kv * S, D)``.
        allowed: ``[n_groups, group_size, chunk_size]`` bool, or None when every key is
            attended (past chunks).
    """

    pair: torch.Tensor
    group: torch.Tensor
    slot: torch.Tensor
    query_pos: torch.Tensor
    key_index: torch.Tensor
    allowed: torch.Tensor | None


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


def chunk_bounds(selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, G]`` start position and length of every global chunk."""
    layout = selection.layout
    B, S = layout.global_chunk.shape
    positions = torch.arange(S, device=layout.global_chunk.device).expand(B, S)
    start = torch.full((B, layout.n_global_chunks), S, dtype=torch.long, device=positions.device)
    start.scatter_reduce_(1, layout.global_chunk, positions, reduce="amin")
    length = torch.zeros_like(start).scatter_add_(1, layout.global_chunk, torch.ones_like(positions))
    return start, length


def plan_groups(selection: Selection, H_kv: int, used: torch.Tensor, masked: bool, group_size: int) -> GroupPlan:
    """Pack the pairs marked in ``used: [B, H, S, K]`` into groups that share a chunk."""
    chunk, _ = selected_pairs(selection)
    B, H, S, K = chunk.shape
    G, c = selection.layout.n_global_chunks, selection.layout.chunk_size
    device = chunk.device

    # Each pair reads the keys of segment (b, kv head, chunk); sort pairs by segment.
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    kv_head = (torch.arange(H, device=device) // (H // H_kv)).view(1, H, 1, 1)
    segment = ((b * H_kv + kv_head) * G + chunk).flatten()
    pair = used.flatten().nonzero().squeeze(1)
    pair = pair[torch.argsort(segment[pair], stable=True)]
    pair_segment = segment[pair]

    n_segments = B * H_kv * G
    count = torch.bincount(pair_segment, minlength=n_segments)
    groups_per_segment = (count + group_size - 1) // group_size
    first_group = torch.cumsum(groups_per_segment, 0) - groups_per_segment
    rank = torch.arange(pair.numel(), device=device) - (torch.cumsum(count, 0) - count)[pair_segment]
    group = first_group[pair_segment] + rank // group_size
    slot = rank % group_size
    n_groups = int(groups_per_segment.sum())  # host sync: sizes the packed batch

    query_pos = torch.full((n_groups, group_size), S, dtype=torch.long, device=device)
    query_pos[group, slot] = pair // K % S
    group_segment = torch.repeat_interleave(torch.arange(n_segments, device=device), groups_per_segment,
                                            output_size=n_groups)
    row, group_chunk = group_segment // G, group_segment % G  # row = b * H_kv + kv head
    starts, lengths = chunk_bounds(selection)
    offsets = torch.arange(c, device=device)
    key_pos = starts[row // H_kv, group_chunk][:, None] + offsets  # [n_groups, c]
    key_index = row[:, None] * S + key_pos.clamp(max=S - 1)
    allowed = None
    if masked:
        key_real = offsets < lengths[row // H_kv, group_chunk][:, None]
        allowed = key_real[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
    return GroupPlan(pair, group, slot, query_pos, key_index, allowed)


def _fused_cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _additive_mask(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The fused kernel takes a float mask in the query's dtype: 0 where allowed, -inf elsewhere."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))[:, None]


def group_attention(q, k, v, allowed, scale):
    """``q: [N, Gs, D]``, ``k, v: [N, c, D]`` -> (out ``[N, Gs, Dv]``, lse ``[N, Gs]`` fp32)."""
    if _fused_cpu(q):
        mask = _additive_mask(allowed, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, None], k[:, None], v[:, None], 0.0, False, attn_mask=mask, scale=scale)
        return out[:, 0], lse[:, 0].float()
    logits = (q @ k.transpose(-1, -2)).float() * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return (torch.exp(logits - lse[..., None]).to(v.dtype) @ v), lse


def group_attention_backward(grad_out, q, k, v, out, lse, allowed, scale):
    """Gradients of one group batch, given the *merged* ``out`` and ``lse`` of its queries."""
    if _fused_cpu(q):
        mask = _additive_mask(allowed, q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out[:, None], q[:, None], k[:, None], v[:, None], out[:, None], lse[:, None].to(out.dtype),
            0.0, False, attn_mask=mask, scale=scale)
        return dq[:, 0], dk[:, 0], dv[:, 0]
    logits = (q @ k.transpose(-1, -2)).float() * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.exp(logits - lse[..., None])
    grad_probs = grad_out.float() @ v.float().transpose(-1, -2)
    delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
    grad_logits = probs * (grad_probs - delta) * scale
    dq = grad_logits @ k.float()
    dk = grad_logits.transpose(-1, -2) @ q.float()
    dv = probs.transpose(-1, -2) @ grad_out.float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _pack_queries(x_rows: torch.Tensor, plan: GroupPlan, K: int) -> torch.Tensor:
    """Rows ``[B * H * S, D]`` -> ``[n_groups, group_size, D]`` in the plan's packing (zeros elsewhere)."""
    packed = x_rows.new_zeros(*plan.query_pos.shape, x_rows.shape[-1])
    packed[plan.group, plan.slot] = x_rows[plan.pair // K]
    return packed


class _GatheredMoBA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plans, K, scale):
        B, H, S, D = q.shape
        H_kv, Dv = k.shape[1], v.shape[-1]
        q_rows, k_rows, v_rows = q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, Dv)
        pair_out = q.new_zeros(B * H * S * K, Dv)
        pair_lse = torch.full((B * H * S * K,), float("-inf"), device=q.device)
        for plan in plans:
            out, lse = group_attention(_pack_queries(q_rows, plan, K), k_rows[plan.key_index],
                                       v_rows[plan.key_index], plan.allowed, scale)
            pair_out[plan.pair] = out[plan.group, plan.slot]
            pair_lse[plan.pair] = lse[plan.group, plan.slot]
        lse = torch.logsumexp(pair_lse.view(B, H, S, K), dim=-1)  # [B, H, S]
        weights = torch.exp(pair_lse.view(B, H, S, K) - lse[..., None]).to(q.dtype)
        out = (weights[..., None] * pair_out.view(B, H, S, K, Dv)).sum(3)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.K, ctx.scale = plans, K, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        D, Dv, K = q.shape[-1], v.shape[-1], ctx.K
        q_rows, k_rows, v_rows = q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, Dv)
        grad_rows, out_rows = grad_out.reshape(-1, Dv).contiguous(), out.reshape(-1, Dv)
        lse_rows = lse.reshape(-1, 1)
        dq, dk, dv = torch.zeros_like(q_rows), torch.zeros_like(k_rows), torch.zeros_like(v_rows)
        for plan in ctx.plans:
            query_rows = plan.pair // K
            pack = lambda rows: _pack_queries(rows, plan, K)  # noqa: E731
            dq_g, dk_g, dv_g = group_attention_backward(
                pack(grad_rows), pack(q_rows), k_rows[plan.key_index], v_rows[plan.key_index],
                pack(out_rows), pack(lse_rows)[..., 0], plan.allowed, ctx.scale)
            dq.index_add_(0, query_rows, dq_g[plan.group, plan.slot])
            dk.index_add_(0, plan.key_index.flatten(), dk_g.flatten(0, 1))
            dv.index_add_(0, plan.key_index.flatten(), dv_g.flatten(0, 1))
        return dq.view_as(q), dk.view_as(k), dv.view_as(v), None, None, None


def gather_moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: Selection,
    scale: float | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> torch.Tensor:
    """MoBA attention of ``q: [B, H, S, D]`` over ``k, v: [B, H_kv, S, D]`` -> ``[B, H, S, Dv]``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.no_grad():
        _, valid = selected_pairs(selection)
        own = torch.zeros_like(valid)
        own[..., -1] = True
        plans = [plan_groups(selection, k.shape[1], used, masked, group_size)
                 for used, masked in ((valid & ~own, False), (own, True)) if used.any()]
    return _GatheredMoBA.apply(q, k, v, plans, valid.shape[-1], scale)
