"""The ``sdpa`` backend's decode: the selection as one ``[B, H, S_new, T]`` mask for SDPA (chunked prefill,
many queries at once)."""

from __future__ import annotations

import torch

from flexmoba.backends.protocol import DecodeStep
from flexmoba.dense import masked_attention, zero_padding

__all__ = ["sdpa_decode"]


def sdpa_decode(step: DecodeStep) -> torch.Tensor:
    """``"sdpa"``'s decode: the selection as one ``[B, H, S_new, T]`` mask for SDPA (chunked prefill)."""
    q, keys, values, q_pos, own, start = step.q, step.keys, step.values, step.q_pos, step.own, step.sums.start
    if step.sums.padded:
        keys, values = zero_padding(keys, values, start)
    B, H, S_new, _ = q.shape
    T = keys.shape[2]
    key_pos = torch.arange(T, device=q.device)
    key_local = key_pos[None, :] - start[:, None]  # [B, T]
    n_chunks = int(torch.cat([own.flatten(), step.past.flatten()]).max()) + 1  # unused slots may point past own
    selected = torch.zeros(B, H, S_new, n_chunks, dtype=torch.bool, device=q.device)
    selected.scatter_(-1, step.past, step.valid)
    selected.scatter_(-1, own[:, None, :, None].expand(B, H, S_new, 1), True)
    key_chunk = (key_local.clamp(min=0) // step.sums.chunk_size).clamp(max=selected.shape[-1] - 1)
    allowed = selected.gather(-1, key_chunk[:, None, None, :].expand(B, H, S_new, T))
    allowed &= ((key_local >= 0)[:, None, :] & (key_pos[None, :] <= q_pos[:, None]))[:, None]
    q_pad = (step.q_local < 0)[:, None, :, None]  # [B, 1, S_new, 1]
    return masked_attention(q, keys, values, torch.where(q_pad, key_pos == q_pos[:, None], allowed), step.scale)
