"""MoBA decode attention: new queries against a KV cache.

New queries sit at the END of the cached keys: with ``T`` cached positions (new keys
included) and ``S_new`` queries, query i is at absolute position ``T - S_new + i``. Each
query gates against the means of the complete chunks before its own chunk, keeps the
``top_k - 1`` best, and attends those chunks plus its own chunk up to itself: the rows of
:func:`flexmoba.moba_reference` over the whole sequence, computed from the cache
(:mod:`flexmoba.kv_cache` holds the keys, values and running chunk sums).

How the selected keys are read (``path``; ``"auto"`` picks):

- ``"dense"`` (auto only): when every query's own chunk index is below ``top_k``, MoBA
  selects every earlier chunk and equals full causal attention, so it runs as dense
  attention. (One difference, on non-finite input only: MoBA never selects a past chunk
  whose gate score is NaN or -inf; the dense shortcut attends it.)
- ``"blocks"`` (up to :data:`GATHER_MAX_QUERIES` new queries, fp32): a query's logits
  against a chunk are one weighted sum of the D rows of that chunk's transposed keys
  (:attr:`flexmoba.kv_cache.ChunkKeySums.blocks`), and its output one weighted sum of value
  rows: ``embedding_bag`` computes both straight from the buffers, with no gathered copy of
  the keys or values.
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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexmoba import gate, validation
from flexmoba.kv_cache import ChunkKeySums, MoBAKVCache

__all__ = [
    "PATHS",
    "DecodeStep",
    "decode_attention",
    "dense_causal_attention",
    "dense_decode_attention",
    "gate_step",
    "moba_decode_attention",
]

# Up to this many new queries, read each query's selected keys (O(top_k * chunk_size) per
# query); beyond it (chunked prefill) use one [S_new, T] mask.
GATHER_MAX_QUERIES = 16
PATHS = ("auto", "blocks", "gather", "mask")


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``x: [B, H_kv, T, D]`` as a ``[R, D]`` table of rows (no copy when each row is contiguous,
    e.g. a view of a cache buffer), and the row step of b, kv head and position."""
    D = x.shape[-1]
    if x.stride(-1) != 1 or any(st % D for st in x.stride()[:3]) or x.stride(2) != D:
        x = x.contiguous()
    steps = [st // D for st in x.stride()[:3]]
    n_rows = sum((size - 1) * st for size, st in zip(x.shape[:3], steps, strict=True)) + 1
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
    top_k, scale = _decode_args(q, keys, values, top_k, scale, path)
    validation.check_sums_hold(sums.length, keys.shape[2])
    if dense_decode or (path == "auto" and sums.n_chunks <= top_k):
        return dense_causal_attention(q, keys, values, sums.start if sums.padded else None, scale)
    return _moba_rows(q, keys, values, sums, top_k, scale, path)


def _decode_args(q, keys, values, top_k, scale, path) -> tuple[int, float]:
    """Validate a decode call; returns ``(top_k, scale)`` with the default scale filled in."""
    top_k = validation.check_decode_args(q, keys, values, top_k)
    scale = validation.check_scale(scale)
    validation.check_choice(path, "path", PATHS)
    return top_k, q.shape[-1] ** -0.5 if scale is None else scale


@dataclass(frozen=True)
class DecodeStep:
    """One gated decode call: the new queries, what they attend, and what the gate chose.

    Attributes:
        q: ``[B, H, S_new, D]`` new queries, at the last ``S_new`` positions of the keys.
        keys, values: ``[B, H_kv, T, D]`` all cached keys and values.
        sums: the chunk state of those keys (chunk size, ``start``, transposed blocks).
        scale: softmax scale.
        q_pos: ``[S_new]`` absolute position of each query.
        q_local: ``[B, S_new]`` position of each query from its row's ``start`` (< 0: padding).
        own: ``[B, S_new]`` each query's own chunk (0 for padding queries).
        past, valid: ``[B, H, S_new, P]`` the selected past chunks and which slots are used.
    """

    q: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    sums: ChunkKeySums
    scale: float
    q_pos: torch.Tensor
    q_local: torch.Tensor
    own: torch.Tensor
    past: torch.Tensor
    valid: torch.Tensor


def gate_step(q, keys, values, sums: ChunkKeySums, top_k: int, scale: float) -> DecodeStep:
    """Run MoBA's gate (:mod:`flexmoba.gate`) for the new queries against the chunk means."""
    S_new, T = q.shape[2], keys.shape[2]
    q_pos = T - S_new + torch.arange(S_new, device=q.device)
    q_local = q_pos[None, :] - sums.start[:, None]
    own = q_local.clamp(min=0) // sums.chunk_size
    with torch.no_grad():
        scores = gate.scores_against_means(q.detach().float(), sums.means())  # [B, H, S_new, N]
        past, valid = gate.select_past_chunks(scores, own, top_k)
    return DecodeStep(q=q, keys=keys, values=values, sums=sums, scale=scale,
                      q_pos=q_pos, q_local=q_local, own=own, past=past, valid=valid)


def _moba_rows(q, keys, values, sums: ChunkKeySums, top_k: int, scale: float, path: str) -> torch.Tensor:
    """Gate the new queries against the chunk means, then attend their chunks by ``path``."""
    if path == "auto":
        path = _auto_path(q, keys, values, sums)
    elif path == "blocks":
        validation.check_float32(q, values, path)
    step = gate_step(q, keys, values, sums, top_k, scale)
    return {"mask": _mask_selected, "blocks": _blocks_selected, "gather": _gather_selected}[path](step)


def _auto_path(q, keys, values, sums: ChunkKeySums) -> str:
    if q.shape[2] > GATHER_MAX_QUERIES:
        return "mask"
    fp32 = q.dtype == keys.dtype == values.dtype == torch.float32
    return "blocks" if fp32 and sums.keep_blocks else "gather"


def _slots(step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected chunks as ``(chunks, used)``, each ``[B, H, S_new, P + 1]``, own chunk last."""
    B, H, S_new, _ = step.past.shape
    chunks = torch.cat([step.past, step.own[:, None, :, None].expand(B, H, S_new, 1)], dim=-1)
    return chunks, F.pad(step.valid, (0, 1), value=True)


def _blocks_selected(step: DecodeStep) -> torch.Tensor:
    """``[B, H, S_new, Dv]``: logits from the transposed key blocks, outputs from the value rows,
    both by ``embedding_bag``."""
    q, sums, q_local = step.q, step.sums, step.q_local
    B, H, S_new, _ = q.shape
    c = sums.chunk_size
    chunks, used = _slots(step)  # [B, H, S_new, K]
    # Past slots are all or nothing; the own chunk (last slot) is cut at the query.
    last = torch.where(used, c - 1, -1)
    last[..., -1] = (q_local - step.own * c)[:, None, :]
    allowed = _arange(c, q.device) <= last[..., None]  # [B, H, S_new, K, c]
    L = allowed.shape[-2] * c
    logits = _block_logits(q, sums.key_blocks(step.keys), chunks, step.scale).view(allowed.shape)
    logits = torch.where(allowed, logits, float("-inf")).view(B, H, S_new, L)
    if sums.padded:  # a padding query attends only itself: slot 0, its own row below
        logits[..., 0] = logits[..., 0].masked_fill((q_local < 0)[:, None, :], 0.0)
    probs = logits.softmax(dim=-1)

    table, steps = _rows(step.values)
    batch, kv_head = _kv_head(B, H, step.values.shape[1], q.device)
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


def _gather_selected(step: DecodeStep) -> torch.Tensor:
    """Gather each query's selected chunks (past ones whole, its own up to itself) and attend."""
    q, q_pos, c = step.q, step.q_pos, step.sums.chunk_size
    B, H, S_new, _ = q.shape
    T = step.keys.shape[2]
    chunks, used = _slots(step)
    first = step.sums.start[:, None, None, None] + chunks * c
    # A padding query's "own chunk" starts at itself, so it attends only itself.
    first[..., -1] = torch.where((step.q_local < 0)[:, None, :], q_pos[None, None, :], first[..., -1])
    positions = first[..., None] + torch.arange(c, device=q.device)  # [B, H, S_new, P + 1, c]
    allowed = used[..., None] & (positions <= q_pos[None, None, :, None, None])
    L = positions.shape[-2] * c
    return gathered_attention(q, step.keys, step.values, positions.clamp(max=T - 1).view(B, H, S_new, L),
                              allowed.view(B, H, S_new, L), step.scale)


def _mask_selected(step: DecodeStep) -> torch.Tensor:
    """The selection as one ``[B, H, S_new, T]`` mask for SDPA: for many queries (chunked prefill)."""
    q, keys, values, q_pos, own, start = step.q, step.keys, step.values, step.q_pos, step.own, step.sums.start
    if step.sums.padded:
        keys, values = _zero_padding(keys, values, start)
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
    validation.check_cache(cache, MoBAKVCache)
    dense_decode = cache.dense_decode if dense_decode is None else dense_decode
    top_k, scale = _decode_args(q_new, cache.keys, cache.values, top_k, scale, path)
    # cache.n_chunks does not bring the chunk state up: dense attention never needs it.
    if dense_decode or (path == "auto" and cache.n_chunks <= top_k):
        return dense_causal_attention(q_new, cache.keys, cache.values, cache.start, scale)
    return _moba_rows(q_new, cache.keys, cache.values, cache.sums, top_k, scale, path)


def dense_decode_attention(q_new: torch.Tensor, cache: MoBAKVCache, *, scale: float | None = None) -> torch.Tensor:
    """Full causal attention of ``q_new: [B, H, S_new, D]`` over a :class:`MoBAKVCache` (after ``update``)."""
    validation.check_cache(cache, MoBAKVCache)
    return dense_causal_attention(q_new, cache.keys, cache.values, cache.start, validation.check_scale(scale))
