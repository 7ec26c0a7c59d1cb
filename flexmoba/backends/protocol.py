"""The backend protocol's types: what a backend's ``attend`` and ``decode`` take and return.

    attend(q, k, v, selection, scale, *, query_start=0) -> out     (:data:`AttendFn`)
    decode(step) -> out                                             (:data:`DecodeFn`, :class:`DecodeStep`)

The protocol in words: :mod:`flexmoba.backends`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flexmoba.kv_cache import ChunkKeySums

__all__ = ["AttendFn", "DecodeFn", "DecodeStep", "query_places"]

AttendFn = Callable[..., torch.Tensor]  # (q, k, v, selection, scale, *, query_start=0) -> out


@dataclass(frozen=True)
class DecodeStep:
    """One gated decode call, what a backend's ``decode(step) -> [B, H, S_new, Dv]`` receives.

    Query i (row b, head h) attends every key of the chunks ``past[b, h, i]`` where ``valid``
    holds, and its own chunk ``own[b, i]`` up to itself. Chunk j of row b covers positions
    ``sums.start[b] + j * sums.chunk_size`` onwards; nothing before ``start`` is attended,
    and a padding query (``q_local < 0``) attends only its own position.

    Attributes:
        q: ``[B, H, S_new, D]`` new queries, at the last ``S_new`` positions of the keys.
        keys, values: ``[B, H_kv, T, D]`` all cached keys and values, ``H % H_kv == 0``
            (query head h reads KV head ``h // (H / H_kv)``).
        sums: the chunk state of those keys (:class:`flexmoba.kv_cache.ChunkKeySums`:
            ``chunk_size``, ``start: [B]``, ``padded``, transposed key blocks on demand).
        scale: softmax scale.
        past, valid: ``[B, H, S_new, P]`` the selected past chunks, ``P = min(top_k - 1, N - 1)``
            for ``N`` chunks, and which slots are used (an unused slot's index is arbitrary).

    The queries' places, computed on first use (decoding's one-query kernel needs none):
    ``q_pos: [S_new]`` absolute position ``T - S_new + i``, ``q_local: [B, S_new]`` position
    from the row's ``start`` (< 0: padding), ``own: [B, S_new]`` own chunk (0 for padding).
    """

    q: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    sums: ChunkKeySums
    scale: float
    past: torch.Tensor
    valid: torch.Tensor

    @functools.cached_property
    def _places(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return query_places(self.q.shape[2], self.keys.shape[2], self.sums)

    @property
    def q_pos(self) -> torch.Tensor:
        return self._places[0]

    @property
    def q_local(self) -> torch.Tensor:
        return self._places[1]

    @property
    def own(self) -> torch.Tensor:
        return self._places[2]


DecodeFn = Callable[[DecodeStep], torch.Tensor]


def query_places(S_new: int, T: int, sums: ChunkKeySums) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_pos [S_new], q_local [B, S_new], own [B, S_new])`` of the last ``S_new`` of ``T`` positions."""
    q_pos = T - S_new + torch.arange(S_new, device=sums.start.device)
    q_local = q_pos[None, :] - sums.start[:, None]
    return q_pos, q_local, q_local.clamp(min=0) // sums.chunk_size
