"""``"sdpa"``: the mask made dense for SDPA, ``[B, H, S, query_start + S]``: differentiable everywhere,
O(S^2) memory; the fastest for short sequences. Decodes with one ``[S_new, T]`` mask
(:func:`flexmoba.decode_kernels.sdpa_decode`), the choice for chunked prefill."""

from __future__ import annotations

import torch

from flexmoba.backends.registry import Backend
from flexmoba.decode_kernels import masked_attention, sdpa_decode
from flexmoba.gate import Selection
from flexmoba.masks import dense_moba_mask

__all__ = ["BACKENDS", "attend", "local_dense_mask"]


def local_dense_mask(selection: Selection, query_start: int, key_len: int) -> torch.Tensor:
    """``[B, H, S, key_len]`` bool: key s is attended by the query at ``t = query_start + i`` iff it
    lies in t's document up to t and in a chunk t selected."""
    layout = selection.layout
    B, H, S, n_chunks = selection.chunks.shape
    t = query_start + torch.arange(S, device=layout.doc_start.device)
    s = torch.arange(key_len, device=t.device)
    offset = s[None, None, :] - layout.doc_start[:, :, None]  # [B, S, T] from the query's document start
    visible = (offset >= 0) & (s[None, None, :] <= t[None, :, None])
    chunk = (offset.clamp(min=0) // layout.chunk_size).clamp(max=n_chunks - 1)
    selected = selection.chunks.gather(-1, chunk[:, None].expand(B, H, S, key_len))
    return selected & visible[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Selection, scale: float, *,
           query_start: int = 0) -> torch.Tensor:
    """``q: [B, H, S, D]`` at ``[query_start, query_start + S)``, ``k, v: [B, H_kv, query_start + S, D]``
    -> ``[B, H, S, Dv]``."""
    mask = dense_moba_mask(selection) if query_start == 0 else local_dense_mask(selection, query_start, k.shape[2])
    return masked_attention(q, k, v, mask, scale)


BACKENDS = {"sdpa": Backend(attend, decode=sdpa_decode)}
