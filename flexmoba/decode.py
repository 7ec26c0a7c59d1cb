"""MoBA decoding with a KV cache.

New queries sit at the END of the cached keys: with ``T`` cached positions (new keys
included) and ``S_new`` queries, query i is at absolute position ``T - S_new + i``. Each
query gates against the means of the complete chunks before its own chunk, keeps the
``top_k - 1`` best, and attends those chunks plus its own chunk up to itself: the rows of
:func:`flexmoba.moba_reference` over the whole sequence, computed from the cache.

Chunk means come from running per-chunk key sums (:class:`ChunkKeySums`), so absorbing a
new key costs O(D) instead of re-pooling all ``T`` keys every step.

A row may start with padding (left padding, as in batched generation): ``start[b]`` is
the first real position of row b; chunks are counted from there, and real queries never
attend the positions before it. Padding queries attend only themselves (a finite,
meaningless output).

Shapes: ``q: [B, H, S_new, D]``; keys, values ``[B, H_kv, T, D]``, ``H % H_kv == 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexmoba import _checks, selection
from flexmoba.selection import scores_against_means

# Up to this many new queries, attend by gathering each query's selected keys
# (O(top_k * chunk_size) per query); beyond it (chunked prefill) use one [S_new, T] mask.
GATHER_MAX_QUERIES = 16


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
    """Running fp32 sums of the keys of every chunk, for O(D) chunk-mean updates.

    Attributes:
        sums: ``[B, H_kv, N, D]`` fp32 key sums per chunk (``N`` grows as needed).
        counts: ``[B, N]`` fp32 keys per chunk.
        start: ``[B]`` first real position of each row; chunk j holds positions
            ``start + j * chunk_size ...``; positions before ``start`` are left out.
        length: positions absorbed so far (padding included).
        last_key: ``[B, H_kv, D]`` the key at ``length - 1``, so a caller that keeps these
            sums beside someone else's cache can tell whether that cache changed under it.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, chunk_size: int, *,
                 start: torch.Tensor | None = None, device=None, key_dtype=torch.float32):
        self.chunk_size = _checks.check_positive_int(chunk_size, "chunk_size")
        self.start = _check_start(start, batch, device)
        self.key_dtype = key_dtype
        self.sums = torch.zeros(batch, kv_heads, 0, head_dim, device=device, dtype=torch.float32)
        self.counts = torch.zeros(batch, 0, device=device, dtype=torch.float32)
        self.length = 0
        self.last_key: torch.Tensor | None = None

    @classmethod
    def from_keys(cls, keys: torch.Tensor, chunk_size: int, start: torch.Tensor | None = None) -> "ChunkKeySums":
        """Sums over ``keys: [B, H_kv, T, D]`` (positions 0 .. T-1)."""
        B, H_kv, _, D = keys.shape
        sums = cls(B, H_kv, D, chunk_size, start=start, device=keys.device, key_dtype=keys.dtype)
        sums.update(keys)
        return sums

    def _grow(self, n_chunks: int) -> None:
        have = self.sums.shape[2]
        if n_chunks <= have:
            return
        extra = max(n_chunks, 2 * have) - have
        self.sums = F.pad(self.sums, (0, 0, 0, extra))
        self.counts = F.pad(self.counts, (0, extra))

    def update(self, k_new: torch.Tensor) -> None:
        """Absorb ``k_new: [B, H_kv, S_new, D]``, the keys of positions ``length .. length + S_new - 1``."""
        B, H_kv, S_new, D = k_new.shape
        if S_new == 0:
            return
        positions = self.length + torch.arange(S_new, device=k_new.device)
        local = positions[None, :] - self.start[:, None]  # [B, S_new]
        real = local >= 0
        chunk = local.clamp(min=0) // self.chunk_size
        self._grow((self.length + S_new - 1) // self.chunk_size + 1)  # enough for start = 0
        # where(), not multiply: a non-finite padding key must not leak into chunk 0.
        k32 = torch.where(real[:, None, :, None], k_new.float(), 0.0)
        self.sums.scatter_add_(2, chunk[:, None, :, None].expand(B, H_kv, S_new, D), k32)
        self.counts.scatter_add_(1, chunk, real.float())
        self.length += S_new
        self.last_key = k_new[:, :, -1].detach().clone()

    def means(self) -> torch.Tensor:
        """``[B, H_kv, N, D]`` fp32 chunk means, rounded through the key dtype like :func:`chunk_means`."""
        counts = self.counts.clamp(min=1)[:, None, :, None]
        return (self.sums / counts).to(self.key_dtype).float()


class MoBAKVCache:
    """One layer's KV cache for MoBA decoding: keys, values and running chunk key sums.

    Buffers grow by doubling, so appending a token is amortised O(H_kv * D).

    Usage, per layer and step::

        keys, values = cache.update(k_new, v_new)       # [B, H_kv, T, D]
        out = moba_decode_attention(q_new, cache, top_k=3)
    """

    def __init__(self, chunk_size: int, start: torch.Tensor | None = None):
        self.chunk_size = _checks.check_positive_int(chunk_size, "chunk_size")
        self._start = start
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self.sums: ChunkKeySums | None = None
        self.length = 0

    @property
    def keys(self) -> torch.Tensor:
        """``[B, H_kv, T, D]`` cached keys (a view of the buffer)."""
        return self._keys[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, :, : self.length]

    def _reserve(self, new_length: int) -> None:
        capacity = self._keys.shape[2]
        if new_length > capacity:
            extra = max(new_length, 2 * capacity) - capacity
            self._keys = F.pad(self._keys, (0, 0, 0, extra))
            self._values = F.pad(self._values, (0, 0, 0, extra))

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k_new, v_new: [B, H_kv, S_new, D]``; return all keys and values ``[B, H_kv, T, D]``."""
        _checks._check_tensor(k_new, "k_new", 4)
        _checks._check_tensor(v_new, "v_new", 4)
        if k_new.shape[:3] != v_new.shape[:3]:
            raise ValueError(f"v_new must be [B, H_kv, S_new, Dv] like k_new {tuple(k_new.shape[:3])}, "
                             f"got {tuple(v_new.shape)}")
        S_new = k_new.shape[2]
        if self._keys is None:
            B, H_kv, _, D = k_new.shape
            self._keys = k_new.new_zeros(B, H_kv, 0, D)
            self._values = v_new.new_zeros(B, H_kv, 0, v_new.shape[-1])
            self.sums = ChunkKeySums(B, H_kv, D, self.chunk_size, start=self._start,
                                     device=k_new.device, key_dtype=k_new.dtype)
        elif k_new.shape[:2] != self._keys.shape[:2] or k_new.shape[3] != self._keys.shape[3]:
            raise ValueError(f"k_new {tuple(k_new.shape)} does not match the cached keys {tuple(self.keys.shape)}")
        self._reserve(self.length + S_new)
        self._keys[:, :, self.length: self.length + S_new] = k_new
        self._values[:, :, self.length: self.length + S_new] = v_new
        self.sums.update(k_new)
        self.length += S_new
        return self.keys, self.values


def select_past_chunks(q: torch.Tensor, means: torch.Tensor, own: torch.Tensor, top_k: int):
    """MoBA's gate over the cached chunks: ``q: [B, H, S_new, D]``, ``means: [B, H_kv, N, D]``,
    ``own: [B, S_new]`` -> ``(chunks, valid)``, each ``[B, H, S_new, P]``.
    """
    with torch.no_grad():
        scores = scores_against_means(q.detach().float(), means)
        return selection.select_past_chunks(scores, own, top_k)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``x: [B, H_kv, T, D]`` as a ``[R, D]`` table of rows (no copy when each row is contiguous,
    e.g. a view of a cache buffer), and the row step of b, kv head and position.
    ``index_select`` on this table is several times faster than 4-D advanced indexing."""
    D = x.shape[-1]
    if x.stride(-1) != 1 or any(st % D for st in x.stride()[:3]) or x.stride(2) != D:
        x = x.contiguous()
    steps = [st // D for st in x.stride()[:3]]
    n_rows = sum((size - 1) * st for size, st in zip(x.shape[:3], steps)) + 1
    table = x.as_strided((n_rows, D), (D, 1), x.storage_offset())
    return table, steps


def gathered_attention(q, keys, values, key_pos, allowed, scale):
    """Each query attends its own list of key positions.

    ``key_pos, allowed: [B, H, S_new, L]`` (positions into ``keys: [B, H_kv, T, D]``) ->
    ``[B, H, S_new, Dv]``. Softmax in fp32, like :func:`flexmoba.moba_reference`.
    """
    B, H, S_new, L = key_pos.shape
    H_kv = keys.shape[1]
    batch = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    kv_head = (torch.arange(H, device=q.device) // (H // H_kv)).view(1, H, 1, 1)

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


def dense_causal_attention(q, keys, values, start: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Full causal attention of ``q: [B, H, S_new, D]`` aligned to the end of ``keys, values: [B, H_kv, T, D]``.

    Real queries attend every real key up to themselves (``start: [B]`` first real
    position); padding queries attend only themselves.
    """
    S_new, T = q.shape[2], keys.shape[2]
    q_pos = T - S_new + torch.arange(S_new, device=q.device)
    key_pos = torch.arange(T, device=q.device)
    key_real = key_pos[None, :] >= start[:, None]  # [B, T]
    causal = key_pos[None, :] <= q_pos[:, None]  # [S_new, T]
    q_pad = (q_pos[None, :] < start[:, None])[:, :, None]  # [B, S_new, 1]
    allowed = torch.where(q_pad, key_pos == q_pos[:, None], key_real[:, None, :] & causal)
    return masked_attention(q, keys, values, allowed[:, None], scale)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sums: ChunkKeySums,
    *,
    top_k: int,
    scale: float | None = None,
    dense_decode: bool = False,
) -> torch.Tensor:
    """MoBA for ``q: [B, H, S_new, D]`` aligned to the end of ``keys, values: [B, H_kv, T, D]``.

    ``sums`` must already hold all ``T`` keys. With ``dense_decode`` every query attends all
    real keys up to itself (the paper's protocol for generated tokens).
    """
    _checks._check_tensor(q, "q", 4)
    _checks._check_tensor(keys, "keys", 4)
    B, H, S_new, D = q.shape
    T, c = keys.shape[2], sums.chunk_size
    if S_new > T:
        raise ValueError(f"q has {S_new} positions but the cache holds only {T} keys (queries sit at its end)")
    # The q/k/v checks want equal lengths: check q against the last S_new cached positions.
    _checks.check_qkv(q, keys[:, :, T - S_new:], values[:, :, T - S_new:])
    top_k = _checks.check_positive_int(top_k, "top_k")
    scale = _checks.check_scale(scale)
    if sums.length != T:
        raise ValueError(f"chunk sums hold {sums.length} keys but keys hold {T}; update the sums first")
    scale = D ** -0.5 if scale is None else scale

    if dense_decode:
        return dense_causal_attention(q, keys, values, sums.start, scale)

    q_pos = T - S_new + torch.arange(S_new, device=q.device)  # [S_new]
    q_local = q_pos[None, :] - sums.start[:, None]  # [B, S_new]
    own = q_local.clamp(min=0) // c  # [B, S_new]
    past, valid = select_past_chunks(q, sums.means(), own, top_k)  # [B, H, S_new, P]
    attend = _gather_selected if S_new <= GATHER_MAX_QUERIES else _mask_selected
    return attend(q, keys, values, sums.start, q_pos, own, past, valid, c, scale)


def _gather_selected(q, keys, values, start, q_pos, own, past, valid, c, scale):
    """Gather each query's selected chunks (past ones whole, its own up to itself) and attend."""
    B, H, S_new, _ = q.shape
    T = keys.shape[2]
    q_pad = q_pos[None, :] < start[:, None]  # [B, S_new]
    chunks = torch.cat([past, own[:, None, :, None].expand(B, H, S_new, 1)], dim=-1)  # [B, H, S_new, P + 1]
    used = F.pad(valid, (0, 1), value=True)
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
    dense_decode: bool = False,
) -> torch.Tensor:
    """MoBA attention of ``q_new: [B, H, S_new, D]`` over a :class:`MoBAKVCache`.

    Call ``cache.update(k_new, v_new)`` first: the queries are the cache's last ``S_new``
    positions. Returns ``[B, H, S_new, Dv]``, equal to those rows of
    :func:`flexmoba.moba_reference` over the whole cached sequence (or of full causal
    attention with ``dense_decode=True``).
    """
    if not isinstance(cache, MoBAKVCache):
        raise TypeError(f"cache must be a MoBAKVCache, got {type(cache).__name__}")
    if cache.length == 0:
        raise ValueError("the cache is empty; call cache.update(k_new, v_new) before attending")
    return decode_attention(q_new, cache.keys, cache.values, cache.sums,
                            top_k=top_k, scale=scale, dense_decode=dense_decode)
