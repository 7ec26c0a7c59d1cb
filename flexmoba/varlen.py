"""MoBA on the packed (flash-attn / official MoBA) layout."""

from __future__ import annotations

import torch

from flexmoba import validation
from flexmoba.attention import moba_attention
from flexmoba.spec import MobaSpec

__all__ = ["document_ids_from_cu_seqlens", "moba_attention_varlen"]


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """``[n_docs + 1]`` boundaries -> ``[T]`` document index of every token."""
    positions = torch.arange(total_tokens, device=cu_seqlens.device)
    return torch.bucketize(positions, cu_seqlens[1:].long(), right=True)


def moba_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    spec: MobaSpec | None = None,
    **kwargs,
) -> torch.Tensor:
    """MoBA over packed documents.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, H_kv, D]``: the documents laid end to end.
        cu_seqlens: ``[n_docs + 1]`` int boundaries, ``0 = c_0 < c_1 < ... < c_n = T``.
        spec: MoBA's settings, or give them in ``kwargs``.
        **kwargs: ``chunk_size``, ``top_k``, ``granularity``, ``backend``, ``scale`` of
            :func:`moba_attention`.

    Returns:
        ``[T, H, D]``.
    """
    if "document_ids" in kwargs:
        raise TypeError("document_ids is derived from cu_seqlens; do not pass both")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a [T, heads, head_dim] tensor, got {getattr(x, 'shape', type(x))}")
    validation.check_cu_seqlens(cu_seqlens, q.shape[0], q.device)
    document_ids = document_ids_from_cu_seqlens(cu_seqlens, q.shape[0])[None]

    def batched(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [1, H, T, D]
        return x.transpose(0, 1).unsqueeze(0).contiguous()

    out = moba_attention(
        batched(q), batched(k), batched(v),
        spec, document_ids=document_ids, **kwargs,
    )
    return out[0].transpose(0, 1)
