"""MoBA decode attention: new queries against a KV cache, through the one backend table.

New queries sit at the END of the cached keys: with ``T`` cached positions (new keys
included) and ``S_new`` queries, query i is at absolute position ``T - S_new + i``. Each
query gates against the means of the complete chunks before its own chunk, keeps the
``top_k - 1`` best, and attends those chunks plus its own chunk up to itself: the rows of
:func:`flexmoba.moba_reference` over the whole sequence, computed from the cache
(:mod:`flexmoba.kv_cache` holds the keys, values and running chunk sums).

One dispatch, as for attention: the settings are a :class:`flexmoba.MobaSpec` (the cache
fixes the chunk size), :func:`flexmoba.backends.resolve_decode_backend` resolves
``"auto"`` (dense attention while MoBA equals it, ``gather`` for a few new queries,
``sdpa`` for many), the gate runs once (:func:`flexmoba.gate.select_against_means`) and
the backend's ``decode`` reads the selected keys (its folder's ``decode`` module, e.g.
:mod:`flexmoba.backends.gather.decode`). A backend without ``decode`` (``"flex"``, ``"flex_union"``) is refused by name.

A row may start with padding (left padding, as in batched generation): ``start[b]`` is
the first real position of row b; chunks are counted from there, and real queries never
attend the positions before it, even when they hold non-finite values. Padding queries
attend only themselves (a meaningless output).

Shapes: ``q: [B, H, S_new, D]``; keys, values ``[B, H_kv, T, D]``, ``H % H_kv == 0``.
"""

from __future__ import annotations

import torch

from flexmoba import validation
from flexmoba.backends import get_decode_backend, resolve_decode_backend
from flexmoba.backends.checked import checked_decode
from flexmoba.backends.protocol import DecodeStep, query_places
from flexmoba.dense import dense_causal_attention
from flexmoba.gate import select_against_means
from flexmoba.kv_cache import ChunkKeySums, MoBAKVCache

__all__ = ["attend_cached_keys", "decode_spec", "dense_decode_attention", "gate_step", "moba_decode_attention"]
from flexmoba.spec import MobaSpec, resolve_spec


def moba_decode_attention(
    q_new: torch.Tensor,
    cache: MoBAKVCache,
    spec: MobaSpec | None = None,
    *,
    top_k: int | None = None,
    backend: str | None = None,
    scale: float | None = None,
    dense_decode: bool | None = None,
) -> torch.Tensor:
    """MoBA attention of ``q_new: [B, H, S_new, D]`` over a :class:`MoBAKVCache`.

    Call ``cache.update(k_new, v_new)`` first: the queries are the cache's last ``S_new``
    positions.

    Args:
        q_new: ``[B, H, S_new, D]`` new queries.
        cache: the layer's cache; its ``chunk_size`` is MoBA's.
        spec: MoBA's settings as one :class:`flexmoba.MobaSpec` (its ``chunk_size`` must be
            the cache's; token granularity), or give them as keywords:
        top_k: chunks per query, counting its own chunk.
        backend: ``"auto"`` (the default) or a registered backend that decodes (``"gather"``,
            ``"sdpa"``, or one registered with ``decode=``).
        scale: softmax scale, default ``D ** -0.5``.
        dense_decode: full causal attention instead of MoBA (the paper's protocol for
            generated tokens; no backend runs); ``None`` means the cache's ``dense_decode``.

    Returns:
        ``[B, H, S_new, Dv]``, equal to those rows of :func:`flexmoba.moba_reference` over
        the whole cached sequence (or of full causal attention with ``dense_decode``).
    """
    validation.check_cache(cache, MoBAKVCache)
    spec = decode_spec(spec, cache.chunk_size, top_k, backend)
    dense_decode = cache.dense_decode if dense_decode is None else validation.check_bool(dense_decode, "dense_decode")
    return attend_cached_keys(q_new, cache.keys, cache.values, cache.chunk_state, spec, scale=scale,
                              dense_decode=dense_decode)


def decode_spec(spec: MobaSpec | None, chunk_size: int, top_k: int | None, backend: str | None) -> MobaSpec:
    """The spec of a decode call over a cache of ``chunk_size``: ``spec``, or one from the keywords."""
    if spec is None:
        return resolve_spec(None, chunk_size, top_k, None, backend)
    spec = resolve_spec(spec, top_k=top_k, backend=backend)
    if spec.chunk_size != chunk_size:
        raise ValueError(f"spec.chunk_size={spec.chunk_size} differs from the cache's chunk_size={chunk_size}; "
                         "the cache's chunks are MoBA's")
    return spec


def attend_cached_keys(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sums: ChunkKeySums,
    spec: MobaSpec,
    *,
    scale: float | None = None,
    dense_decode: bool = False,
) -> torch.Tensor:
    """The one decode dispatch, behind :func:`moba_decode_attention` and the transformers adapter.

    ``q: [B, H, S_new, D]`` at the end of ``keys, values: [B, H_kv, T, D]`` ->
    ``[B, H, S_new, Dv]``. ``sums`` holds the chunk state of the first ``sums.length <= T``
    of these keys; the rest are absorbed here, and only if MoBA gates (dense attention
    needs no chunk state).
    """
    validation.check_decode_args(q, keys, values)
    scale = validation.softmax_scale(scale, q)
    T = keys.shape[2]
    validation.check_sums_within(sums.length, T)
    if sums.chunk_size != spec.chunk_size:
        raise ValueError(f"spec.chunk_size={spec.chunk_size} differs from the chunk sums' chunk_size={sums.chunk_size}")
    start = sums.start if sums.padded else None
    if dense_decode:
        return dense_causal_attention(q, keys, values, start, scale)
    if spec.granularity != "token":
        raise ValueError(f"granularity={spec.granularity!r} has no decode path; decode with dense_decode=True "
                         "or re-run the whole sequence")
    name = resolve_decode_backend(spec.backend, q.shape[2], sums.chunks_spanned(T), spec.top_k, q.device)
    if name is None:
        return dense_causal_attention(q, keys, values, start, scale)
    decode = checked_decode(name, get_decode_backend(name))
    sums.update(keys[:, :, sums.length:])
    return decode(gate_step(q, keys, values, sums, spec.top_k, scale))


def gate_step(q, keys, values, sums: ChunkKeySums, top_k: int, scale: float) -> DecodeStep:
    """Run MoBA's gate for the new queries against the chunk means (``sums`` holds all ``T`` keys)."""
    S_new, T = q.shape[2], keys.shape[2]
    own_chunk = (T - 1) // sums.chunk_size
    in_one_chunk = not sums.padded and (T - S_new) // sums.chunk_size == own_chunk
    if in_one_chunk:
        past, valid = select_against_means(q, sums.means(), None, top_k, own_chunk=own_chunk)
    else:
        past, valid = select_against_means(q, sums.means(), query_places(S_new, T, sums)[2], top_k)
    return DecodeStep(q=q, keys=keys, values=values, sums=sums, scale=scale, past=past, valid=valid)


def dense_decode_attention(q_new: torch.Tensor, cache: MoBAKVCache, *, scale: float | None = None) -> torch.Tensor:
    """Full causal attention of ``q_new: [B, H, S_new, D]`` over a :class:`MoBAKVCache` (after ``update``)."""
    validation.check_cache(cache, MoBAKVCache)
    return dense_causal_attention(q_new, cache.keys, cache.values, cache.start, validation.check_scale(scale))
