"""The ``sdpa`` backend's decode: the selection as one ``[B, H, S_new, T]`` mask for SDPA (chunked prefill,
many queries at once)."""

from __future__ import annotations

import torch

from flexmoba.backends.protocol import DecodeStep
from flexmoba.dense import masked_attention, zero_padding
from flexmoba.masks import decode_moba_mask

__all__ = ["sdpa_decode"]


def sdpa_decode(step: DecodeStep) -> torch.Tensor:
    """``"sdpa"``'s decode: the selection as one ``[B, H, S_new, T]`` mask for SDPA (chunked prefill)."""
    keys, values = step.keys, step.values
    if step.sums.padded:
        keys, values = zero_padding(keys, values, step.sums.start)
    return masked_attention(step.q, keys, values, decode_moba_mask(step), step.scale)
