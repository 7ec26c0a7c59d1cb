"""What the gate scores: chunk means of the keys and the query rows that score against them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexmoba.layout import ChunkLayout

__all__ = ["chunk_means", "fp32_matmul", "gate_rows", "tile_mean_queries", "window_means"]


def chunk_means(k: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``k: [B, H_kv, S, D]`` -> ``[B, H_kv, n_global_chunks, D]`` fp32 mean of each chunk.

    The mean is rounded to k's dtype before use, as the official implementation pools keys
    in their own dtype and only then casts to fp32.
    """
    B, H_kv, S, D = k.shape
    if not layout.has_documents:  # chunks are fixed windows: a reshape instead of scatters
        return window_means(k, layout.chunk_size).to(k.dtype).float()
    index = layout.global_chunk[:, None, :].expand(B, H_kv, S)
    sums = k.new_zeros(B, H_kv, layout.n_global_chunks, D, dtype=torch.float32)
    sums.scatter_add_(2, index[..., None].expand(B, H_kv, S, D), k.float())
    counts = torch.zeros(B, layout.n_global_chunks, device=k.device, dtype=torch.float32)
    counts.scatter_add_(1, layout.global_chunk, torch.ones_like(counts[:, :1]).expand(B, S))
    return (sums / counts[:, None, :, None]).to(k.dtype).float()


def window_means(x: torch.Tensor, window: int) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B, H, ceil(S / window), D]`` fp32 means of consecutive windows."""
    B, H, S, D = x.shape
    n = -(-S // window)
    x = x.float() if n * window == S else F.pad(x.float(), (0, 0, 0, n * window - S))
    sums = x.view(B, H, n, window, D).sum(3)
    counts = torch.full((n, 1), float(window), device=x.device)
    counts[-1] = S - (n - 1) * window
    return sums / counts


def tile_mean_queries(q: torch.Tensor, layout: ChunkLayout, tile: int) -> torch.Tensor:
    """``q: [B, H, S, D]`` -> ``[B, H, S, D]`` fp32, each query replaced by its tile's mean.

    Tiles start at each document start (used with documents; without, see :func:`gate_rows`).
    """
    B, H, S, D = q.shape
    positions = torch.arange(S, device=q.device)
    tile_id = torch.cumsum((positions - layout.doc_start) % tile == 0, dim=1) - 1  # [B, S]
    index = tile_id[:, None, :, None].expand(B, H, S, D)
    sums = torch.zeros(B, H, S, D, device=q.device, dtype=torch.float32).scatter_add_(2, index, q.float())
    counts = torch.zeros(B, S, device=q.device, dtype=torch.float32)
    counts.scatter_add_(1, tile_id, torch.ones_like(counts))
    return sums.gather(2, index) / counts.gather(1, tile_id)[:, None, :, None]


def gate_rows(q: torch.Tensor, layout: ChunkLayout, granularity) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The queries the gate scores: ``(rows [B, H, R, D], own chunk [B, R], positions per row)``.

    One row per token (q itself, in its dtype: the selection scores it in fp32 a group of rows at a
    time, so a bf16 q never has a whole fp32 copy), except for tiles: one fp32 row per tile (its mean
    query; with documents, every query replaced by its tile's mean), whose selection every query of the
    tile then shares.
    """
    if granularity == "token":
        return q, layout.local_chunk, 1
    if layout.has_documents:
        return tile_mean_queries(q, layout, granularity), layout.local_chunk, 1
    rows = window_means(q, granularity)
    own = layout.local_chunk[:, ::granularity]  # a tile never straddles a chunk
    return rows, own, granularity


def fp32_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` of fp32 tensors in fp32 under autocast too (which would run it in bf16), into ``out``
    when given."""
    device = a.device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return torch.matmul(a, b, out=out)
    with torch.autocast(device, enabled=False):
        return torch.matmul(a, b, out=out)
