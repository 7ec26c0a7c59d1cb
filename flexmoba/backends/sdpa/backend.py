"""``"sdpa"``: the mask made dense for SDPA, ``[B, H, S, query_start + S]``: differentiable everywhere,
O(S^2) memory; the fastest for short sequences. Decodes with one ``[S_new, T]`` mask
(:func:`flexmoba.backends.sdpa.decode.sdpa_decode`), the choice for chunked prefill."""

from __future__ import annotations

import torch

from flexmoba.backends.registry import Backend
from flexmoba.backends.sdpa.decode import sdpa_decode
from flexmoba.dense import masked_attention
from flexmoba.gate import Selection
from flexmoba.masks import dense_moba_mask, local_moba_mask

__all__ = ["BACKENDS", "attend"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Selection, scale: float, *,
           query_start: int = 0) -> torch.Tensor:
    """``q: [B, H, S, D]`` at ``[query_start, query_start + S)``, ``k, v: [B, H_kv, query_start + S, D]``
    -> ``[B, H, S, Dv]``."""
    mask = dense_moba_mask(selection) if query_start == 0 else local_moba_mask(selection, query_start, k.shape[2])
    return masked_attention(q, k, v, mask, scale)


BACKENDS = {"sdpa": Backend(attend, decode=sdpa_decode)}
