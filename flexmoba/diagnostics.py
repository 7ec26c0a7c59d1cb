"""Gate diagnostics: does MoBA's parameter-free router pick the chunks attention needs?

- *gate recall*: the share of full causal attention's probability mass that falls on the
  keys MoBA selected. 1.0 means MoBA loses nothing of what full attention would attend;
  it is 1.0 exactly when ``top_k`` covers every chunk.
- *selection distance*: how many chunks back each selected past chunk lies (1 = the chunk
  just before the query's own).
- *position hit*: whether a query selected the chunk holding a given key position (the
  needle of a retrieval task).
"""

from __future__ import annotations

import torch

from flexmoba import validation
from flexmoba.gate import Selection, select_chunks
from flexmoba.masks import dense_moba_mask
from flexmoba.spec import MobaSpec, takes_settings

__all__ = ["distance_histogram", "gate_recall", "selection_distances", "selection_recall", "selects_position"]


@torch.no_grad()
@takes_settings
def gate_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: MobaSpec,
    *,
    scale: float | None = None,
    query_block: int = 1024,
) -> torch.Tensor:
    """``[B, H, S]`` fraction of each query's full-attention probability on MoBA's keys.

    ``q: [B, H, S, D]``, ``k: [B, H_kv, S, D]``. Full attention is computed in blocks of
    ``query_block`` queries, so memory stays ``O(query_block · S)``. MoBA's settings as ``spec``
    or keywords (see :func:`flexmoba.select_chunks`).
    """
    return selection_recall(q, k, select_chunks(q, k, spec), scale=scale, query_block=query_block)


@torch.no_grad()
def selection_recall(q: torch.Tensor, k: torch.Tensor, selection: Selection, *, scale: float | None = None,
                     query_block: int = 1024) -> torch.Tensor:
    """:func:`gate_recall` of a selection already made (``q: [B, H, S, D]``, ``k: [B, H_kv, S, D]``)."""
    mask = dense_moba_mask(selection)  # [B, H, S, S]
    B, H, S, D = q.shape
    k = k.float().repeat_interleave(H // k.shape[1], dim=1)
    scale = validation.softmax_scale(scale, q)
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    recall = torch.empty(B, H, S, device=q.device)
    for start in range(0, S, query_block):
        rows = slice(start, min(start + query_block, S))
        logits = (q[:, :, rows].float() @ k.transpose(-1, -2)) * scale
        probs = logits.masked_fill(~causal[rows], float("-inf")).softmax(-1)
        recall[:, :, rows] = (probs * mask[:, :, rows]).sum(-1)
    return recall


def selection_distances(selection: Selection) -> torch.Tensor:
    """1-D tensor: ``own chunk - selected chunk`` for every selected past chunk (>= 1)."""
    own = selection.layout.local_chunk[:, None, :, None]
    distance = own - selection.past_chunks
    return distance[selection.past_valid]


def distance_histogram(selection: Selection) -> torch.Tensor:
    """``[n_chunks]`` counts of selection distances 0..n_chunks-1 (index 0 is always 0)."""
    return torch.bincount(selection_distances(selection), minlength=selection.layout.n_chunks)


def selects_position(selection: Selection, key_position: torch.Tensor) -> torch.Tensor:
    """``[B, H, S]`` bool: did each query select the chunk holding ``key_position[b]``?

    ``key_position: [B]`` absolute positions (in the query's document). Queries before
    the position are False.
    """
    layout = selection.layout
    b = torch.arange(len(key_position), device=key_position.device)
    key_chunk = layout.local_chunk[b, key_position]  # [B]
    same_document = layout.doc_start == layout.doc_start[b, key_position][:, None]  # [B, S]
    positions = torch.arange(layout.local_chunk.shape[1], device=key_position.device)
    index = key_chunk.view(-1, 1, 1, 1).expand(*selection.past_chunks.shape[:3], 1)
    hit = selection.chunks.gather(-1, index)[..., 0]
    after = positions[None, :] >= key_position[:, None]
    return hit & (after & same_document)[:, None]
