"""MoBA attention with a choice of backend.

- ``"flex"``: the selection as a sparse ``BlockMask`` fed to ``flex_attention``, compiled
  once per process. Trains on CUDA; on CPU it is inference only (no CPU backward).
- ``"sdpa"``: the same mask made dense ``[B, H, S, S]`` and fed to
  ``F.scaled_dot_product_attention``: differentiable on every device, O(S^2) memory.
- ``"gather"``: queries regrouped per selected chunk, dense attention per group, partial
  results merged by log-sum-exp (:mod:`flexmoba.gather`): exact, differentiable on every
  device, work and memory O(S · top_k · chunk_size).
- ``"auto"``: flex on CUDA; on CPU, gather once the sequence is long enough for sparsity to
  pay (``S > 2 · chunk_size · top_k``), else sdpa for training and flex for inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexmoba import _checks
from flexmoba.block_mask import selection_block_mask
from flexmoba.gather import gather_moba_attention
from flexmoba.masks import dense_moba_mask
from flexmoba.selection import _check_selection_args, select_chunks

_compiled_flex = None
# Each new shape compiles a new flex kernel; dynamo's default limit of 8 per function
# would otherwise drop to the unfused eager path after a few shapes.
FLEX_RECOMPILE_LIMIT = 64


def compiled_flex_attention():
    """The process-wide compiled ``flex_attention`` (compiled lazily, once).

    ``dynamic=False``: one kernel per shape. A dynamic kernel breaks on CPU once a second
    shape appears (torch 2.13), and training shapes are fixed anyway.
    """
    global _compiled_flex
    if _compiled_flex is None:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def resolve_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    chunk_size: int = 1, top_k: int = 1) -> str:
    """Pick the concrete backend; refuse flex where it cannot run."""
    backend = _checks.check_backend(backend)
    cpu_grad = q.device.type == "cpu" and needs_grad(q, k, v)
    if backend == "auto":
        if q.device.type != "cpu":
            return "flex"
        if q.shape[2] > 2 * chunk_size * top_k:
            return "gather"
        return "sdpa" if cpu_grad else "flex"
    if backend == "flex" and cpu_grad:
        raise ValueError(
            "backend='flex' cannot compute gradients on CPU (FlexAttention has no CPU backward); "
            "use backend='sdpa' or 'auto', or call under torch.no_grad()"
        )
    return backend


def flex_moba_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float | None = None
) -> torch.Tensor:
    """Compiled flex attention of ``q: [B, H, S, D]`` over ``k, v: [B, H_kv, S, D]``."""
    flex = compiled_flex_attention()
    return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int,
    top_k: int,
    granularity="token",
    backend: str = "auto",
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal MoBA attention.

    Args:
        q: ``[B, H, S, D]``; k, v: ``[B, H_kv, S, D]`` with ``H % H_kv == 0``.
        chunk_size: tokens per chunk; chunks restart at each document start.
        top_k: chunks per query, counting its own chunk.
        granularity: ``"token"`` (the paper) or an int tile size dividing ``chunk_size``.
        backend: ``"auto"``, ``"flex"``, ``"sdpa"`` or ``"gather"``.
        scale: softmax scale, default ``D ** -0.5``.
        document_ids: optional ``[B, S]`` ints; nothing attends across documents.

    Returns:
        ``[B, H, S, D]`` in q's dtype.
    """
    chunk_size, top_k, granularity = _check_selection_args(q, k, chunk_size, top_k, granularity, document_ids)
    _checks.check_qkv(q, k, v)
    scale = _checks.check_scale(scale)
    backend = resolve_backend(backend, q, k, v, chunk_size, top_k)
    selection = select_chunks(
        q, k, chunk_size=chunk_size, top_k=top_k, granularity=granularity, document_ids=document_ids
    )
    if backend == "flex":
        block_mask = selection_block_mask(selection, compute_q_blocks=needs_grad(q, k, v))
        return flex_moba_attention(q, k, v, block_mask, scale)
    if backend == "gather":
        return gather_moba_attention(q, k, v, selection, scale)
    mask = dense_moba_mask(selection)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
