"""The regrouped flex plan trained piece by piece, keeping no virtual rows for the backward.

Through plain autograd the plan keeps every virtual row's output (``[B, H_kv, L, Dv]``, about
``top_k`` copies of the output) for the merge's backward, and its gradient once more. Here the
forward runs the pieces without autograd, merges, and keeps only q, k, v, the merged output
``y: [B, H, S, Dv]`` and each query's log-sum-exp over its slots ``[B, H, S]``. The backward
runs each piece's flex call again, with autograd, and hands it the gradients of its rows:

    w_r = exp(lse_r - lse_i),    dL/dout_r = w_r g_i,    dL/dlse_r = w_r (g_i . out_r - g_i . y_i),

for row r read by query i (``plan.source``); padding rows feed no query and get none. Gradients
of q, k and v then accumulate over the pieces. The price is every flex call run twice, so the
plan takes this way only when it runs in several pieces (long sequences), where the tables of
one piece are alive at a time as well.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flexmoba.lse_merge import merge_by_lse, query_lse

__all__ = ["recomputed_attention"]


# ``plan`` below is a flexmoba.backends.flex.plan.MoBAFlexPlan (not imported: that module imports this one).


def _rows_read(plan) -> torch.Tensor:
    """``[B, H_kv, L]`` bool: the virtual rows some used slot reads. The rest pad (a chunk's rows to whole
    blocks, which attend its keys, and the pieces to one length) and feed no query."""
    B, H, S, K = plan.rows.shape
    H_kv = plan.source.shape[1]
    count = torch.zeros(plan.source.shape, dtype=torch.int32, device=plan.source.device)
    count.scatter_add_(2, plan.rows.reshape(B, H_kv, -1), plan.valid.reshape(B, H_kv, -1).to(torch.int32))
    return count > 0


class _RecomputedPlanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, flex, scale):
        with torch.no_grad():
            out, lse = plan.run_in_pieces(flex, q, k, v, scale)
            y = merge_by_lse(out, lse, plan.rows, plan.valid)
            per_query_lse = query_lse(lse, plan.rows, plan.valid)
        ctx.save_for_backward(q, k, v, y, per_query_lse)
        ctx.plan, ctx.flex, ctx.scale = plan, flex, scale
        return y

    @staticmethod
    def backward(ctx, grad):
        q, k, v, y, per_query_lse = ctx.saved_tensors
        plan = ctx.plan
        leaves = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3], strict=True)]
        grad = grad.contiguous()  # read once per piece: a transposed one would be copied each time
        g_dot_y = (grad.float() * y.float()).sum(-1)  # [B, H, S]
        read = _rows_read(plan)
        length = plan.virtual_len // plan.pieces
        for start in range(0, plan.virtual_len, length):
            end = start + length
            with torch.enable_grad():
                out, lse = plan.flex_piece(ctx.flex, start, end, ctx.scale, leaves[0], leaves[1], leaves[2])
            weight = torch.exp(lse.detach().float() - plan.gather_queries(per_query_lse, start, end))
            weight = weight.masked_fill(~read[:, :, start:end], 0.0)
            g = plan.gather_queries(grad, start, end).float()  # [B, H_kv, n, Dv]
            grad_lse = weight * ((g * out.detach().float()).sum(-1) - plan.gather_queries(g_dot_y, start, end))
            grad_out = g.mul_(weight[..., None]).to(out.dtype)
            torch.autograd.backward((out, lse), (grad_out, grad_lse.to(lse.dtype)))
        return (*(leaf.grad if leaf.requires_grad else None for leaf in leaves), None, None, None)


def recomputed_attention(plan, flex: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """MoBA of ``q: [B, H, S, D]`` over ``k, v: [B, H_kv, S, D]`` through ``plan`` (no sink key), differentiable
    with each piece's flex call recomputed in the backward -> ``[B, H, S, Dv]``."""
    return _RecomputedPlanAttention.apply(q, k, v, plan, flex, scale)
