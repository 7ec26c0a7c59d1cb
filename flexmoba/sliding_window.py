"""Sliding-window causal attention: the query at position t attends the keys at s with ``t - W < s <= t``.

A window of ``W`` holds the query's own key and the ``W - 1`` before it, transformers'
convention (``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``, on top of the causal
mask), so Gemma's and Mistral's local layers. A dense ``[S, S]`` mask is quadratic in S; here the
queries go in blocks of ``block_size``, each an SDPA call over the keys its windows span (and a
masked ``[block, span]`` tile), so memory and work are linear in S.

Queries may sit anywhere in the keys (``query_start``): the whole sequence (training, prefill),
the newest positions of a KV cache (decode), or one rank's slice under context parallelism.

Shapes: ``q: [B, H, S, D]`` at positions ``query_start .. query_start + S - 1`` of
``k, v: [B, H_kv, T, D]`` (positions ``0 .. T - 1``), ``H % H_kv == 0``; query head ``h`` reads
key/value head ``h // (H / H_kv)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexmoba import validation
from flexmoba.context_parallel import ContextParallel, gather_sequence

__all__ = ["context_parallel_sliding_window_attention", "keys_attended_sliding", "sliding_window_attention",
           "sliding_window_mask"]


QUERY_BLOCK = 512
# Key slices start at multiples of this, so that the fused kernel's key tiles (512 keys in PyTorch's CPU
# flash kernel) fall where they fall in one dense masked call over the whole sequence, transformers' call:
# the same partial sums, the same rounding. Any other start is as exact, but Gemma-3-270M's 18 layers
# amplify the last-bit differences to 2e-4 in the logits.
KEY_ALIGNMENT = 512


def sliding_window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """``[..., S, T]`` bool: key position ``s`` is in the window of query position ``t`` (``t - W < s <= t``),
    for ``query_positions: [..., S]`` and ``key_positions: [..., T]``."""
    distance = query_positions[..., :, None] - key_positions[..., None, :]
    return (distance >= 0) & (distance < window)


def keys_attended_sliding(seq_len: int, window: int) -> int:
    """Query-key pairs of sliding-window causal attention over one sequence: ``sum_t min(t + 1, W)``."""
    validation.check_positive_int(window, "window")
    if seq_len <= window:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def key_span(first_query: int, end_query: int, window: int) -> tuple[int, int]:
    """``[start, stop)`` of the keys the queries at ``[first_query, end_query)`` attend, ``start`` rounded
    down to a multiple of :data:`KEY_ALIGNMENT`."""
    start = max(first_query - window + 1, 0)
    return start - start % KEY_ALIGNMENT, end_query


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *,
                             scale: float | None = None, query_start: int = 0,
                             block_size: int = QUERY_BLOCK) -> torch.Tensor:
    """Sliding-window causal attention of ``q: [B, H, S, D]`` over ``k, v: [B, H_kv, T, D]`` -> ``[B, H, S, Dv]``.

    Args:
        window: keys each query attends, its own included (``W``).
        scale: softmax scale, default ``D ** -0.5``.
        query_start: the position of ``q[:, :, 0]`` among the keys (``query_start + S <= T``).
        block_size: queries per SDPA call; each call reads at most ``block_size + W - 1 + KEY_ALIGNMENT - 1``
            keys, so memory is linear in S.
    """
    validation.check_local_queries(q, k, v, query_start)
    window = validation.check_positive_int(window, "window")
    block_size = validation.check_positive_int(block_size, "block_size")
    S, gqa = q.shape[2], q.shape[1] != k.shape[1]
    out = []
    for first in range(0, S, block_size):
        end = min(first + block_size, S)
        start, stop = key_span(query_start + first, query_start + end, window)
        positions = torch.arange(start, stop, device=q.device)
        allowed = sliding_window_mask(positions[query_start + first - start: query_start + end - start], positions,
                                      window)
        out.append(F.scaled_dot_product_attention(q[:, :, first:end], k[:, :, start:stop], v[:, :, start:stop],
                                                  attn_mask=allowed, scale=scale, enable_gqa=gqa))
    return torch.cat(out, dim=2)


def context_parallel_sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                                              window: int, *, scale: float | None = None) -> torch.Tensor:
    """Sliding-window attention of this rank's slice ``q: [B, H, S / n, D]``, ``k, v: [B, H_kv, S / n, D]``
    of a sequence split over ``cp``: keys and values are all-gathered, their gradients reduce-scattered
    back, as for full attention (:func:`flexmoba.context_parallel.context_parallel_full_attention`)."""
    query_start, _ = cp.local_range(q.shape[2] * cp.size)
    k_all, v_all = gather_sequence(k, cp), gather_sequence(v, cp)
    return sliding_window_attention(q, k_all, v_all, window, scale=scale, query_start=query_start)
