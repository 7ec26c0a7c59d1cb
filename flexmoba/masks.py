"""Every form of the attention mask, each a boolean predicate over (query, key).

MoBA's: query t attends key s iff they share a document, ``s <= t``, and t selected the chunk
holding s. :func:`moba_mask_mod` states it for FlexAttention (one element at a time);
:func:`dense_moba_mask` materialises it as ``[B, H, S, S]`` for SDPA and the reference,
:func:`dense_moba_rows` for some queries at any place of the keys, :func:`local_moba_mask` for a
context-parallel rank's queries, and :func:`decode_moba_mask` for new queries against a KV cache.
Full attention's: :func:`causal_document_rows` (causal within documents, queries at an offset) and
:func:`cache_causal_mask` (new queries against a left-padded cache). ``tests/test_masks.py`` holds each
to its element-by-element definition.

(The flex plan's virtual-row mask and the sliding window's band are each their kernel's own layout,
beside it.)
"""

from __future__ import annotations

import math

import torch

from flexmoba.gate import Selection

__all__ = ["cache_causal_mask", "causal_document_rows", "check_flex_index", "decode_moba_mask", "dense_moba_mask",
           "dense_moba_rows", "largest_offset", "local_moba_mask", "moba_mask_mod", "selected_chunk_ids"]

# Some FlexAttention versions inline a mask_mod's loads from captured tensors with int32
# index arithmetic: an element past offset 2**31 - 1 is then read from the wrong place and
# the mask is silently wrong. Every mask_mod and score_mod flexmoba builds checks the
# tensors it captures with check_flex_index.
MAX_FLEX_OFFSET = 2**31 - 1

UNION_WAY_OUT = ("use backend='flex' at token granularity (the regrouped plan's mask_mod indexes [B, H_kv, L] "
                 "virtual rows), else backend='gather' or a smaller batch")


def largest_offset(x: torch.Tensor | tuple[int, ...]) -> int:
    """The largest element offset a load from ``x`` computes (a shape: a contiguous tensor of it)."""
    if isinstance(x, torch.Tensor):
        shape, stride, start = tuple(x.shape), x.stride(), x.storage_offset()
    else:
        shape, stride, start = tuple(x), None, 0
    if math.prod(shape) == 0:
        return start
    if stride is None:
        return math.prod(shape) - 1
    return start + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def check_flex_index(name: str, x: torch.Tensor | tuple[int, ...], way_out: str) -> None:
    """Refuse a tensor (or the shape of a contiguous one) a mask_mod would index past int32."""
    offset = largest_offset(x)
    if offset > MAX_FLEX_OFFSET:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else list(x)
        raise ValueError(f"{name} {shape} reaches element offset {offset:,}, past the {MAX_FLEX_OFFSET:,} "
                         f"(2**31 - 1) that FlexAttention may index in int32 (a silently wrong mask); {way_out}")


def selected_chunk_ids(selection: Selection) -> torch.Tensor:
    """``[B, H, S, P]`` int32: each query's selected past chunks (local indices), ``-1`` in unused slots."""
    return torch.where(selection.past_valid, selection.past_chunks, -1).to(torch.int32)


def moba_mask_mod(selection: Selection):
    """FlexAttention ``mask_mod`` that encodes the whole selection.

    It is exact on its own (eager flex applies only the mask_mod); the block tables only
    accelerate it. It reads each query's ``P = top_k - 1`` selected chunk ids (``[B, H, S, P]``,
    linear in S) and compares them with the key's chunk, so no ``[S, n_chunks]`` table exists.
    Every mask it returns shares one code object and captures tensors of fixed shapes, so a
    new mask of an unchanged shape does not recompile.

    Raises ``ValueError`` when a captured tensor reaches past int32 offsets (:func:`check_flex_index`).
    """
    chunk_ids = selected_chunk_ids(selection)
    doc_start = selection.layout.doc_start
    local_chunk = selection.layout.local_chunk
    for name, captured in (("selection.past_chunks", chunk_ids), ("layout.doc_start", doc_start),
                           ("layout.local_chunk", local_chunk)):
        check_flex_index(name, captured, UNION_WAY_OUT)
    slots = tuple(range(chunk_ids.shape[-1]))

    def mask_mod(b, h, q_idx, kv_idx):
        causal = kv_idx <= q_idx
        same_document = doc_start[b, q_idx] == doc_start[b, kv_idx]
        key_chunk = local_chunk[b, kv_idx]
        selected = key_chunk == local_chunk[b, q_idx]  # the own chunk
        for p in slots:
            selected = selected | (chunk_ids[b, h, q_idx, p] == key_chunk)
        return causal & same_document & selected

    return mask_mod


def dense_moba_mask(selection: Selection) -> torch.Tensor:
    """``[B, H, S, S]`` bool: the same predicate as :func:`moba_mask_mod`, materialised."""
    B, H, S, _ = selection.past_chunks.shape
    layout = selection.layout
    positions = torch.arange(S, device=selection.past_chunks.device)
    causal = positions[None, :] <= positions[:, None]  # [S(q), S(kv)]
    same_document = layout.doc_start[:, :, None] == layout.doc_start[:, None, :]  # [B, S, S]
    key_chunk = layout.local_chunk[:, None, None, :].expand(B, H, S, S)
    return selection.chunks.gather(-1, key_chunk) & (causal & same_document)[:, None]


def dense_moba_rows(selection: Selection, positions: torch.Tensor, key_len: int,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, R, key_len]`` bool: key s is attended by query ``rows[i]`` of the selection (all of them
    when ``rows`` is None), at absolute position ``t = positions[i]``, iff s lies in t's document up to t
    and in a chunk t selected."""
    layout = selection.layout
    chunks, doc_start = selection.chunks, layout.doc_start
    if rows is not None:
        chunks, doc_start = chunks[:, :, rows], doc_start[:, rows]
    B, H, R, n_chunks = chunks.shape
    s = torch.arange(key_len, device=doc_start.device)
    offset = s[None, None, :] - doc_start[:, :, None]  # [B, R, T] from the query's document start
    visible = (offset >= 0) & (s[None, None, :] <= positions[None, :, None])
    chunk = (offset.clamp(min=0) // layout.chunk_size).clamp(max=n_chunks - 1)
    selected = chunks.gather(-1, chunk[:, None].expand(B, H, R, key_len))
    return selected & visible[:, None]


def local_moba_mask(selection: Selection, query_start: int, key_len: int) -> torch.Tensor:
    """``[B, H, S, key_len]`` bool: the keys each query of the selection, at ``t = query_start + i``, attends
    (a context-parallel rank's rows)."""
    positions = query_start + torch.arange(selection.past_chunks.shape[2], device=selection.past_chunks.device)
    return dense_moba_rows(selection, positions, key_len)


def decode_moba_mask(step) -> torch.Tensor:
    """``[B, H, S_new, T]`` bool: the keys each new query of a decode step attends (``step``: a
    :class:`flexmoba.backends.protocol.DecodeStep`): its selected past chunks whole and its own chunk up to
    itself, from its row's ``start`` on; a padding query attends only itself."""
    q, keys, q_pos, own, start = step.q, step.keys, step.q_pos, step.own, step.sums.start
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
    return torch.where(q_pad, key_pos == q_pos[:, None], allowed)


def causal_document_rows(query_start: int, length: int, key_len: int, doc_start: torch.Tensor) -> torch.Tensor:
    """``[B, 1, length, key_len]`` bool: full causal attention within documents: key s for the query at
    ``t = query_start + i`` iff ``doc_start[b, i] <= s <= t`` (``doc_start: [B, length]``, the start of each
    query's document)."""
    t = query_start + torch.arange(length, device=doc_start.device)
    s = torch.arange(key_len, device=doc_start.device)
    return ((s[None, None, :] <= t[None, :, None]) & (s[None, None, :] >= doc_start[:, :, None]))[:, None]


def cache_causal_mask(start: torch.Tensor, T: int, S_new: int, device) -> torch.Tensor:
    """``[B, S_new, T]`` bool: full causal attention of the last ``S_new`` of ``T`` cached positions, rows left-padded
    up to ``start: [B]`` (a real query attends every real key up to itself, a padding query only itself)."""
    q_pos = T - S_new + torch.arange(S_new, device=device)
    key_pos = torch.arange(T, device=device)
    key_real = key_pos[None, :] >= start[:, None]  # [B, T]
    causal = key_pos[None, :] <= q_pos[:, None]  # [S_new, T]
    q_pad = (q_pos[None, :] < start[:, None])[:, :, None]  # [B, S_new, 1]
    return torch.where(q_pad, key_pos == q_pos[:, None], key_real[:, None, :] & causal)
