"""Dense-mask MoBA: the plain math, for checking every faster path against."""

from __future__ import annotations

import torch

from flexmoba import validation
from flexmoba.gate import select_chunks
from flexmoba.masks import dense_moba_mask
from flexmoba.spec import MobaSpec, takes_settings

__all__ = ["moba_reference"]


@takes_settings
def moba_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: MobaSpec,
    *,
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """MoBA as ``softmax(q k^T * scale + mask) v`` in fp32; differentiable, any device.

    ``q: [B, H, S, D]``, ``k, v: [B, H_kv, S, D]`` -> ``[B, H, S, D]`` in q's dtype; MoBA's
    settings as ``spec`` or keywords (see :func:`flexmoba.select_chunks`).
    """
    validation.check_qkv(q, k, v)
    scale = validation.softmax_scale(scale, q)
    selection = select_chunks(q, k, spec, document_ids=document_ids)
    mask = dense_moba_mask(selection)  # [B, H, S, S]
    group = q.shape[1] // k.shape[1]
    k32 = k.float().repeat_interleave(group, dim=1)
    v32 = v.float().repeat_interleave(group, dim=1)
    logits = (q.float() @ k32.transpose(-1, -2)) * scale
    probs = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs @ v32).to(q.dtype)
