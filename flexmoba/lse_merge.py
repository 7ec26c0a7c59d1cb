"""Partial attention outputs merged by their log-sum-exp: every path that merges parts of one softmax.

- :func:`merge_by_lse`: the flex plan's slots, one at a time (below);
- :func:`merge_pairs`: the ``gather`` kernel's own parts with their past (query, chunk) pairs, per query;
- :func:`merge_into` and :func:`merge_in_place`: one part into a running output, in place (the ``gather``
  kernel's long sequences, a chunk's two causal halves);
- :func:`merge_two`: two whole parts (context parallelism's local and past keys).

A part is ``(out, lse)``: its output over some keys and the log-sum-exp of its logits, fp32; a part that
attends nothing has lse -inf and adds nothing.

The slots of the flex plan
--------------------------

The regrouped flex plan (:mod:`flexmoba.backends.flex.plan`) gives each (query, selected chunk) pair its
own virtual row: an output over that chunk's keys and the row's log-sum-exp. A query's MoBA
output is the softmax-weighted sum of its rows' outputs:

    w_k = softmax_k(lse_k),        y = sum_k w_k o_k.

Plain autograd through ``[B, H, S, K, Dv]`` fp32 copies of the slots would keep K copies of the
output alive for the backward. Here the forward accumulates one slot at a time into one fp32
output and saves only the weights (K floats per query); the backward re-reads the slots:

    dL/do_k = w_k g,        dL/dlse_k = w_k (g . o_k - g . y),        g . y = sum_k w_k (g . o_k).

A slot that is not used has weight 0 and is skipped (its row may hold anything).
"""

from __future__ import annotations

import torch

__all__ = ["index_add_parts", "merge_by_lse", "merge_in_place", "merge_into", "merge_pairs", "merge_two",
           "query_lse"]


def _slot(out: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Virtual ``out: [B, H_kv, L, Dv]`` at the rows ``row: [B, H, S]`` -> ``[B, H, S, Dv]``."""
    B, H, S = row.shape
    H_kv, Dv = out.shape[1], out.shape[-1]
    index = row.reshape(B, H_kv, -1, 1).expand(-1, -1, -1, Dv)
    return out.gather(2, index).view(B, H, S, Dv)


def _summed_in(dtype: torch.dtype) -> torch.dtype:
    """fp32, or wider when the inputs are."""
    return torch.promote_types(dtype, torch.float32)


def _slot_lse(lse: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, K]`` (at least fp32) the rows' log-sum-exp per slot, -inf where the slot is not used."""
    B, H, S, K = rows.shape
    slot_lse = lse.to(_summed_in(lse.dtype)).gather(2, rows.reshape(B, lse.shape[1], -1)).view(B, H, S, K)
    return slot_lse.masked_fill(~valid, float("-inf"))


def slot_weights(lse: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, K]`` softmax over a query's used slots of the rows' log-sum-exp."""
    return torch.softmax(_slot_lse(lse, rows, valid), dim=-1)


def query_lse(lse: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, H, S]`` each query's log-sum-exp over all the keys it attends (its used slots)."""
    return torch.logsumexp(_slot_lse(lse, rows, valid), dim=-1)


def _masked_product(x: torch.Tensor, y: torch.Tensor, used: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * y`` in ``dtype``, 0 where not ``used``: one new tensor, the rest in place (the merge runs
    at a million tokens, where every ``[B, H, S, Dv]`` fp32 temporary counts)."""
    product = x.to(dtype, copy=True, memory_format=torch.contiguous_format)
    product.mul_(y)
    return product.masked_fill_(~used, 0.0)


class _MergeByLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, lse, rows, valid):
        weights = slot_weights(lse, rows, valid)
        summed_in = torch.promote_types(weights.dtype, _summed_in(out.dtype))
        merged = torch.zeros(*rows.shape[:3], out.shape[-1], dtype=summed_in, device=out.device)
        for k in range(rows.shape[-1]):
            merged += _masked_product(_slot(out, rows[..., k]), weights[..., k, None], valid[..., k, None], summed_in)
        ctx.save_for_backward(out, weights, rows, valid)
        ctx.lse_dtype = lse.dtype
        return merged.to(out.dtype)

    @staticmethod
    def backward(ctx, grad):
        out, weights, rows, valid = ctx.saved_tensors
        B, H, S, K = rows.shape
        H_kv, Dv = out.shape[1], out.shape[-1]
        summed_in = torch.promote_types(weights.dtype, _summed_in(out.dtype))
        grad_out = torch.zeros_like(out)  # each used row is one slot's: one addition each, exact in out's dtype
        g_dot_slot = torch.zeros(rows.shape, dtype=summed_in, device=out.device)
        for k in range(K):
            used = valid[..., k, None]
            g_dot_slot[..., k] = _masked_product(_slot(out, rows[..., k]), grad, used, summed_in).sum(-1)
            term = _masked_product(grad, weights[..., k, None], used, summed_in).to(out.dtype)
            index = rows[..., k].reshape(B, H_kv, -1, 1).expand(-1, -1, -1, Dv)
            grad_out.scatter_add_(2, index, term.view(B, H_kv, -1, Dv))
            del term
        g_dot_merged = (weights * g_dot_slot).sum(-1, keepdim=True)
        grad_slot_lse = torch.where(valid, weights * (g_dot_slot - g_dot_merged), 0.0)
        grad_lse = torch.zeros(out.shape[:3], dtype=summed_in, device=out.device)
        grad_lse.scatter_add_(2, rows.reshape(B, H_kv, -1), grad_slot_lse.reshape(B, H_kv, -1))
        return grad_out, grad_lse.to(ctx.lse_dtype), None, None


def merge_by_lse(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each query's slots merged by log-sum-exp.

    Args:
        out: ``[B, H_kv, L, Dv]`` virtual rows' outputs; lse: ``[B, H_kv, L]`` their log-sum-exp.
        rows: ``[B, H, S, K]`` (long) the virtual row of each (query, slot); a KV head's rows hold
            its group's query heads, ``H // H_kv`` of them.
        valid: ``[B, H, S, K]`` (bool) whether the slot is used; every query uses some slot.

    Returns:
        ``[B, H, S, Dv]`` in ``out``'s dtype, summed in fp32 (or wider inputs' dtype).
    """
    return _MergeByLse.apply(out, lse, rows, valid)


def merge_into(out, lse, query, part_out, part_lse) -> None:
    """Merge one part (``part_out: [m, Dv]``, ``part_lse: [m]``, of the distinct queries ``query: [m]``)
    into the running ``out: [N, Dv]`` fp32 and ``lse: [N]`` fp32 by log-sum-exp, in place.

    Only the part's rows are read and written, so a long sequence's past chunks merge one at a
    time without a buffer of every pair's output.
    """
    rows, rows_lse = out.index_select(0, query), lse.index_select(0, query)
    merge_in_place(rows, rows_lse, part_out.float(), part_lse)
    out.index_copy_(0, query, rows)
    lse.index_copy_(0, query, rows_lse)


def merge_in_place(out, lse, part_out, part_lse) -> None:
    """Merge a part (``part_out: [..., Dv]``, ``part_lse: [...]``) into the running fp32 ``out: [..., Dv]``
    and ``lse: [...]`` (views are written through) by log-sum-exp, in place."""
    merged = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - merged)[..., None])
    out.addcmul_(part_out, torch.exp(part_lse - merged)[..., None])
    lse.copy_(merged)


def merge_pairs(own_out, own_lse, query, pair_lse, pair_outs: list[torch.Tensor]):
    """Merge each query's own part (``[N, Dv]``, ``[N]``) with its past pairs (``query, pair_lse: [n]``)
    by log-sum-exp, accumulated per query; a pair of lse -inf adds nothing. The pairs' outputs come
    in consecutive parts, ``pair_outs[i]: [n_i, Dv]``. Overwrites fp32 ``own_out`` and ``pair_outs``
    (no temporaries of their size).

    Returns (out ``[N, Dv]`` fp32, lse ``[N]`` fp32).
    """
    top = own_lse.scatter_reduce(0, query, pair_lse, "amax")
    top = torch.where(torch.isfinite(top), top, 0.0)
    total = torch.exp(own_lse - top).index_add_(0, query, torch.exp(pair_lse - top.index_select(0, query)))
    lse = top + torch.log(total)
    out = own_out.float().mul_(torch.exp(own_lse - lse)[:, None])
    weights = torch.exp(pair_lse - lse.index_select(0, query)).split([len(part) for part in pair_outs])
    index_add_parts(out, query, [part.float().mul_(w[:, None]) for part, w in zip(pair_outs, weights, strict=True)])
    return out, lse


def index_add_parts(out: torch.Tensor, index: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """``out.index_add_(0, index, cat(parts))`` without the cat: ``parts`` hold consecutive runs of
    ``index``'s rows (any leading shape, rows of ``out.shape[-1]``)."""
    rows = [part.reshape(-1, out.shape[-1]) for part in parts]
    for part, part_index in zip(rows, index.split([len(r) for r in rows]), strict=True):
        out.index_add_(0, part_index, part)


def merge_two(a, b):
    """Two parts ``(out, lse)`` of one softmax, merged by log-sum-exp."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a.float() * torch.exp(lse_a - lse)[..., None] + out_b.float() * torch.exp(lse_b - lse)[..., None]
    return out.to(out_a.dtype), lse
