"""The MoBA attention predicate, in its two forms.

Query t attends key s iff they share a document, ``s <= t``, and t selected the chunk
holding s. :func:`moba_mask_mod` states it for FlexAttention (one element at a time);
:func:`dense_moba_mask` materialises it as ``[B, H, S, S]`` for SDPA and the reference.
"""

from __future__ import annotations

import torch

from flexmoba.gate import Selection

__all__ = ["dense_moba_mask", "moba_mask_mod"]


def moba_mask_mod(selection: Selection):
    """FlexAttention ``mask_mod`` that encodes the whole selection.

    It is exact on its own (eager flex applies only the mask_mod); the block tables only
    accelerate it. Every mask it returns shares one code object and captures tensors of
    fixed shapes, so a new mask of an unchanged shape does not recompile.
    """
    chunks = selection.chunks
    doc_start = selection.layout.doc_start
    local_chunk = selection.layout.local_chunk

    def mask_mod(b, h, q_idx, kv_idx):
        causal = kv_idx <= q_idx
        same_document = doc_start[b, q_idx] == doc_start[b, kv_idx]
        return causal & same_document & chunks[b, h, q_idx, local_chunk[b, kv_idx]]

    return mask_mod


def dense_moba_mask(selection: Selection) -> torch.Tensor:
    """``[B, H, S, S]`` bool: the same predicate as :func:`moba_mask_mod`, materialised."""
    B, H, S, _ = selection.chunks.shape
    layout = selection.layout
    positions = torch.arange(S, device=selection.chunks.device)
    causal = positions[None, :] <= positions[:, None]  # [S(q), S(kv)]
    same_document = layout.doc_start[:, :, None] == layout.doc_start[:, None, :]  # [B, S, S]
    key_chunk = layout.local_chunk[:, None, None, :].expand(B, H, S, S)
    return selection.chunks.gather(-1, key_chunk) & (causal & same_document)[:, None]
