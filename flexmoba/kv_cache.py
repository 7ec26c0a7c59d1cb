"""The KV cache for MoBA decoding: keys, values and running per-chunk key state.

Chunk means come from running per-chunk key sums (:class:`ChunkKeySums`), so absorbing a
new key costs O(D) instead of re-pooling all ``T`` keys every step. On demand the sums also
keep each chunk's keys transposed, ``[D, chunk_size]``, the layout the ``"gather"``
backend's fp32 decode kernel reads (:mod:`flexmoba.backends.gather.decode`); it costs one extra copy
of the keys in memory.

A row may start with padding (left padding, as in batched generation): ``start[b]`` is
the first real position of row b; chunks are counted from there, and padding positions
never enter a sum or a block.

Shapes: keys, values ``[B, H_kv, T, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexmoba import validation

__all__ = ["ChunkKeySums", "MoBAKVCache"]


class ChunkKeySums:
    """Running per-chunk state of the keys: fp32 sums and rounded means for the gate and, on
    demand, the keys of each chunk transposed (for the ``"gather"`` backend's fp32 decode).

    Attributes:
        sums: ``[B, H_kv, N, D]`` fp32 key sums per chunk (``N`` grows by doubling).
        start: ``[B]`` first real position of each row; chunk j holds positions
            ``start + j * chunk_size ...``; positions before ``start`` are left out.
        padded: whether any row has left padding (read once, at construction).
        length: positions absorbed so far (padding included).
        last_key: ``[B, H_kv, D]`` the key at ``length - 1``, so a caller that keeps these
            sums beside someone else's cache can tell whether that cache changed under it.
        blocks: ``None`` or ``[B, H_kv, N, D, chunk_size]``: ``blocks[b, h, j, :, i]`` is the
            key at ``start[b] + j * chunk_size + i`` (zero where not yet written).
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, chunk_size: int, *,
                 start: torch.Tensor | None = None, device=None, key_dtype=torch.float32,
                 keep_blocks: bool = True):
        self.chunk_size = validation.check_positive_int(chunk_size, "chunk_size")
        self.start = validation.check_start(start, batch, device)
        self.start_list = self.start.tolist()  # one host read here, none per step
        self.padded = any(self.start_list)
        self.key_dtype = key_dtype
        self.keep_blocks = keep_blocks
        self.sums = torch.zeros(batch, kv_heads, 0, head_dim, device=device, dtype=torch.float32)
        self._means = torch.zeros_like(self.sums)
        self.blocks: torch.Tensor | None = None
        self.length = 0
        self.last_key: torch.Tensor | None = None

    @classmethod
    def from_keys(cls, keys: torch.Tensor, chunk_size: int, start: torch.Tensor | None = None,
                  keep_blocks: bool = True) -> ChunkKeySums:
        """Sums over ``keys: [B, H_kv, T, D]`` (positions 0 .. T-1)."""
        B, H_kv, _, D = keys.shape
        sums = cls(B, H_kv, D, chunk_size, start=start, device=keys.device, key_dtype=keys.dtype,
                   keep_blocks=keep_blocks)
        sums.update(keys)
        return sums

    def chunks_spanned(self, length: int) -> int:
        """Chunks spanned by ``length`` positions of the row whose real tokens start earliest (at least 1)."""
        return max(length - min(self.start_list) - 1, 0) // self.chunk_size + 1

    @property
    def n_chunks(self) -> int:
        """Chunks of the longest row so far (at least 1)."""
        return self.chunks_spanned(self.length)

    def _grow(self, n_chunks: int) -> None:
        have = self.sums.shape[2]
        if n_chunks <= have:
            return
        extra = max(n_chunks, 2 * have) - have
        self.sums = F.pad(self.sums, (0, 0, 0, extra))
        self._means = F.pad(self._means, (0, 0, 0, extra))
        if self.blocks is not None:
            self.blocks = F.pad(self.blocks, (0, 0, 0, 0, 0, extra))

    def _spans(self, first: int, end: int):
        """Per row and chunk, the real positions among ``first .. end - 1``: tuples
        ``(b, chunk, offset in chunk, count, offset in first .. end - 1)``. Host ints only."""
        c = self.chunk_size
        for b, start in enumerate(self.start_list):
            lo, hi = max(first - start, 0), end - start  # local positions
            for j in range(lo // c, (hi - 1) // c + 1 if hi > lo else 0):
                a, e = max(lo, j * c), min(hi, (j + 1) * c)
                yield b, j, a - j * c, e - a, start + a - first

    def update(self, k_new: torch.Tensor) -> None:
        """Absorb ``k_new: [B, H_kv, S_new, D]``, the keys of positions ``length .. length + S_new - 1``.

        Padding positions are skipped, never multiplied by 0: a non-finite one cannot leak.
        """
        S_new = k_new.shape[2]
        if S_new == 0:
            return
        end = self.length + S_new
        self._grow(self.chunks_spanned(end))
        if S_new == 1 and not self.padded:  # decoding's step: one key, in the same chunk of every row
            self._absorb_one(k_new[:, :, 0])
            return
        for b, j, offset, n, src in self._spans(self.length, end):
            piece = k_new[b, :, src: src + n]  # [H_kv, n, D]
            total = self.sums[b, :, j]
            total += piece.sum(1, dtype=torch.float32)
            # The chunk holds offset + n keys now: all positions before these are real.
            self._means[b, :, j] = (total / (offset + n)).to(self.key_dtype)
            if self.blocks is not None:
                self.blocks[b, :, j, :, offset: offset + n] = piece.transpose(-1, -2)
        self.length = end
        self.last_key = k_new[:, :, -1].detach().clone()

    def _absorb_one(self, key: torch.Tensor) -> None:
        """:meth:`update` with the key ``[B, H_kv, D]`` of position ``length`` in rows without padding."""
        j, offset = divmod(self.length, self.chunk_size)
        total = self.sums[:, :, j]
        total += key
        self._means[:, :, j] = (total / (offset + 1)).to(self.key_dtype)
        if self.blocks is not None:
            self.blocks[:, :, j, :, offset] = key
        self.length += 1
        self.last_key = key.detach().clone()

    def means(self) -> torch.Tensor:
        """``[B, H_kv, n_chunks, D]`` fp32 chunk means, rounded through the key dtype like
        :func:`flexmoba.gate.chunk_means` (the official gate pools keys in their dtype)."""
        return self._means[:, :, : self.n_chunks]

    def key_blocks(self, keys: torch.Tensor) -> torch.Tensor:
        """``blocks``, built from ``keys: [B, H_kv, T, D]`` (the keys these sums hold) on first use."""
        if self.blocks is None:
            B, H_kv, _, D = keys.shape
            self.blocks = keys.new_zeros(B, H_kv, self.sums.shape[2], D, self.chunk_size)
            for b, j, offset, n, src in self._spans(0, self.length):
                self.blocks[b, :, j, :, offset: offset + n] = keys[b, :, src: src + n].transpose(-1, -2)
        return self.blocks


class MoBAKVCache:
    """One layer's KV cache for MoBA decoding: keys, values and running chunk state.

    Buffers grow by doubling, so appending a token is amortised O(H_kv * D). The chunk
    state (:attr:`sums`) catches up with the keys only when MoBA needs it, so a context that
    still fits in ``chunk_size * top_k`` (dense attention) pays nothing for it.

    With ``dense_decode`` every query attending this cache gets full causal attention (the
    paper's protocol for generated tokens), unless the call says otherwise.

    Usage, per layer (``spec``'s chunk size is the cache's) and step::

        spec = MobaSpec(chunk_size=64, top_k=3)
        cache = MoBAKVCache(spec.chunk_size)
        keys, values = cache.update(k_new, v_new)       # [B, H_kv, T, D]
        out = moba_decode_attention(q_new, cache, spec)  # [B, H, S_new, D]; or top_k=3
    """

    def __init__(self, chunk_size: int, start: torch.Tensor | None = None, *, dense_decode: bool = False):
        self.chunk_size = validation.check_positive_int(chunk_size, "chunk_size")
        self.dense_decode = validation.check_bool(dense_decode, "dense_decode")
        self._start = start
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._sums: ChunkKeySums | None = None
        self.length = 0

    @property
    def keys(self) -> torch.Tensor:
        """``[B, H_kv, T, D]`` cached keys (a view of the buffer)."""
        return self._keys[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, :, : self.length]

    @property
    def sums(self) -> ChunkKeySums:
        """The chunk state, brought up to all cached keys."""
        self._sums.update(self.keys[:, :, self._sums.length:])
        return self._sums

    @property
    def chunk_state(self) -> ChunkKeySums:
        """The chunk state as absorbed so far: it may lag behind the keys (:attr:`sums` brings it up)."""
        return self._sums

    @property
    def n_chunks(self) -> int:
        """Chunks of the longest row, without bringing the chunk state up to date."""
        return self._sums.chunks_spanned(self.length)

    @property
    def start(self) -> torch.Tensor | None:
        """``[B]`` first real position of each row, or ``None`` when no row is padded."""
        return self._sums.start if self._sums.padded else None

    def _reserve(self, new_length: int) -> None:
        capacity = self._keys.shape[2]
        if new_length > capacity:
            extra = max(new_length, 2 * capacity) - capacity
            self._keys = F.pad(self._keys, (0, 0, 0, extra))
            self._values = F.pad(self._values, (0, 0, 0, extra))

    def _allocate(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Empty buffers and chunk state shaped like ``k_new, v_new: [B, H_kv, S_new, D]``."""
        B, H_kv, _, D = k_new.shape
        self._keys = k_new.new_zeros(B, H_kv, 0, D)
        self._values = v_new.new_zeros(B, H_kv, 0, v_new.shape[-1])
        self._sums = ChunkKeySums(B, H_kv, D, self.chunk_size, start=self._start,
                                  device=k_new.device, key_dtype=k_new.dtype)

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k_new, v_new: [B, H_kv, S_new, D]``; return all keys and values ``[B, H_kv, T, D]``."""
        validation.check_cache_update(k_new, v_new, None if self._keys is None else self.keys)
        if self._keys is None:
            self._allocate(k_new, v_new)
        S_new = k_new.shape[2]
        self._reserve(self.length + S_new)
        self._keys[:, :, self.length: self.length + S_new] = k_new
        self._values[:, :, self.length: self.length + S_new] = v_new
        self.length += S_new
        return self.keys, self.values
