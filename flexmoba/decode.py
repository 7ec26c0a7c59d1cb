"""MoBA decoding with a KV cache.

New queries sit at the END of the cached keys: with ``T`` cached positions (new keys
included) and ``S_new`` queries, query i is at absolute position ``T - S_new + i``. Each
query gates against the means of the complete chunks before its own chunk, keeps the
``top_k - 1`` best, and attends those chunks plus its own chunk up to itself: the rows of
:func:`flexmoba.moba_reference` over the whole sequence, computed from the cache.

Chunk means come from running per-chunk key sums (:class:`ChunkKeySums`), so absorbing a
new key costs O(D) instead of re-pooling all ``T`` keys every step.

How the selected keys are read (``path``; ``"auto"`` picks):

- ``"dense"`` (auto only): when every query's own chunk index is below ``top_k``, MoBA
  selects every earlier chunk and equals full causal attention, so it runs as dense
  attention. (One difference, on non-finite input only: MoBA never selects a past chunk
  whose gate score is NaN or -inf; the dense shortcut attends it.)
- ``"blocks"`` (up to :data:`GATHER_MAX_QUERIES` new queries, fp32): the sums also keep
  each chunk's keys transposed, ``[D, chunk_size]``, so a query's logits against a chunk are
  one weighted sum of D rows, and its output one weighted sum of value rows:
  ``embedding_bag`` computes both straight from the buffers, with no gathered copy of the
  keys or values. Costs one extra copy of the keys in memory.
- ``"gather"``: gathers each query's selected keys and values (fp32 softmax); any dtype.
- ``"mask"`` (chunked prefill, many queries): one ``[S_new, T]`` mask for SDPA.

A row may start with padding (left padding, as in batched generation): ``start[b]`` is
the first real position of row b; chunks are counted from there, and real queries never
attend the positions before it, even when they hold non-finite values. Padding queries
attend only themselves (a meaningless output).

Shapes: ``q: [B, H, S_new, D]``; keys, values ``[B, H_kv, T, D]``, ``H % H_kv == 0``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flexmoba import gate, validation
from flexmoba.gate import scores_against_means

# Up to this many new queries, read each query's selected keys (O(top_k * chunk_size) per
# query); beyond it (chunked prefill) use one [S_new, T] mask.
GATHER_MAX_QUERIES = 16
PATHS = ("auto", "blocks", "gather", "mask")


def _check_start(start, batch: int, device) -> torch.Tensor:
    if start is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    if not isinstance(start, torch.Tensor) or start.is_floating_point() or start.dtype == torch.bool:
        raise TypeError(f"start must be an integer tensor [B], got {getattr(start, 'dtype', type(start).__name__)}")
    if tuple(start.shape) != (batch,):
        raise ValueError(f"start must be [B] = [{batch}], got {tuple(start.shape)}")
    if bool((start < 0).any()):
        raise ValueError("start must be >= 0 (it counts the left padding of each row)")
    return start.to(device=device, dtype=torch.long)


class ChunkKeySums:
    """Running per-chunk state of the keys: fp32 sums and rounded means for the gate and, on
    demand, the keys of each chunk transposed (for the ``"blocks"`` path).

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
        self.start = _check_start(start, batch, device)
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
                  keep_blocks: bool = True) -> "ChunkKeySums":
        """Sums over ``keys: [B, H_kv, T, D]`` (positions 0 .. T-1)."""
        B, H_kv, _, D = keys.shape
        sums = cls(B, H_kv, D, chunk_size, start=start, device=keys.device, key_dtype=keys.dtype,
                   keep_blocks=keep_blocks)
        sums.update(keys)
        return sums

    @property
    def n_chunks(self) -> int:
        """Chunks of the longest row so far (at least 1)."""
        return chunk_count(self.length, min(self.start_list), self.chunk_size)

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
        self._grow(chunk_count(end, min(self.start_list), self.chunk_size))
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


def chunk_count(length: int, first_start: int, chunk_size: int) -> int:
    """Chunks spanned by ``length`` positions of the row whose real tokens start earliest (at least 1)."""
    return max(length - first_start - 1, 0) // chunk_size + 1


class MoBAKVCache:
    """One layer's KV cache for MoBA decoding: keys, values and running chunk state.

    Buffers grow by doubling, so appending a token is amortised O(H_kv * D). The chunk
    state (:attr:`sums`) catches up with the keys only when MoBA needs it, so a context that
    still fits in ``chunk_size * top_k`` (dense attention) pays nothing for it.

    With ``dense_decode`` every query attending this cache gets full causal attention (the
    paper's protocol for generated tokens), unless the call says otherwise.

    Usage, per layer and step::

        keys, values = cache.update(k_new, v_new)       # [B, H_kv, T, D]
        out = moba_decode_attention(q_new, cache, top_k=3)
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
    def start(self) -> torch.Tensor | None:
        """``[B]`` first real position of each row, or ``None`` when no row is padded."""
        return self._sums.start if self._sums.padded else None

    def _reserve(self, new_length: int) -> None:
        capacity = self._keys.shape[2]
        if new_length > capacity:
            extra = max(new_length, 2 * capacity) - capacity
            self._keys = F.pad(self._keys, (0, 0, 0, extra))
            self._values = F.pad(self._values, (0, 0, 0, extra))

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k_new, v_new: [B, H_kv, S_new, D]``; return all keys and values ``[B, H_kv, T, D]``."""
        validation.check_tensor(k_new, "k_new", 4)
        validation.check_tensor(v_new, "v_new", 4)
        if k_new.shape[:3] != v_new.shape[:3]:
            raise ValueError(f"v_new must be [B, H_kv, S_new, Dv] like k_new {tuple(k_new.shape[:3])}, "
                             f"got {tuple(v_new.shape)}")
        S_new = k_new.shape[2]
        if self._keys is None:
            B, H_kv, _, D = k_new.shape
            self._keys = k_new.new_zeros(B, H_kv, 0, D)
            self._values = v_new.new_zeros(B, H_kv, 0, v_new.shape[-1])
            self._sums = ChunkKeySums(B, H_kv, D, self.chunk_size, start=self._start,
                                      device=k_new.device, key_dtype=k_new.dtype)
        elif k_new.shape[:2] != self._keys.shape[:2] or k_new.shape[3] != self._keys.shape[3]:
            raise ValueError(f"k_new {tuple(k_new.shape)} does not match the cached keys {tuple(self.keys.shape)}")
        self._reserve(self.length + S_new)
        self._keys[:, :, self.length: self.length + S_new] = k_new
        self._values[:, :, self.length: self.length + S_new] = v_new
        self.length += S_new
        return self.keys, self.values


def select_past_chunks(q: torch.Tensor, means: torch.Tensor, own: torch.Tensor, top_k: int):
    """MoBA's gate over the cached chunks: ``q: [B, H, S_new, D]``, ``means: [B, H_kv, N, D]``,
    ``own: [B, S_new]`` -> ``(chunks, valid)``, each ``[B, H, S_new, P]``.
    """
    B, H, S_new, D = q.shape
    H_kv, N = means.shape[1], means.shape[2]
    with torch.no_grad():
        # Each KV group's queries as the rows of one KV head: one product per KV head, where
        # [B, H, S_new, D] rows would broadcast the means over the group (a copy per head).
        rows = q.detach().float().reshape(B, H_kv, H // H_kv * S_new, D)
        scores = scores_against_means(rows, means).view(B, H, S_new, N)
        return gate.select_past_chunks(scores, own, top_k)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``x: [B, H_kv, T, D]`` as a ``[R, D]`` table of rows (no copy when each row is contiguous,
    e.g. a view of a cache buffer), and the row step of b, kv head and position."""
    D = x.shape[-1]
    if x.stride(-1) != 1 or any(st % D for st in x.stride()[:3]) or x.stride(2) != D:
        x = x.contiguous()
    steps = [st // D for st in x.stride()[:3]]
    n_rows = sum((size - 1) * st for size, st in zip(x.shape[:3], steps)) + 1
    table = x.as_strided((n_rows, D), (D, 1), x.storage_offset())
    return table, steps


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)``, made once per size and device: decode steps reuse the same few."""
    return torch.arange(n, device=device)


@functools.lru_cache(maxsize=64)
def _kv_head(B: int, H: int, H_kv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch [B, 1, 1, 1], kv head of each query head [1, H, 1, 1])`` for index arithmetic."""
    batch = torch.arange(B, device=device).view(B, 1, 1, 1)
    kv_head = (torch.arange(H, device=device) // (H // H_kv)).view(1, H, 1, 1)
    return batch, kv_head


def gathered_attention(q, keys, values, key_pos, allowed, scale):
    """Each query attends its own list of key positions.

    ``key_pos, allowed: [B, H, S_new, L]`` (positions into ``keys: [B, H_kv, T, D]``) ->
    ``[B, H, S_new, Dv]``. Softmax in fp32, like :func:`flexmoba.moba_reference`.
    """
    B, H, S_new, L = key_pos.shape
    batch, kv_head = _kv_head(B, H, keys.shape[1], q.device)

    def gather(x):  # [B, H_kv, T, D] -> [B, H, S_new, L, D] fp32
        table, steps = _rows(x)
        index = batch * steps[0] + kv_head * steps[1] + key_pos * steps[2]
        return table.index_select(0, index.flatten()).view(B, H, S_new, L, -1).float()

    logits = torch.einsum("bhsld,bhsd->bhsl", gather(keys), q.float()) * scale
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhsl,bhsld->bhsd", probs, gather(values)).to(q.dtype)


def masked_attention(q, keys, values, allowed, scale):
    """``allowed: [B, 1 or H, S_new, T]`` bool -> ``[B, H, S_new, Dv]`` via SDPA."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale,
                                          enable_gqa=q.shape[1] != keys.shape[1])


def _zero_padding(keys, values, start: torch.Tensor):
    """Keys and values with the positions before ``start: [B]`` set to 0.

    SDPA adds the mask to ``q . k`` and multiplies probabilities by ``v``: a NaN or inf in a
    masked-out padding key or value would still reach every row (NaN - inf, 0 * inf).
    """
    real = (torch.arange(keys.shape[2], device=keys.device)[None, :] >= start[:, None])[:, None, :, None]
    return keys.masked_fill(~real, 0), values.masked_fill(~real, 0)


def dense_causal_attention(q, keys, values, start: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """Full causal attention of ``q: [B, H, S_new, D]`` aligned to the end of ``keys, values: [B, H_kv, T, D]``.

    ``start: [B]`` first real position of each row, or ``None`` for no padding. Real
    queries attend every real key up to themselves; padding queries attend only themselves.
    """
    B, H, S_new, D = q.shape
    H_kv, T = keys.shape[1], keys.shape[2]
    if start is not None:
        keys, values = _zero_padding(keys, values, start)
    if S_new == 1:  # one query per head: the heads of a KV group become the query rows of one call
        allowed = None if start is None else _dense_allowed(start, T, 1, q.device)[:, None]  # [B, 1, 1, T]
        out = F.scaled_dot_product_attention(q.reshape(B, H_kv, H // H_kv, D), keys, values,
                                             attn_mask=allowed, scale=scale)
        return out.reshape(B, H, 1, -1)
    if start is None and S_new == T:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale,
                                              enable_gqa=H != H_kv)
    start = torch.zeros(B, dtype=torch.long, device=q.device) if start is None else start
    return masked_attention(q, keys, values, _dense_allowed(start, T, S_new, q.device)[:, None], scale)


def _dense_allowed(start: torch.Tensor, T: int, S_new: int, device) -> torch.Tensor:
    """``[B, S_new, T]`` bool: the causal, padding-aware mask of the last ``S_new`` queries."""
    q_pos = T - S_new + torch.arange(S_new, device=device)
    key_pos = torch.arange(T, device=device)
    key_real = key_pos[None, :] >= start[:, None]  # [B, T]
    causal = key_pos[None, :] <= q_pos[:, None]  # [S_new, T]
    q_pad = (q_pos[None, :] < start[:, None])[:, :, None]  # [B, S_new, 1]
    return torch.where(q_pad, key_pos == q_pos[:, None], key_real[:, None, :] & causal)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sums: ChunkKeySums,
    *,
    top_k: int,
    scale: float | None = None,
    dense_decode: bool = False,
    path: str = "auto",
) -> torch.Tensor:
    """MoBA for ``q: [B, H, S_new, D]`` aligned to the end of ``keys, values: [B, H_kv, T, D]``.

    ``sums`` must already hold all ``T`` keys. With ``dense_decode`` every query attends all
    real keys up to itself (the paper's protocol for generated tokens). ``path`` chooses how
    the selected keys are read (see the module docstring); every path gives the same rows.
    """
    top_k, scale = _check_decode_args(q, keys, values, top_k, scale, path)
    if sums.length != keys.shape[2]:
        raise ValueError(f"chunk sums hold {sums.length} keys but keys hold {keys.shape[2]}; update the sums first")
    start = sums.start if sums.padded else None
    if dense_decode or (path == "auto" and sums.n_chunks <= top_k):
        return dense_causal_attention(q, keys, values, start, scale)
    return _moba_rows(q, keys, values, sums, top_k, scale, path)


def _check_decode_args(q, keys, values, top_k, scale, path) -> tuple[int, float]:
    """Validate a decode call; returns ``(top_k, scale)`` with the default scale filled in."""
    validation.check_tensor(q, "q", 4)
    validation.check_tensor(keys, "keys", 4)
    S_new, T = q.shape[2], keys.shape[2]
    if S_new > T:
        raise ValueError(f"q has {S_new} positions but the cache holds only {T} keys (queries sit at its end)")
    # The q/k/v checks want equal lengths: check q against the last S_new cached positions.
    validation.check_qkv(q, keys[:, :, T - S_new:], values[:, :, T - S_new:])
    top_k = validation.check_positive_int(top_k, "top_k")
    scale = validation.check_scale(scale)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return top_k, q.shape[-1] ** -0.5 if scale is None else scale


def _moba_rows(q, keys, values, sums: ChunkKeySums, top_k: int, scale: float, path: str) -> torch.Tensor:
    """Gate the new queries against the chunk means, then attend their chunks by ``path``."""
    S_new, T, c = q.shape[2], keys.shape[2], sums.chunk_size
    if path == "auto":
        path = _auto_path(q, keys, values, sums, S_new)
    elif path == "blocks" and not q.dtype == values.dtype == torch.float32:
        raise TypeError(f"path='blocks' needs float32 q, keys and values, got {q.dtype}; use path='gather'")
    q_pos = T - S_new + torch.arange(S_new, device=q.device)  # [S_new]
    q_local = q_pos[None, :] - sums.start[:, None]  # [B, S_new]
    own = q_local.clamp(min=0) // c  # [B, S_new]
    past, valid = select_past_chunks(q, sums.means(), own, top_k)  # [B, H, S_new, P]
    if path == "mask":
        if sums.padded:
            keys, values = _zero_padding(keys, values, sums.start)
        return _mask_selected(q, keys, values, sums.start, q_pos, own, past, valid, c, scale)
    if path == "blocks":
        return _blocks_selected(q, keys, values, sums, q_local, own, past, valid, scale)
    return _gather_selected(q, keys, values, sums.start, q_pos, own, past, valid, c, scale)


def _auto_path(q, keys, values, sums: ChunkKeySums, S_new: int) -> str:
    if S_new > GATHER_MAX_QUERIES:
        return "mask"
    fp32 = q.dtype == keys.dtype == values.dtype == torch.float32
    return "blocks" if fp32 and sums.keep_blocks else "gather"


def _slots(own, past, valid):
    """The selected chunks as ``(chunks, used)``, each ``[B, H, S_new, P + 1]``, own chunk last."""
    B, H, S_new, _ = past.shape
    chunks = torch.cat([past, own[:, None, :, None].expand(B, H, S_new, 1)], dim=-1)
    return chunks, F.pad(valid, (0, 1), value=True)


def _blocks_selected(q, keys, values, sums: ChunkKeySums, q_local, own, past, valid, scale):
    """Logits from the transposed key blocks and outputs from the value rows, by ``embedding_bag``.

    ``q_local: [B, S_new]`` positions from each row's start -> ``[B, H, S_new, Dv]``.
    """
    B, H, S_new, _ = q.shape
    c = sums.chunk_size
    chunks, used = _slots(own, past, valid)  # [B, H, S_new, K]
    # Past slots are all or nothing; the own chunk (last slot) is cut at the query.
    last = torch.where(used, c - 1, -1)
    last[..., -1] = (q_local - own * c)[:, None, :]
    allowed = _arange(c, q.device) <= last[..., None]  # [B, H, S_new, K, c]
    L = allowed.shape[-2] * c
    logits = _block_logits(q, sums.key_blocks(keys), chunks, scale).view(allowed.shape)
    logits = torch.where(allowed, logits, float("-inf")).view(B, H, S_new, L)
    if sums.padded:  # a padding query attends only itself: slot 0, its own row below
        logits[..., 0] = logits[..., 0].masked_fill((q_local < 0)[:, None, :], 0.0)
    probs = logits.softmax(dim=-1)

    table, steps = _rows(values)
    batch, kv_head = _kv_head(B, H, values.shape[1], q.device)
    row0 = batch * steps[0] + kv_head * steps[1] + sums.start.view(B, 1, 1, 1) * steps[2]  # local position 0
    own_row = row0[..., 0] + q_local[:, None, :] * steps[2]  # [B, H, S_new]
    first = row0 + chunks * (c * steps[2])  # [B, H, S_new, K]
    index = first[..., None] + _arange(c, q.device) * steps[2]
    # Masked-out slots read the query's own row (weight 0): a key it attends anyway, so a
    # non-finite value there cannot reach the output through 0 * inf.
    index = torch.where(allowed, index, own_row[..., None, None]).view(-1, L)
    out = F.embedding_bag(index, table, per_sample_weights=probs.view(-1, L), mode="sum")
    return out.view(B, H, S_new, -1).to(q.dtype)


def _block_logits(q, blocks, chunks, scale):
    """``q . k * scale`` of ``q: [B, H, S_new, D]`` with every key of its ``chunks: [B, H, S_new, K]``,
    read from ``blocks: [B, H_kv, N, D, c]`` -> ``[B, H, S_new, K * c]`` fp32.

    One bag per (query, chunk): the chunk's D rows of ``blocks`` weighted by the query. Bags
    run in (kv head, query, slot, head in group) order, so the heads of a group read their
    shared own chunk back to back, while it is still in cache.
    """
    B, H, S_new, D = q.shape
    H_kv, N, c = blocks.shape[1], blocks.shape[2], blocks.shape[-1]
    g, K = H // H_kv, chunks.shape[-1]
    by_group = chunks.view(B, H_kv, g, S_new, K).permute(0, 1, 3, 4, 2).contiguous()  # [B, H_kv, S_new, K, g]
    first = (by_group + _arange(B * H_kv, q.device).view(B, H_kv, 1, 1, 1) * N) * D
    index = (first[..., None] + _arange(D, q.device)).view(-1, D)
    weights = (q.float() * scale).view(B, H_kv, g, S_new, 1, D).permute(0, 1, 3, 4, 2, 5)
    weights = weights.expand(B, H_kv, S_new, K, g, D).reshape(-1, D)
    logits = F.embedding_bag(index, blocks.view(-1, c), per_sample_weights=weights, mode="sum")
    return logits.view(B, H_kv, S_new, K, g, c).permute(0, 1, 4, 2, 3, 5).reshape(B, H, S_new, K * c)


def _gather_selected(q, keys, values, start, q_pos, own, past, valid, c, scale):
    """Gather each query's selected chunks (past ones whole, its own up to itself) and attend."""
    B, H, S_new, _ = q.shape
    T = keys.shape[2]
    q_pad = q_pos[None, :] < start[:, None]  # [B, S_new]
    chunks, used = _slots(own, past, valid)
    first = start[:, None, None, None] + chunks * c
    # A padding query's "own chunk" starts at itself, so it attends only itself.
    first[..., -1] = torch.where(q_pad[:, None, :], q_pos[None, None, :], first[..., -1])
    positions = first[..., None] + torch.arange(c, device=q.device)  # [B, H, S_new, P + 1, c]
    allowed = used[..., None] & (positions <= q_pos[None, None, :, None, None])
    L = positions.shape[-2] * c
    return gathered_attention(q, keys, values, positions.clamp(max=T - 1).view(B, H, S_new, L),
                              allowed.view(B, H, S_new, L), scale)


def _mask_selected(q, keys, values, start, q_pos, own, past, valid, c, scale):
    """The selection as one ``[B, H, S_new, T]`` mask for SDPA: for many queries (chunked prefill)."""
    B, H, S_new, _ = q.shape
    T = keys.shape[2]
    key_pos = torch.arange(T, device=q.device)
    key_local = key_pos[None, :] - start[:, None]  # [B, T]
    n_chunks = int(torch.cat([own.flatten(), past.flatten()]).max()) + 1  # unused slots may point past own
    selected = torch.zeros(B, H, S_new, n_chunks, dtype=torch.bool, device=q.device)
    selected.scatter_(-1, past, valid)
    selected.scatter_(-1, own[:, None, :, None].expand(B, H, S_new, 1), True)
    key_chunk = (key_local.clamp(min=0) // c).clamp(max=selected.shape[-1] - 1)
    allowed = selected.gather(-1, key_chunk[:, None, None, :].expand(B, H, S_new, T))
    allowed &= ((key_local >= 0)[:, None, :] & (key_pos[None, :] <= q_pos[:, None]))[:, None]
    q_pad = (q_pos[None, :] < start[:, None])[:, None, :, None]  # [B, 1, S_new, 1]
    return masked_attention(q, keys, values, torch.where(q_pad, key_pos == q_pos[:, None], allowed), scale)


def moba_decode_attention(
    q_new: torch.Tensor,
    cache: MoBAKVCache,
    *,
    top_k: int,
    scale: float | None = None,
    dense_decode: bool | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """MoBA attention of ``q_new: [B, H, S_new, D]`` over a :class:`MoBAKVCache`.

    Call ``cache.update(k_new, v_new)`` first: the queries are the cache's last ``S_new``
    positions. Returns ``[B, H, S_new, Dv]``, equal to those rows of
    :func:`flexmoba.moba_reference` over the whole cached sequence (or of full causal
    attention with ``dense_decode``; ``None`` means the cache's ``dense_decode``).
    """
    _check_cache(cache)
    dense_decode = cache.dense_decode if dense_decode is None else dense_decode
    top_k, scale = _check_decode_args(q_new, cache.keys, cache.values, top_k, scale, path)
    lazy = cache._sums  # not caught up yet: dense attention does not need it
    if dense_decode or (path == "auto" and chunk_count(cache.length, min(lazy.start_list), lazy.chunk_size) <= top_k):
        return dense_causal_attention(q_new, cache.keys, cache.values, cache.start, scale)
    return _moba_rows(q_new, cache.keys, cache.values, cache.sums, top_k, scale, path)


def dense_decode_attention(q_new: torch.Tensor, cache: MoBAKVCache, *, scale: float | None = None) -> torch.Tensor:
    """Full causal attention of ``q_new: [B, H, S_new, D]`` over a :class:`MoBAKVCache` (after ``update``)."""
    _check_cache(cache)
    return dense_causal_attention(q_new, cache.keys, cache.values, cache.start, validation.check_scale(scale))


def _check_cache(cache) -> None:
    if not isinstance(cache, MoBAKVCache):
        raise TypeError(f"cache must be a MoBAKVCache, got {type(cache).__name__}")
    if cache.length == 0:
        raise ValueError("the cache is empty; call cache.update(k_new, v_new) before attending")
