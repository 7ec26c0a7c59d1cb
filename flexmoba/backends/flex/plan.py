"""Exact, block-sparse MoBA through FlexAttention: queries regrouped by the keys they read.

A union BlockMask over the original query order is dense in practice: the queries of one
tile select different chunks, so the tile visits the union of their selections. Here every
(query, selected chunk) pair becomes one row of a *virtual query sequence*, one per KV head:

    [ own rows:  each of the group's query heads, its S queries in order, padded to a block ]
    [ past rows: (query, past chunk) pairs sorted by chunk, each chunk's pairs padded to
                 whole blocks, then unused blocks up to a static length                   ]

Every virtual row attends one contiguous key interval: its own chunk up to itself, or one
whole past chunk. A block of past rows therefore reads exactly one chunk's key blocks
(all "full" when chunks align with key blocks) and own blocks are block-diagonal causal,
so the kernel's work follows the real selection. Flex returns each row's output and
log-sum-exp; a query's rows are merged by log-sum-exp into its exact MoBA output.

The query heads of a KV group share one virtual sequence (GQA without repeating K/V), so
a chunk's keys are read once for all of the group's pairs that selected it, and the
padding per chunk is paid once per group instead of once per head.

The virtual length depends only on (B, H, H_kv, S, chunk_size, top_k, block size), never on
the selection, so one compiled kernel serves every step of a run.

The GPU path: flex returns each row's log-sum-exp, and the merge is differentiable in both, so
gradients reach q, k and v through flex's output and its LSE. Nothing on it reads a
tensor back to the host (no ``.item()``, ``bool(tensor)`` or ``nonzero``).

Log-sum-exp with the compiled CPU kernel. It cannot return it (torch 2.11-2.14), so the plan
appends a *sink* key at index S, scored by the ``score_mod`` at a per-row constant ``c``,
whose value is a one-hot extra column of V. The output's extra column is then
``p = exp(c - LSE')`` (``LSE'`` over the real keys and the sink), so

    LSE = c + log(1 - p) - log(p),        out = out' / (1 - p).

``c`` keeps ``p`` well inside (0, 1): the diagonal score for own rows (then ``p <= 1/2``)
and ``q . mean(k_chunk) * scale`` for past rows (by Jensen ``p <= 1 / (C + 1)``). Where
extreme logits underflow ``p`` the row's LSE is recomputed directly (rare; it reads which
rows on the host, which on CPU is no device sync). The sink is the compiled CPU kernel's
path only (:func:`flexmoba.backends.flex.compiled.needs_sink`), never the GPU's.

Memory linear in S. A block of virtual rows reads at most a handful of key blocks, so the plan
keeps its block tables only that wide (``[B, H_kv, L / Bq, W]``). The kernels take tables as wide
as every key block (compiled CPU flex refuses narrower ones; torch transposes them for the
backward by their width), so the virtual rows run in equal pieces, each widened only while it
runs, with at most ``Tuning.flex_table_entries`` entries per table. With more than one piece
and gradients, the forward keeps no virtual rows and each piece's flex call runs again in the
backward (:mod:`flexmoba.backends.flex.recompute`), so one piece's tables and rows are alive at a time.
The merge accumulates one slot at a time (:mod:`flexmoba.lse_merge`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask

from flexmoba import validation
from flexmoba.backends.flex.block_mask import DEFAULT_BLOCK_SIZE, listed_first
from flexmoba.backends.flex.compiled import active_flex_attention, needs_sink
from flexmoba.backends.flex.recompute import recomputed_attention
from flexmoba.gate import Selection, select_chunks
from flexmoba.index_math import exclusive_cumsum, sort_key_dtype
from flexmoba.lse_merge import merge_by_lse
from flexmoba.masks import check_flex_index
from flexmoba.pair_counts import past_chunk_slots
from flexmoba.spec import MobaSpec, takes_settings
from flexmoba.tuning import tuning_for

__all__ = ["MoBAFlexPlan", "moba_flex_plan", "plan_from_selection"]

# Below this the sink's p carries too few significant bits to give LSE to fp32 precision.
SINK_MIN_P = 1e-30

PLAN_WAY_OUT = "split the batch, or use backend='gather'"


@dataclass(frozen=True)
class MoBAFlexPlan:
    """Virtual query rows for one selection, their block tables, and how flex runs them.

    Attributes:
        tables: ``(partial count, partial indices, full count, indices)`` of the virtual rows'
            query blocks, counts ``[B, H_kv, L / Bq]`` and indices ``[B, H_kv, L / Bq, W]`` int32:
            each block's listed key blocks first, W no wider than a block of rows can read.
        block_size: FlexAttention's ``(Q, KV)`` block.
        kv_len: keys ``S`` (``S + 1`` with the sink key).
        pieces: the virtual rows run in this many equal pieces (a multiple of ``Bq`` rows each).
        compute_q_blocks: the pieces' masks carry the transposed tables the backward reads (built
            only while gradients are enabled: not in a forward whose backward recomputes it).
        key_start, key_end: ``[B, H_kv, L]`` the key interval ``[start, end)`` of each virtual
            row; empty for padding rows.
        source: ``[B, H_kv, L]`` which query feeds each virtual row, as ``head_in_group * S + t``.
        rows: ``[B, H, S, K]`` virtual row of each (query, slot); slot 0 is the own chunk.
        valid: ``[B, H, S, K]`` whether the slot is used.
        sink: whether the plan carries the sink key (log-sum-exp on CPU).
        own_len: virtual rows ``[0, own_len)`` are own rows, the rest past rows.
        selection: the gate's selection the plan was built from.
    """

    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    block_size: tuple[int, int]
    kv_len: int
    pieces: int
    compute_q_blocks: bool
    key_start: torch.Tensor
    key_end: torch.Tensor
    source: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    sink: bool
    own_len: int
    selection: Selection

    @property
    def virtual_len(self) -> int:
        return self.source.shape[-1]

    @property
    def sink_at(self) -> int | None:
        return self.kv_len - 1 if self.sink else None

    @property
    def block_mask(self) -> BlockMask:
        """The whole plan's ``BlockMask`` over virtual rows ``[B, H_kv, L]`` x keys ``[kv_len]``, its
        tables as wide as every key block (quadratic in S: for inspection and short sequences)."""
        return self.piece_block_mask(0, self.virtual_len)

    def piece_block_mask(self, start: int, end: int) -> BlockMask:
        """The ``BlockMask`` of virtual rows ``[start, end)`` (multiples of ``Bq``), tables widened to
        every key block."""
        Bq, Bk = self.block_size
        n_blocks = -(-self.kv_len // Bk)
        first, last = start // Bq, -(-end // Bq)

        def widened(indices):
            indices = indices[:, :, first:last]
            width = indices.shape[-1]
            return indices[..., :n_blocks] if width >= n_blocks else F.pad(indices, (0, n_blocks - width))

        partial_count, partial, full_count, full = self.tables
        mask_mod = _interval_mask_mod(self.key_start[:, :, start:end].contiguous(),
                                      self.key_end[:, :, start:end].contiguous(), self.sink_at)
        return BlockMask.from_kv_blocks(
            partial_count[:, :, first:last], widened(partial), full_count[:, :, first:last], widened(full),
            BLOCK_SIZE=self.block_size, mask_mod=mask_mod, seq_lengths=(end - start, self.kv_len),
            compute_q_blocks=self.compute_q_blocks and torch.is_grad_enabled())

    def visited_area(self) -> int:
        """(query, key) pairs in the key blocks the kernel visits, the sink key's block excluded."""
        Bq, Bk = self.block_size
        sink_block = (self.kv_len - 1) // Bk if self.sink else -1
        blocks = 0
        partial_count, partial, full_count, full = self.tables
        for num, idx in ((partial_count, partial), (full_count, full)):
            listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
            blocks += int((listed & (idx != sink_block)).sum())
        return blocks * Bq * Bk

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                  flex: Callable | None = None) -> torch.Tensor:
        """MoBA of ``q: [B, H, S, D]`` over ``k, v: [B, H_kv, S, D]`` -> ``[B, H, S, Dv]``.

        A plan built with ``query_start=o`` takes ``k, v: [B, H_kv, o + S, D]``.

        ``flex`` defaults to the active flex (:func:`flexmoba.backends.flex.compiled.active_flex_attention`:
        the compiled kernel unless ``use_flex_attention`` set another); any callable with its
        signature works (e.g. eager ``flex_attention``). Without the sink, ``flex`` must
        return the log-sum-exp (``return_aux``).
        """
        flex = active_flex_attention() if flex is None else flex
        scale = validation.softmax_scale(scale, q)
        if self.sink:
            out, lse = _flex_with_sink(flex, self, q, k, v, scale)
        elif self.pieces > 1 and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return recomputed_attention(self, flex, q, k, v, scale)
        else:
            out, lse = self.run_in_pieces(flex, q, k, v, scale)
        return merge_by_lse(out, lse, self.rows, self.valid)

    def run_in_pieces(self, flex: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                      sink_scores: torch.Tensor | None = None,
                      virtual_q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flex over the virtual rows of ``q: [B, H, S, D]``, piece by piece -> (out ``[B, H_kv, L, Dv]``,
        lse ``[B, H_kv, L]``), or (out, None) with the sink's scores ``sink_scores: [B, H_kv, L]`` (then
        ``k, v`` carry the sink key). Each piece gathers its rows of ``q`` (or slices ``virtual_q:
        [B, H_kv, L, D]`` when given)."""
        length = self.virtual_len // self.pieces
        outs, lses = [], []
        for start in range(0, self.virtual_len, length):
            end = start + length
            out, lse = self.flex_piece(
                flex, start, end, scale, q, k, v,
                sink_scores=None if sink_scores is None else sink_scores[:, :, start:end].contiguous(),
                virtual_q=None if virtual_q is None else virtual_q[:, :, start:end])
            outs.append(out)
            lses.append(lse)
        if self.pieces == 1:
            return outs[0], lses[0]
        return torch.cat(outs, 2), None if sink_scores is not None else torch.cat(lses, 2)

    def flex_piece(self, flex: Callable, start: int, end: int, scale: float, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, *, sink_scores: torch.Tensor | None = None,
                   virtual_q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One flex call over virtual rows ``[start, end)``: (out ``[B, H_kv, end - start, Dv]``, lse), or
        (out, None) with the sink's scores of those rows."""
        virtual_q = self.gather_queries(q, start, end) if virtual_q is None else virtual_q
        block_mask = self.piece_block_mask(start, end)
        if sink_scores is None:
            out, aux = flex(virtual_q, k, v, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
            return out, aux.lse
        sink_at = self.sink_at

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx == sink_at, sink_scores[b, h, q_idx].to(score.dtype), score)

        return flex(virtual_q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale), None

    def gather_queries(self, q: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """``[B, H, S, ...]`` -> ``[B, H_kv, end - start, ...]``: what the query feeding each virtual row
        of ``[start, end)`` (default: all ``L``) holds: its vector, or any per-query value."""
        B, H, S = q.shape[:3]
        H_kv = self.source.shape[1]
        grouped = q.reshape(B, H_kv, (H // H_kv) * S, *q.shape[3:])
        index = self.source[:, :, start:end].reshape(B, H_kv, -1, *([1] * (q.dim() - 3)))
        return grouped.gather(2, index.expand(-1, -1, -1, *q.shape[3:]))


def virtual_lengths(heads_per_kv: int, seq_len: int, chunk_size: int, top_k: int, block_q: int,
                    query_start: int = 0) -> tuple[int, int]:
    """Static ``(own rows, past rows)`` of the virtual sequence: bounds over every selection.

    ``query_start``: the queries are positions ``[query_start, query_start + seq_len)``.

    A query at offset t of its document has at most ``min(top_k - 1, t // chunk_size)``
    past chunks, and ``t`` is at most its position, so the no-document count bounds every
    document split. Past chunks are whole chunks with a later chunk after them, so at most
    ``(S - 1) // chunk_size`` distinct chunks are read, each padding its group by less than
    a block.
    """
    own = heads_per_kv * -(-seq_len // block_q) * block_q
    end = query_start + seq_len
    pairs = past_chunk_slots(end, chunk_size, top_k) - past_chunk_slots(query_start, chunk_size, top_k)
    groups = min((end - 1) // chunk_size, heads_per_kv * pairs)
    past_blocks = (heads_per_kv * pairs + groups * (block_q - 1)) // block_q
    return own, past_blocks * block_q


def _own_rows(selection: Selection, H_kv: int, own_len: int, query_start: int = 0):
    """Intervals and sources of the own rows, and the own slot's virtual row ``[B, H, S]``."""
    layout = selection.layout
    B, H, S, _ = selection.past_chunks.shape
    G = H // H_kv
    padded = own_len // G
    positions = torch.arange(padded, device=layout.doc_start.device)
    real = positions < S
    t = positions.clamp(max=S - 1)
    start = torch.where(real, layout.chunk_start[:, t], 0)  # [B, padded]
    end = torch.where(real, positions + 1 + query_start, 0).expand(B, padded)
    head = torch.arange(G, device=positions.device)[:, None]
    source = (head * S + t).reshape(1, 1, G * padded).expand(B, H_kv, -1)
    own_row = (head * padded + positions[:S]).expand(B, H_kv, G, S).reshape(B, H, S)
    expand = lambda x: x[:, None, None, :].expand(B, H_kv, G, padded).reshape(B, H_kv, own_len)  # noqa: E731
    return expand(start), expand(end), source, own_row


def _past_rows(selection: Selection, H_kv: int, own_len: int, past_len: int, block_q: int):
    """Intervals and sources of the past rows, each past slot's virtual row ``[B, H, S, P]``, and
    each block of past rows' one interval ``(start, end)``, each ``[B, H_kv, past_len / block_q]``.

    Pairs are bucketed by global chunk (``n`` buckets per KV row), each bucket padded to whole blocks.
    """
    layout = selection.layout
    B, H, S, P = selection.past_chunks.shape
    G, c, n = H // H_kv, layout.chunk_size, layout.n_global_chunks
    R = B * H_kv
    device = selection.past_chunks.device

    global_chunk = layout.first_global_chunk[:, None, :, None] + selection.past_chunks  # [B, H, S, P]
    # Masks enter as 0/1 factors: on CPU torch.where costs several times the arithmetic.
    key = (n - selection.past_valid * (n - global_chunk)).reshape(R, G * S * P)  # n: unused
    counts = torch.zeros(R, n + 1, dtype=torch.long, device=device).scatter_add_(1, key, torch.ones_like(key))
    chunk_start = (layout.doc_start[:, None, :, None] + selection.past_chunks * c).reshape(R, G * S * P)
    key_start = torch.zeros_like(counts).scatter_(1, key, chunk_start)[:, :n]  # every pair of a bucket agrees
    counts = counts[:, :n]
    blocks = (counts + block_q - 1) // block_q
    first_row = own_len + exclusive_cumsum(blocks) * block_q  # [R, n] first virtual row of each chunk

    sorted_key, order = _sort_rows(key, n + 1)
    # A pair's virtual row: its chunk's first row plus its place among the chunk's pairs in sorted order.
    first_row_less_place = F.pad(first_row - exclusive_cumsum(counts), (0, 1))  # [R, n + 1]; n: unused
    place = torch.arange(key.shape[1], device=device)
    row_sorted = (first_row_less_place.gather(1, sorted_key) + place) * (sorted_key < n)  # unused pairs: row 0
    rows = torch.empty_like(row_sorted).scatter_(1, order, row_sorted)  # [R, G*S*P]

    # Pair m of a row is slot m % P of query m // P (head_in_group * S + t). Unused pairs write to
    # row 0, an own row, cut off here.
    source = torch.zeros(R, own_len + past_len, dtype=torch.long, device=device)
    source = source.scatter_(1, row_sorted, torch.div(order, P, rounding_mode="floor"))[:, own_len:]

    # Each block of past rows reads the one chunk it was laid out for.
    n_blocks = past_len // block_q
    block_index = torch.arange(n_blocks, device=device).expand(R, n_blocks).contiguous()
    block_chunk = torch.searchsorted(torch.cumsum(blocks, dim=1), block_index, right=True)  # n where unused
    used = block_chunk < n
    block_start = torch.where(used, key_start.gather(1, block_chunk.clamp(max=n - 1)), 0)
    block_end = torch.where(used, block_start + c, 0)
    start, end = block_start.repeat_interleave(block_q, dim=1), block_end.repeat_interleave(block_q, dim=1)
    view = lambda x: x.view(B, H_kv, -1)  # noqa: E731
    return view(start), view(end), view(source), rows.view(B, H, S, P), (view(block_start), view(block_end))


def _sort_rows(key: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of each row of ``key: [R, M]`` (values in ``[0, bound)``) -> (sorted, order), each
    ``[R, M]`` int64. One flat sort of ``row * bound + key`` in the smallest integer type that holds
    it: on CPU torch sorts one flat small-int tensor ~10x faster than the same keys by rows."""
    R, M = key.shape
    row = torch.arange(R, device=key.device)[:, None]
    flat, order = torch.sort((row * bound + key).to(sort_key_dtype(R * bound - 1)).flatten(), stable=True)
    return flat.view(R, M) - row * bound, order.view(R, M) - row * M


def _own_tables(chunk_start: torch.Tensor, query_start: int, padded: int, H_kv: int, chunk_size: int,
                block_size: tuple[int, int], kv_len: int, sink_at: int | None) -> tuple[torch.Tensor, ...]:
    """Block tables (partial count, indices, full count, indices) of one query head's own rows,
    each ``[B, H_kv, padded / Bq, ...]`` (a view): every query head's own rows read the same keys,
    so their tables are built once, from ``chunk_start: [B, S]`` (the first key of each query's chunk).

    Own row t attends keys ``[chunk_start[t], query_start + t + 1)`` and the sink; rows from S on
    attend nothing. Both bounds never decrease with t, so in a query block the rows reaching key
    block j are those from the first one ending past j's first key, whose start is their lowest:
    each (query block, key block) entry needs that row's start and the block's end rows, no
    per-row counting. A block's rows read fewer than ``chunk_size + Bq`` keys from its first row's
    chunk start, so only the key blocks there are candidates: ``[B, T, W]``, not every key block.
    """
    Bq, Bk = block_size
    B, S = chunk_start.shape
    device = chunk_start.device
    real_keys = kv_len if sink_at is None else sink_at
    first_row = torch.arange(0, padded, Bq, device=device)[:, None]  # [T, 1]
    last_row = (first_row + Bq).clamp(max=S) - 1  # [T, 1]; < first_row: no real row
    lowest = chunk_start[:, first_row[:, 0].clamp(max=S - 1)]  # [B, T]
    window = torch.arange((chunk_size + Bq - 2) // Bk + 2, device=device)
    block = (lowest // Bk)[..., None] + window  # [B, T, W], increasing
    first_key = block * Bk
    key_end = (first_key + Bk).clamp(max=real_keys)
    has_keys = key_end > first_key  # false past the real keys
    reaching = torch.maximum(first_row, first_key - query_start)  # first row ending past first_key
    starts = chunk_start.gather(1, reaching.clamp(max=S - 1).flatten(1)).view_as(reaching)
    attends = has_keys & (reaching <= last_row) & (starts < key_end)  # [B, T, W]
    complete = first_row + Bq <= S  # [T, 1] every row real
    covered = (chunk_start[:, last_row.clamp(max=S - 1)] <= first_key) & (query_start + first_row + 1 >= key_end)
    full = complete & has_keys & covered
    if sink_at is not None:  # every real row reads the sink
        real_row, sink_block = first_row < S, sink_at // Bk
        holds_sink = block == sink_block
        attends = attends | (holds_sink & real_row)
        full = full | (holds_sink & ~has_keys & complete)  # the sink alone in its block
        beyond = real_row & (block[..., -1:] < sink_block)  # the window stops before the sink's block
        block = torch.cat([block, torch.full_like(block[..., :1], sink_block)], -1)
        attends = torch.cat([attends, beyond], -1)
        full = torch.cat([full, beyond & complete & (sink_block * Bk >= real_keys)], -1)
    width = block.shape[-1]
    tables = (*listed_first(attends & ~full, block, width), *listed_first(full, block, width))
    return tuple(t[:, None].expand(-1, H_kv, *t.shape[1:]) for t in tables)


def _past_tables(start: torch.Tensor, end: torch.Tensor, span: int, block_size: tuple[int, int], kv_len: int,
                 sink_at: int | None) -> tuple[torch.Tensor, ...]:
    """Block tables (partial count, indices, full count, indices) of the past rows, whose n blocks
    each read one interval ``[start, end)`` of at most ``span`` keys with all their rows
    (``start, end: [B, H_kv, n]``, empty for unused blocks), plus the sink key.

    An interval touches at most ``ceil(span / Bk) + 1`` consecutive key blocks, so only those
    (and the sink's) are candidates, and the tables are that wide: ``[B, H_kv, n, W]``.
    """
    Bq, Bk = block_size
    window = torch.arange(-(-span // Bk) + 1, device=start.device)
    block = (start // Bk)[..., None] + window  # [B, H_kv, n, W], increasing
    block_len = ((block + 1) * Bk).clamp(max=kv_len) - block * Bk  # <= 0 past the last key block
    overlap = (torch.minimum(end[..., None], block_len + block * Bk) - torch.maximum(start[..., None], block * Bk))
    overlap = overlap.clamp(min=0)
    if sink_at is not None:
        used = (end > start)[..., None]
        sink_block = sink_at // Bk
        overlap = overlap + ((block == sink_block) & used)
        beyond = used & (block[..., -1:] < sink_block)  # the window stops before the sink's block
        block = torch.cat([block, torch.full_like(block[..., :1], sink_block)], -1)
        overlap = torch.cat([overlap, beyond.long()], -1)
        block_len = torch.cat([block_len, torch.full_like(block_len[..., :1], kv_len - sink_block * Bk)], -1)
    full = (overlap == block_len) & (overlap > 0)
    width = block.shape[-1]
    return (*listed_first((overlap > 0) & ~full, block, width), *listed_first(full, block, width))


def _check_intervals(key_start: torch.Tensor, key_end: torch.Tensor) -> None:
    """Refuse rows ``[B, H_kv, L]`` past int32 offsets; the sink's score_mod indexes a tensor of
    the same shape, so this check covers it too."""
    for name, captured in (("plan.key_start", key_start), ("plan.key_end", key_end)):
        check_flex_index(name, captured, PLAN_WAY_OUT)


def _interval_mask_mod(key_start: torch.Tensor, key_end: torch.Tensor, sink_at: int | None):
    """Virtual row r attends keys in ``[key_start[r], key_end[r])`` (and the sink key); the plan
    checked the rows' offsets (:func:`_check_intervals`)."""
    if sink_at is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx >= key_start[b, h, q_idx]) & (kv_idx < key_end[b, h, q_idx])
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            in_interval = (kv_idx >= key_start[b, h, q_idx]) & (kv_idx < key_end[b, h, q_idx])
            return in_interval | ((kv_idx == sink_at) & (key_end[b, h, q_idx] > 0))
    return mask_mod


def plan_from_selection(selection: Selection, kv_heads: int, *, block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
                        sink: bool = False, compute_q_blocks: bool = False, query_start: int = 0) -> MoBAFlexPlan:
    """The :class:`MoBAFlexPlan` of an already computed selection.

    ``query_start``: the selection's S queries are positions ``[query_start, query_start + S)``
    of keys ``[0, query_start + S)`` (its layout holds their rows; :mod:`flexmoba.context_parallel`).
    """
    Bq, Bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    B, H, S, P = selection.past_chunks.shape
    G = H // kv_heads
    T = query_start + S
    # Past slots only exist where some query may have a past chunk.
    own_len, past_len = virtual_lengths(G, S, selection.layout.chunk_size, selection.spec.top_k, Bq, query_start)
    with torch.no_grad():
        kv_len, sink_at = T + int(sink), T if sink else None
        own_start, own_end, own_source, own_row = _own_rows(selection, kv_heads, own_len, query_start)
        own_tables = _own_tables(selection.layout.chunk_start, query_start, own_len // G, kv_heads,
                                 selection.layout.chunk_size, (Bq, Bk), kv_len, sink_at)
        if P > 0:
            past_start, past_end, past_source, past_row, past_intervals = _past_rows(
                selection, kv_heads, own_len, past_len, Bq)
            key_start = torch.cat([own_start, past_start], 2)
            key_end = torch.cat([own_end, past_end], 2)
            source = torch.cat([own_source, past_source], 2)
            rows = torch.cat([own_row[..., None], past_row], -1)
            past_tables = [[t] for t in _past_tables(*past_intervals, selection.layout.chunk_size, (Bq, Bk),
                                                     kv_len, sink_at)]
        else:
            key_start, key_end, source, rows = own_start, own_end, own_source.contiguous(), own_row[..., None]
            past_tables = [[]] * 4
        # The own rows' tables once per query head of the group, then the past rows'.
        tables = _joined_tables(own_tables, past_tables, G)
        valid = F.pad(selection.past_valid, (1, 0), value=True)  # own slot first
        _check_intervals(key_start, key_end)
        pieces, extra_blocks = _pieces(key_start.shape[-1] // Bq, B * kv_heads * -(-kv_len // Bk),
                                       tuning_for(key_start.device).flex_table_entries)
        if extra_blocks:  # padding rows, attending nothing, make the pieces equal (one compiled shape)
            key_start, key_end, source = (F.pad(x, (0, extra_blocks * Bq)) for x in (key_start, key_end, source))
            tables = tuple(F.pad(t, (0, 0) * (t.dim() - 3) + (0, extra_blocks)) for t in tables)
    return MoBAFlexPlan(tables, (Bq, Bk), kv_len, pieces, compute_q_blocks, key_start, key_end, source, rows, valid,
                        sink, own_len, selection)


def _joined_tables(own_tables, past_tables, G: int) -> tuple[torch.Tensor, ...]:
    """The own rows' tables once per query head of the group, then the past rows', the indices
    padded to one width."""
    width = max(t.shape[-1] for t in (own_tables[1], *past_tables[1]))
    fit = lambda t: t if t.dim() == 3 else F.pad(t, (0, width - t.shape[-1]))  # noqa: E731
    return tuple(torch.cat([fit(own)] * G + [fit(t) for t in past], 2)
                 for own, past in zip(own_tables, past_tables, strict=True))


def _pieces(blocks: int, entries_per_block: int, budget: int) -> tuple[int, int]:
    """``(pieces, padding blocks)``: ``blocks`` query blocks, each ``entries_per_block`` table entries
    wide once widened, in equal pieces of at most ``budget`` entries (at least one block each)."""
    per_piece = max(1, budget // entries_per_block)
    pieces = -(-blocks // per_piece)
    return pieces, pieces * -(-blocks // pieces) - blocks


def _sink_scores(plan: MoBAFlexPlan, virtual_q: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """``[B, H_kv, L]`` fp32 sink score per virtual row: the diagonal score ``q_t . k_t`` of
    own rows (``p <= 1/2``), the score against the chunk's mean key for past rows (``p <= 1/(C+1)``)."""
    B, H_kv, _, D = k.shape
    G, S = q.shape[1] // H_kv, q.shape[2]
    own_keys = k[:, :, k.shape[2] - S:]  # the queries' own positions: the last S keys
    diagonal = (q.float().view(B, H_kv, G, S, D) * own_keys.float()[:, :, None]).sum(-1)  # [B, H_kv, G, S]
    own = F.pad(diagonal, (0, plan.own_len // G - S)).view(B, H_kv, plan.own_len)
    Bq = plan.block_size[0]
    start = plan.key_start[:, :, plan.own_len::Bq]  # [B, H_kv, n_blocks]: past blocks read one chunk each
    end = plan.key_end[:, :, plan.own_len::Bq]
    prefix = F.pad(k.float().cumsum(2), (0, 0, 1, 0))  # [B, H_kv, S + 1, D]
    at = lambda index: prefix.gather(2, index[..., None].expand(-1, -1, -1, D))  # noqa: E731
    means = (at(end) - at(start)) / (end - start).clamp(min=1)[..., None]
    past_q = virtual_q[:, :, plan.own_len:].float().view(B, H_kv, -1, Bq, D)
    past = (past_q * means[:, :, :, None]).sum(-1).view(B, H_kv, -1)
    score = torch.cat([own, past], -1) * scale
    return torch.nan_to_num(score, nan=0.0, posinf=0.0, neginf=0.0)


def _flex_with_sink(flex, plan: MoBAFlexPlan, q, k, v, scale):
    """Flex over keys plus the sink; returns (out ``[B, H_kv, L, Dv]``, lse ``[B, H_kv, L]`` fp32)."""
    B, H_kv, S, Dv = v.shape
    virtual_q = plan.gather_queries(q)
    c = _sink_scores(plan, virtual_q, q, k, scale)
    k_ext = torch.cat([k, k.new_zeros(B, H_kv, 1, k.shape[-1])], 2)
    v_ext = v.new_zeros(B, H_kv, S + 1, Dv + 1)
    v_ext[:, :, :S, :Dv] = v
    v_ext[:, :, S, Dv] = 1
    out, _ = plan.run_in_pieces(flex, q, k_ext, v_ext, scale, sink_scores=c, virtual_q=virtual_q)
    p = out[..., Dv].float()
    lse = c + torch.log1p(-p) - torch.log(p)
    out = out[..., :Dv] / (1 - p[..., None]).to(out.dtype)
    tiny = (p < SINK_MIN_P) & (plan.key_end > 0)
    if bool(tiny.any()):  # CPU only: no device sync
        lse = lse.masked_scatter(tiny, _direct_lse(plan, virtual_q, k, scale, tiny))
    return out, lse


def _direct_lse(plan: MoBAFlexPlan, virtual_q, k, scale, rows: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp of the selected virtual ``rows`` (``[B, H_kv, L]`` bool) computed directly."""
    b, h, r = rows.nonzero(as_tuple=True)
    start, end = plan.key_start[b, h, r], plan.key_end[b, h, r]
    span = plan.selection.layout.chunk_size
    keys = start[:, None] + torch.arange(span, device=k.device)
    inside = keys < end[:, None]
    logits = (k[b[:, None], h[:, None], keys.clamp(max=k.shape[2] - 1)].float()
              @ virtual_q[b, h, r].float()[:, :, None])[..., 0] * scale
    return torch.logsumexp(logits.masked_fill(~inside, float("-inf")), dim=-1)


@takes_settings
def moba_flex_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: MobaSpec,
    *,
    document_ids: torch.Tensor | None = None,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    sink: bool | None = None,
) -> MoBAFlexPlan:
    """Gate ``q`` against ``k`` and plan exact, block-sparse MoBA through FlexAttention.

    Args:
        q: ``[B, H, S, D]``; k: ``[B, H_kv, S, D]``.
        spec (or chunk_size, top_k, granularity), document_ids: as in :func:`flexmoba.moba_selection`.
        block_size: FlexAttention's ``(Q, KV)`` block (an int for both); on GPU a multiple of 128.
        sink: recover the log-sum-exp with a sink key (default: with the compiled kernel on
            CPU, which cannot return it; see :func:`flexmoba.backends.flex.compiled.needs_sink`).

    Returns:
        A :class:`MoBAFlexPlan`; ``plan.attention(q, k, v)`` runs it.
    """
    selection = select_chunks(q, k, spec, document_ids=document_ids)
    sink = needs_sink(q.device) if sink is None else bool(sink)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    return plan_from_selection(selection, k.shape[1], block_size=block_size, sink=sink, compute_q_blocks=grad)
