"""``"sdpa"``: the mask made dense for SDPA, ``[B, H, S, query_start + S]``: differentiable everywhere,
O(S^2) memory; the fastest for short sequences. Decodes with one ``[S_new, T]`` mask
(:func:`flexmoba.backends.sdpa.decode.sdpa_decode`), the choice for chunked prefill."""

from __future__ import annotations

import torch

from flexmoba.backends.registry import Backend
from flexmoba.backends.sdpa.decode import sdpa_decode
from flexmoba.dense import masked_attention
from flexmoba.gate import Selection
from flexmoba.masks import dense_moba_mask, dense_moba_rows

__all__ = ["BACKENDS", "attend", "local_dense_mask"]


def local_dense_mask(selection: Selection, query_start: int, key_len: int) -> torch.Tensor:
    """``[B, H, S, key_len]`` bool: the keys each query at ``t = query_start + i`` attends."""
    positions = query_start + torch.arange(selection.past_chunks.shape[2], device=selection.past_chunks.device)
    return dense_moba_rows(selection, positions, key_len)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Selection, scale: float, *,
           query_start: int = 0) -> torch.Tensor:
    """``q: [B, H, S, D]`` at ``[query_start, query_start + S)``, ``k, v: [B, H_kv, query_start + S, D]``
    -> ``[B, H, S, Dv]``."""
    mask = dense_moba_mask(selection) if query_start == 0 else local_dense_mask(selection, query_start, k.shape[2])
    return masked_attention(q, k, v, mask, scale)


BACKENDS = {"sdpa": Backend(attend, decode=sdpa_decode)}
