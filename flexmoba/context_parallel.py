"""Context parallelism: MoBA and full attention over sequences split across processes.

Each rank of a context-parallel group of ``n`` holds one contiguous slice of every sequence,
positions ``[r S / n, (r + 1) S / n)``: its queries, keys and values. Keys and values are
all-gathered along the sequence (``torch.distributed.nn.functional.all_gather``: its backward
reduce-scatters their gradients); queries stay local and keep their global positions, so RoPE,
chunks, document starts and the causal rule are the global ones.

The core needs no process group. Local queries at ``query_start`` are gated against the
chunk means of all keys (:func:`flexmoba.gate.select_local_chunks`), and attend keys
``[0, query_start + S_local)`` (later keys are in the future of every local query) through the
backend protocol's ``query_start`` (:mod:`flexmoba.backends`): every backend that takes it, a
registered one included, runs here; one that declared it cannot is refused by name.

Full attention: local queries over keys ``[0, query_start)`` (no mask) and the local keys
(causal), merged by log-sum-exp; with documents or off CPU through a mask.

A MoBA query attends at most ``top_k`` chunks wherever it sits, so a contiguous split is
balanced except for the first ``top_k - 1`` chunks (see :func:`attended_pairs_per_rank`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from flexmoba import validation
from flexmoba.backends import get_context_parallel_backend, resolve_context_parallel_backend
from flexmoba.backends.checked import checked_attend
from flexmoba.backends.flex.compiled import active_flex_attention, custom_flex_attention
from flexmoba.dense import dense_attention, dense_attention_backward
from flexmoba.gate import select_local_chunks
from flexmoba.layout import document_starts
from flexmoba.lse_merge import merge_two
from flexmoba.masks import causal_document_rows
from flexmoba.pair_counts import selection_pairs
from flexmoba.spec import MobaSpec, takes_settings

__all__ = [
    "ContextParallel",
    "attended_pairs_per_rank",
    "context_parallel_attention",
    "context_parallel_full_attention",
    "gather_sequence",
    "local_causal_attention",
    "local_moba_attention",
    "sequence_slice",
    "shard_sequence",
]

# -- the group and its slices -----------------------------------------------------------


def sequence_slice(seq_len: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, stop)`` of the positions rank ``rank`` of ``size`` holds of a ``seq_len`` sequence."""
    seq_len = validation.check_positive_int(seq_len, "seq_len")
    size = validation.check_positive_int(size, "context_parallel_size")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, context_parallel_size={size}), got {rank}")
    if seq_len % size:
        raise ValueError(f"seq_len={seq_len} must be divisible by context_parallel_size={size} "
                         "(each rank holds seq_len / context_parallel_size positions)")
    local = seq_len // size
    return rank * local, (rank + 1) * local


@dataclass(frozen=True)
class ContextParallel:
    """A context-parallel group: ``size`` ranks, this process's ``rank`` in it, and the
    ``torch.distributed`` process group (``None``: the default group)."""

    rank: int
    size: int
    group: object | None = None

    @classmethod
    def of(cls, group=None) -> ContextParallel:
        """The group ``group`` (default: the whole world) as seen by this process."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def local_range(self, seq_len: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's positions of a ``seq_len`` sequence."""
        return sequence_slice(seq_len, self.rank, self.size)


def shard_sequence(x: torch.Tensor, cp: ContextParallel, dim: int = 2) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (``2`` for ``[B, H, S, D]``, ``1`` for ``[B, S]``)."""
    start, stop = cp.local_range(x.shape[dim])
    return x.narrow(dim, start, stop - start)


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` forward; reduce-scatter (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim: int, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.dim, ctx.group = dim, group
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        parts = [part.contiguous() for part in grad.chunk(dist.get_world_size(ctx.group), ctx.dim)]
        mine = torch.empty_like(parts[0])
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            dist.reduce_scatter(mine, parts, group=ctx.group)
        else:  # gloo has no reduce-scatter: sum everywhere, keep this rank's slice
            total = torch.stack(parts)
            dist.all_reduce(total, group=ctx.group)
            mine = total[dist.get_rank(ctx.group)]
        return mine, None, None


def gather_sequence(x: torch.Tensor, cp: ContextParallel, dim: int = 2) -> torch.Tensor:
    """All ranks' slices of ``x`` joined along ``dim``: ``[B, H, S / n, D]`` -> ``[B, H, S, D]``.

    Differentiable: each slice's gradient is the sum over ranks of the joined tensor's gradient
    there (a reduce-scatter; on gloo, which has none, an all-reduce).
    """
    if cp.size == 1:
        return x
    return _GatherSequence.apply(x, dim, cp.group)


# -- MoBA for local queries ------------------------------------------------------------


def local_moba_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MobaSpec, query_start: int, *,
                         document_ids: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """MoBA of queries ``q: [B, H, S, D]`` at positions ``[query_start, query_start + S)`` over
    ``k, v: [B, H_kv, T, D]``, all positions of the sequence (``document_ids: [B, T]``), by any
    backend that takes queries at an offset (:mod:`flexmoba.backends`; ``auto``: ``flex`` off CPU,
    ``gather`` on CPU, exact at any length where the dense mask would be ``[S / n, S]``).

    Equals rows ``[query_start, query_start + S)`` of :func:`flexmoba.moba_attention` over the
    whole sequence, and so do the gradients (summed over the slices, for k and v).

    Returns:
        ``[B, H, S, Dv]`` in q's dtype.
    """
    validation.check_local_queries(q, k, v, query_start)
    scale = validation.softmax_scale(scale, q)
    name = resolve_context_parallel_backend(spec.backend, q)
    attend = checked_attend(name, get_context_parallel_backend(name))
    selection = select_local_chunks(q, k, spec, query_start, document_ids)
    end = query_start + q.shape[2]
    return attend(q, k[:, :, :end], v[:, :, :end], selection, scale, query_start=query_start)


# -- full attention for local queries ---------------------------------------------------


class _OffsetCausal(torch.autograd.Function):
    """Causal attention of ``q: [B, H, S, D]`` at ``[o, o + S)`` over ``k, v: [B, H_kv, o + S, D]``:
    keys ``[0, o)`` unmasked, the last S causal; two fused calls merged by log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, query_start: int, scale: float):
        parts = _offset_causal_parts(q, k, v, query_start)
        local = dense_attention(*parts["local"], True, scale)
        if query_start == 0:
            out, lse = local
        else:
            out, lse = merge_two(local, _from_groups(dense_attention(*parts["past"], False, scale), q.shape))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.query_start, ctx.scale = query_start, scale
        return out.reshape(q.shape[:3] + v.shape[-1:])

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        B, H, S, D = q.shape
        H_kv, Dv = k.shape[1], v.shape[-1]
        G, o = H // H_kv, ctx.query_start
        parts = _offset_causal_parts(q, k, v, o)
        grad = grad_out.contiguous().view(B * H, 1, S, Dv)
        dq, dk, dv = dense_attention_backward(grad, *parts["local"], out, lse, True, ctx.scale)
        dk = dk.view(B, H_kv, G, S, D).sum(2)
        dv = dv.view(B, H_kv, G, S, Dv).sum(2)
        if o > 0:
            as_groups = lambda x: x.reshape(B * H_kv, 1, G * S, x.shape[-1])  # noqa: E731
            dq_p, dk_p, dv_p = dense_attention_backward(
                as_groups(grad), *parts["past"], as_groups(out), lse.reshape(B * H_kv, 1, G * S), False, ctx.scale)
            dq = dq + dq_p.view_as(dq)
            dk = torch.cat([dk_p.view(B, H_kv, o, D), dk], 2)
            dv = torch.cat([dv_p.view(B, H_kv, o, Dv), dv], 2)
        return dq.view(B, H, S, D), dk, dv, None, None


def _offset_causal_parts(q, k, v, query_start: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """``local``: ``(q, k, v)`` as ``[B * H, 1, S, D]`` (kv heads repeated); ``past``: q as
    ``[B * H_kv, 1, G * S, D]`` (a KV group's heads share one call), keys ``[B * H_kv, 1, o, D]``."""
    B, H, S, D = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    o = query_start
    local_keys = [x[:, :, o:].repeat_interleave(G, 1).reshape(B * H, 1, S, x.shape[-1]) for x in (k, v)]
    parts = {"local": (q.reshape(B * H, 1, S, D), *local_keys)}
    if o > 0:
        parts["past"] = (q.reshape(B * H_kv, 1, G * S, D),
                         *(x[:, :, :o].reshape(B * H_kv, 1, o, x.shape[-1]) for x in (k, v)))
    return parts


def _from_groups(part, q_shape):
    """A KV-group call's ``(out [B * H_kv, 1, G * S, Dv], lse)`` as ``[B * H, 1, S, *]``."""
    out, lse = part
    B, H, S, _ = q_shape
    return out.reshape(B * H, 1, S, out.shape[-1]), lse.reshape(B * H, 1, S)


def local_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: int, *,
                           document_ids: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Full causal attention of ``q: [B, H, S, D]`` at ``[query_start, query_start + S)`` over
    ``k, v: [B, H_kv, T, D]`` (``document_ids: [B, T]``: nothing attends across documents).

    On CPU without documents, two fused calls (O(S) memory); otherwise a dense
    ``[S, query_start + S]`` mask, through flex off CPU.
    """
    validation.check_local_queries(q, k, v, query_start)
    scale = validation.softmax_scale(scale, q)
    end = query_start + q.shape[2]
    k_full, k, v = k, k[:, :, :end], v[:, :, :end]
    fused = q.device.type == "cpu" and custom_flex_attention() is None
    if document_ids is None and fused:
        return _OffsetCausal.apply(q, k, v, query_start, scale)
    if document_ids is None:
        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + query_start

        block_mask = create_block_mask(causal, None, None, q.shape[2], end, device=q.device)
        return active_flex_attention()(q, k, v, block_mask=block_mask, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    validation.check_document_ids(document_ids, k_full)
    mask = causal_document_rows(query_start, q.shape[2], end, document_starts(document_ids)[:, query_start:end])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


# -- over a process group ---------------------------------------------------------------


@takes_settings
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                               spec: MobaSpec, *, document_ids: torch.Tensor | None = None,
                               scale: float | None = None) -> torch.Tensor:
    """MoBA of this rank's slice: ``q: [B, H, S / n, D]``, ``k, v: [B, H_kv, S / n, D]``
    -> ``[B, H, S / n, Dv]`` (MoBA's settings as ``spec`` or keywords, as in :func:`flexmoba.moba_attention`).

    ``document_ids``: ``[B, S]``, the whole sequence's (every rank passes the same).
    Keys and values are all-gathered over ``cp``'s group; their gradients reduce-scattered back.
    """
    query_start, _ = cp.local_range(q.shape[2] * cp.size)
    k_all, v_all = gather_sequence(k, cp), gather_sequence(v, cp)
    return local_moba_attention(q, k_all, v_all, spec, query_start, document_ids=document_ids, scale=scale)


def context_parallel_full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, *,
                                    document_ids: torch.Tensor | None = None,
                                    scale: float | None = None) -> torch.Tensor:
    """Full causal attention of this rank's slice (shapes and gathering as :func:`context_parallel_attention`)."""
    query_start, _ = cp.local_range(q.shape[2] * cp.size)
    k_all, v_all = gather_sequence(k, cp), gather_sequence(v, cp)
    return local_causal_attention(q, k_all, v_all, query_start, document_ids=document_ids, scale=scale)


# -- load balance ------------------------------------------------------------------------


def attended_pairs_per_rank(q: torch.Tensor, k: torch.Tensor, spec: MobaSpec, size: int,
                            document_ids: torch.Tensor | None = None) -> list[int]:
    """Work of each of ``size`` ranks (attended pairs, :func:`selection_pairs`) for MoBA of
    ``q: [B, H, S, D]`` over ``k``, each rank gating its contiguous slice of the queries."""
    S = q.shape[2]
    work = []
    for rank in range(size):
        start, stop = sequence_slice(S, rank, size)
        selection = select_local_chunks(q[:, :, start:stop], k, spec, start, document_ids)
        work.append(selection_pairs(selection, start))
    return work
