"""MoBA selection -> FlexAttention ``BlockMask``, built straight from block tables.

FlexAttention tiles queries into blocks of ``Bq`` and keys into blocks of ``Bk``. For a
(query tile, key block) pair the kernel needs one of three answers: skip it, run it with
the mask_mod ("partial"), or run it without the mask_mod ("full": every query of the tile
attends every key of the block). We get them exactly by counting attended (query, key)
pairs per tile x block:

    pairs == tile_len * block_len  ->  full
    0 < pairs < tile_len * block_len ->  partial
    pairs == 0                      ->  skipped

Each query attends at most ``top_k`` disjoint key intervals (its selected past chunks,
whole, and its own chunk up to itself). An interval adds its overlap to the blocks it
touches: its two end blocks directly, the blocks strictly between them by a difference
array. The counts exist for a group of query tiles at a time, so the build holds no
``S x S`` tensor and no ``[S/Bq, S/Bk]`` one beyond the tables; no Python loop over
positions, no host sync. The tables can be compact (:func:`listed_width` wide: linear in S)
where the kernel accepts it (CUDA); torch's full width (every key block) is quadratic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexmoba import validation
from flexmoba.gate import Selection, select_chunks
from flexmoba.masks import moba_mask_mod
from flexmoba.spec import MobaSpec, takes_settings

__all__ = ["DEFAULT_BLOCK_SIZE", "block_tables", "key_intervals", "listed_width", "moba_block_mask",
           "selection_block_mask", "transposed_table"]

DEFAULT_BLOCK_SIZE = 128  # a multiple of the GPU kernel's tile; the CPU kernel takes any
TABLE_BUILD_ENTRIES = 2**18  # pair counts (int64) held at once while the tables are built


def key_intervals(selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-open key intervals ``[start, end)`` each query attends: ``[B, H, S, P + 1]`` each.

    Slot ``P`` is the own chunk, cut at the query (causal); unused past slots are empty.
    """
    layout = selection.layout
    B, H, S, _ = selection.past_chunks.shape
    c = layout.chunk_size
    doc_start = layout.doc_start[:, None, :, None]  # [B, 1, S, 1]
    past_start = torch.where(selection.past_valid, doc_start + selection.past_chunks * c, 0)
    past_end = torch.where(selection.past_valid, past_start + c, 0)
    own_start = layout.chunk_start[:, None, :, None].expand(B, H, S, 1)
    own_end = torch.arange(1, S + 1, device=own_start.device)[:, None].expand(B, H, S, 1)
    return torch.cat([past_start, own_start], -1), torch.cat([past_end, own_end], -1)


@dataclass(frozen=True)
class QueryRows:
    """Interval rows that each stand for ``weight`` consecutive queries from ``position``
    (all inside one query block), out of ``q_len`` queries."""

    q_len: int
    position: torch.Tensor  # [R]
    weight: torch.Tensor  # [R]


def block_pair_counts(starts: torch.Tensor, ends: torch.Tensor, block_size: tuple[int, int],
                   kv_len: int | None = None, rows: QueryRows | None = None) -> torch.Tensor:
    """``[B, H, R, K]`` disjoint-per-row intervals -> ``[B, H, Sq/Bq, kv_len/Bk]`` int64 pair counts.

    By default row r is query r (``Sq = R``); ``rows`` lets one row stand for several
    queries. ``kv_len`` defaults to ``Sq`` (queries and keys are the same positions).
    """
    Bq, Bk = block_size
    B, H, R, K = starts.shape
    device = starts.device
    if rows is None:
        rows = QueryRows(R, torch.arange(R, device=device), torch.ones(R, dtype=torch.long, device=device))
    n_tiles, n_blocks = -(-rows.q_len // Bq), -(-(rows.q_len if kv_len is None else kv_len) // Bk)
    width = n_blocks + 1  # one spare column for the difference array

    head_row = torch.arange(B * H, device=device).view(B, H, 1) * n_tiles
    row = ((head_row + rows.position // Bq) * width)[..., None, :]  # [B, H, 1, R]: flat offset of (b, h, tile, 0)
    weight = rows.weight
    # Rows last, [B, H, K, R]: with few intervals per row, elementwise ops over a last dim of K run slowly.
    starts, ends = starts.transpose(-1, -2).contiguous(), ends.transpose(-1, -2).contiguous()

    nonempty = ends > starts
    first_block = starts // Bk
    last_block = (ends - 1).clamp(min=0) // Bk
    one_block = first_block == last_block
    first_len = torch.where(one_block, ends - starts, (first_block + 1) * Bk - starts) * nonempty * weight
    last_len = torch.where(one_block, 0, ends - last_block * Bk) * nonempty * weight
    spans = (~one_block & nonempty).long() * weight  # blocks strictly inside get Bk each

    lengths = torch.zeros(B * H * n_tiles * width, dtype=torch.long, device=device)
    lengths.index_add_(0, (row + first_block).flatten(), first_len.flatten())
    lengths.index_add_(0, (row + last_block).flatten(), last_len.flatten())
    inside = torch.zeros_like(lengths)
    inside.index_add_(0, (row + first_block + 1).flatten(), spans.flatten())
    inside.index_add_(0, (row + last_block).flatten(), -spans.flatten())

    lengths = lengths.view(B, H, n_tiles, width)
    inside = inside.view(B, H, n_tiles, width).cumsum(-1)
    return (lengths + inside * Bk)[..., :n_blocks]


def listed_first(listed: torch.Tensor, block: torch.Tensor, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate key blocks ``block: [..., W]`` (increasing) and whether each is ``listed``
    (``[..., W]`` bool) -> (count ``[...]``, indices ``[..., n_blocks]``), both int32: the
    listed blocks first, in increasing order; zeros pad the row."""
    W = listed.shape[-1]
    slot = torch.where(listed, listed.cumsum(-1) - 1, W)  # unlisted: a spare column
    indices = torch.zeros(*listed.shape[:-1], max(W, n_blocks) + 1, dtype=torch.int32, device=listed.device)
    indices.scatter_(-1, slot, block.to(torch.int32))
    return listed.sum(-1, dtype=torch.int32), indices[..., :n_blocks].contiguous()


def _ordered_table(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, T, N]`` bool over every key block -> (count ``[B, H, T]``, indices ``[B, H, T, N]``)."""
    N = blocks.shape[-1]
    return listed_first(blocks, torch.arange(N, device=blocks.device).expand_as(blocks), N)


def _block_lengths(length: int, block: int, device) -> torch.Tensor:
    """``[ceil(length / block)]`` positions in each block; only the last may be short."""
    starts = torch.arange(0, length, block, device=device)
    return (length - starts).clamp(max=block)


def tables_from_pairs(pairs: torch.Tensor, block_size: tuple[int, int], q_len: int, kv_len: int):
    """Pair counts ``[B, H, T, N]`` -> the four block tables: full where every pair is attended."""
    Bq, Bk = block_size
    tile_len = _block_lengths(q_len, Bq, pairs.device)
    block_len = _block_lengths(kv_len, Bk, pairs.device)
    full = pairs == tile_len[:, None] * block_len[None, :]
    partial = (pairs > 0) & ~full
    return (*_ordered_table(partial), *_ordered_table(full))


def _interval_pairs(selection: Selection, block_size: tuple[int, int]):
    """``pairs(first, end)``: :func:`block_pair_counts` of queries ``[first, end)``, each attending its own
    key intervals."""
    starts, ends = key_intervals(selection)
    S = starts.shape[2]
    return lambda first, end: block_pair_counts(starts[:, :, first:end], ends[:, :, first:end], block_size, S)


def _tile_pairs(selection: Selection, block_size: tuple[int, int]):
    """``pairs(first, end)`` for a tile-granularity selection without documents, counted per tile: every
    query of a tile attends the same past chunks, and own chunks do not depend on the head."""
    layout = selection.layout
    S = selection.past_chunks.shape[2]
    c = layout.chunk_size
    piece = math.gcd(selection.granularity, block_size[0])  # inside one tile and one query block

    def pairs(first: int, end: int) -> torch.Tensor:
        position = torch.arange(first, end, piece, device=layout.chunk_start.device)
        rows = QueryRows(end - first, position - first, (end - position).clamp(max=piece))
        valid = selection.past_valid[:, :, first:end:piece]
        past_start = torch.where(valid, selection.past_chunks[:, :, first:end:piece] * c, 0)
        past = block_pair_counts(past_start, torch.where(valid, past_start + c, 0), block_size, S, rows)
        own_start = layout.chunk_start[:, None, first:end, None]  # [B, 1, R, 1]: the same for every head
        own_end = torch.arange(first + 1, end + 1, device=own_start.device)[:, None].expand_as(own_start)
        return past + block_pair_counts(own_start, own_end, block_size, S)

    return pairs


def listed_width(selection: Selection, block_size: tuple[int, int]) -> int:
    """The most key blocks one query tile can list (partial and full together), whatever the gate chose.

    A tile of ``Bq`` queries reads its own chunks, inside ``[tile start - chunk + 1, tile end)``, and
    ``P`` whole past chunks per distinct selection in it: one per query at token granularity or with
    documents, one per tile of the gate's granularity otherwise. A chunk touches at most
    ``(chunk - 1) // Bk + 2`` key blocks.
    """
    Bq, Bk = block_size
    c = selection.layout.chunk_size
    g = selection.granularity
    P = selection.past_chunks.shape[-1]
    selections = Bq if g == "token" or selection.layout.has_documents else min(Bq, (Bq - 1) // g + 2)
    return (c + Bq - 2) // Bk + 2 + selections * P * ((c - 1) // Bk + 2)


def block_tables(selection: Selection, block_size: tuple[int, int], width: int | None = None):
    """``(kv_num_blocks [B, H, T], kv_indices [B, H, T, W], full_kv_num_blocks, full_kv_indices)`` for the
    selection; ``W = width`` (at least :func:`listed_width`), by default every key block.

    The pair counts exist for a group of query tiles at a time (at most ``TABLE_BUILD_ENTRIES`` of
    them), so building them holds no ``[T, N]`` tensor beyond the tables themselves.
    """
    B, H, S, _ = selection.past_chunks.shape
    Bq, Bk = block_size
    n_tiles, n_blocks = -(-S // Bq), -(-S // Bk)
    width = n_blocks if width is None else min(width, n_blocks)
    by_tile = selection.granularity != "token" and not selection.layout.has_documents
    pairs = (_tile_pairs if by_tile else _interval_pairs)(selection, block_size)
    per_group = max(1, TABLE_BUILD_ENTRIES // (B * H * (n_blocks + 1)))
    groups = []
    for first_tile in range(0, n_tiles, per_group):
        first, end = first_tile * Bq, min((first_tile + per_group) * Bq, S)
        tables = tables_from_pairs(pairs(first, end), block_size, end - first, S)
        groups.append([t if t.dim() == 3 else t[..., :width].contiguous() for t in tables])
    return tuple(torch.cat(parts, 2) if len(parts) > 1 else parts[0] for parts in zip(*groups, strict=True))


def transposed_table(num: torch.Tensor, indices: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An ordered table ``(num [B, H, T], indices [B, H, T, W])`` -> its transpose ``(num [B, H, n_cols],
    indices [B, H, n_cols, T])``, int32: for each key block the query tiles listing it, in increasing order.

    It sorts the ``B·H·T·W`` entries; unlike torch's transposition it builds no dense ``[T, n_cols]`` map,
    so a narrow table costs no temporary wider than itself.
    """
    B, H, T, W = indices.shape
    device = indices.device
    listed = torch.arange(W, device=device) < num[..., None]  # [B, H, T, W]
    head = torch.arange(B * H, device=device).view(B, H, 1, 1)
    tile = torch.arange(T, device=device).view(1, 1, T, 1)
    column = head * n_cols + indices.long()  # [B, H, T, W]: (b, h, key block) flat
    spare = B * H * n_cols * T  # unlisted entries sort last
    key = torch.where(listed, column * T + tile, spare).flatten()
    key = key.sort().values
    sorted_column = key // T  # B·H·n_cols for the unlisted
    counts = torch.zeros(B * H * n_cols + 1, dtype=torch.long, device=device)
    counts.index_add_(0, sorted_column, torch.ones_like(key))
    first_entry = counts.cumsum(0) - counts  # where each column's entries start in key
    rank = torch.arange(key.numel(), device=device) - first_entry[sorted_column]
    out = torch.zeros(spare + 1, dtype=torch.int32, device=device)
    out.index_copy_(0, torch.where(key < spare, sorted_column * T + rank, spare), (key % T).to(torch.int32))
    return counts[:-1].view(B, H, n_cols).to(torch.int32), out[:-1].view(B, H, n_cols, T)


def selection_block_mask(
    selection: Selection,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    compute_q_blocks: bool = True,
    *,
    compact: bool | None = None,
) -> BlockMask:
    """The ``BlockMask`` of an already computed :class:`Selection`.

    ``compute_q_blocks=False`` skips the transposed tables only the backward pass reads.
    ``compact`` keeps ``kv_indices`` only :func:`listed_width` wide instead of every key block: linear
    in S, where the full width is quadratic. The GPU kernels read a row's listed entries only, so
    ``compact`` defaults to True on CUDA; compiled CPU flex refuses indices narrower than the keys,
    so it defaults to False elsewhere. The backward's transposed tables stay as wide as the query
    tiles (any tile may read a key block): quadratic, and built only with ``compute_q_blocks``.
    """
    if isinstance(block_size, int):
        block_size = (block_size, block_size)
    Bq, Bk = (validation.check_positive_int(b, "block_size") for b in block_size)
    S = selection.past_chunks.shape[2]
    mask_mod = moba_mask_mod(selection)  # first: it refuses selections too large to index
    if compact is None:
        compact = selection.past_chunks.device.type == "cuda"
    n_blocks = -(-S // Bk)
    width = min(listed_width(selection, (Bq, Bk)), n_blocks) if compact else n_blocks
    kv_num, kv_idx, full_num, full_idx = block_tables(selection, (Bq, Bk), width)
    if width == n_blocks:  # torch's own transposition reads a table as wide as every key block
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(Bq, Bk), mask_mod=mask_mod,
                                        seq_lengths=(S, S), compute_q_blocks=compute_q_blocks)
    q_tables = ((*transposed_table(kv_num, kv_idx, n_blocks), *transposed_table(full_num, full_idx, n_blocks))
                if compute_q_blocks else (None,) * 4)
    return BlockMask(seq_lengths=(S, S), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
                     full_kv_indices=full_idx, q_num_blocks=q_tables[0], q_indices=q_tables[1],
                     full_q_num_blocks=q_tables[2], full_q_indices=q_tables[3], BLOCK_SIZE=(Bq, Bk),
                     mask_mod=mask_mod)


@takes_settings
def moba_block_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: MobaSpec,
    *,
    document_ids: torch.Tensor | None = None,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    compute_q_blocks: bool = True,
    compact: bool | None = None,
) -> BlockMask:
    """Gate ``q`` against ``k`` and return the MoBA ``BlockMask`` for ``flex_attention``.

    Args:
        q: ``[B, H, S, D]``; k: ``[B, H_kv, S, D]``.
        spec (or chunk_size, top_k, granularity), document_ids: as in :func:`moba_selection`.
        block_size: FlexAttention's ``(Q, KV)`` block (an int for both). On GPU keep it a
            multiple of 128; the CPU kernel accepts any size.
        compute_q_blocks, compact: as in :func:`selection_block_mask` (by default the tables the
            backward reads are built, and compact tables on CUDA only).

    The mask's ``mask_mod`` encodes the whole selection; its tables mark a block "full"
    only when every query of the tile attends every key of the block.
    """
    selection = select_chunks(q, k, spec, document_ids=document_ids)
    return selection_block_mask(selection, block_size, compute_q_blocks, compact=compact)
