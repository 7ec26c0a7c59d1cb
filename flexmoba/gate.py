"""MoBA gating: which chunks each query attends.

For a query at position t of a document (per head):

    score[j] = q_t . mean(k over chunk j)          (fp32, no scale, no gradient)
    own      = the chunk holding t                  (always attended, causal inside)
    past     = top_k - 1 highest-scoring chunks j < own (all of them if fewer);
               among exactly equal scores the later chunk wins

Chunks after ``own`` are never attended. A past chunk whose score is NaN or -inf (from
non-finite inputs) is never selected, so a non-finite key cannot win a slot by accident;
the query then attends fewer chunks. Non-finite values still reach the output through
the chunks that are attended (the own chunk always), as in any attention.

With ``granularity=g`` all queries of each ``g``-token tile (tiles start at document
starts, and ``g`` divides ``chunk_size``) are scored with the tile's mean query, so they
share one selection: MoBA at tile granularity, an ablation, not the paper's model.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexmoba import validation
from flexmoba.layout import ChunkLayout, chunk_layout
from flexmoba.spec import Granularity, MobaSpec, resolve_spec

__all__ = ["Selection", "chunk_means", "moba_selection", "select_against_means", "select_chunks"]


@dataclass(frozen=True)
class Selection:
    """The chunks each query attends.

    Attributes:
        past_chunks: ``[B, H, S, P]`` local indices of the selected past chunks,
            ``P = min(top_k - 1, n_chunks - 1)``; entries with ``past_valid`` False are unused.
        past_valid: ``[B, H, S, P]`` bool.
        layout: the chunk layout the indices refer to.
        granularity: ``"token"`` or the tile size whose queries share one selection.
        chunks: ``[B, H, S, n_chunks]`` bool, built on first use (the sparse backends never
            need it); ``chunks[b, h, t, j]`` says query t of head h attends the j-th chunk of
            its own document (own chunk included).
    """

    past_chunks: torch.Tensor
    past_valid: torch.Tensor
    layout: ChunkLayout
    granularity: str | int = "token"

    @functools.cached_property
    def chunks(self) -> torch.Tensor:
        B, H, S, _ = self.past_chunks.shape
        chunks = torch.zeros(B, H, S, self.layout.n_chunks, dtype=torch.bool, device=self.past_chunks.device)
        own = self.layout.local_chunk[:, None, :, None].expand(B, H, S, 1)
        chunks.scatter_(-1, torch.where(self.past_valid, self.past_chunks, own), True)  # unused slots: own
        chunks.scatter_(-1, own, True)
        return chunks


def chunk_means(k: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``k: [B, H_kv, S, D]`` -> ``[B, H_kv, n_global_chunks, D]`` fp32 mean of each chunk.

    The mean is rounded to k's dtype before use, as the official implementation pools keys
    in their own dtype and only then casts to fp32.
    """
    B, H_kv, S, D = k.shape
    if not layout.has_documents:  # chunks are fixed windows: a reshape instead of scatters
        return _window_means(k, layout.chunk_size).to(k.dtype).float()
    index = layout.global_chunk[:, None, :].expand(B, H_kv, S)
    sums = k.new_zeros(B, H_kv, layout.n_global_chunks, D, dtype=torch.float32)
    sums.scatter_add_(2, index[..., None].expand(B, H_kv, S, D), k.float())
    counts = torch.zeros(B, layout.n_global_chunks, device=k.device, dtype=torch.float32)
    counts.scatter_add_(1, layout.global_chunk, torch.ones_like(counts[:, :1]).expand(B, S))
    return (sums / counts[:, None, :, None]).to(k.dtype).float()


def _window_means(x: torch.Tensor, window: int) -> torch.Tensor:
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
    """The queries the gate scores: ``(rows [B, H, R, D] fp32, own chunk [B, R], positions per row)``.

    One row per token, except for tiles without documents: one row per tile (its mean
    query), whose selection every query of the tile then shares.
    """
    if granularity == "token":
        return q.float(), layout.local_chunk, 1
    if layout.has_documents:
        return tile_mean_queries(q, layout, granularity), layout.local_chunk, 1
    rows = _window_means(q, granularity)
    own = layout.local_chunk[:, ::granularity]  # a tile never straddles a chunk
    return rows, own, granularity


# Query chunks scored together against one block of candidate chunks. g groups compute the causal
# part of the scores and about 1/g of it again; each group costs a fixed run of small calls, so the
# best g grows as the square root of the work: sqrt(causal scores / GROUP_SCORES), at most
# MAX_QUERY_GROUPS (measured on CPU, with pooled maxima: one group at 8K tokens and 16 chunks, three
# at 32K and 64, where 2**16 made eight and took 1.16-1.22x the time). Spans of positions with
# documents (:func:`position_spans`) measured fastest at SPAN_SCORES each.
MAX_QUERY_GROUPS = 16
GROUP_SCORES = 2**19
SPAN_SCORES = 2**16


def query_chunk_groups(n_chunks: int, causal_scores: int) -> list[tuple[int, int]]:
    """``[(first, end), ...]``: the query chunks ``1 .. n_chunks - 1`` (chunk 0 has no past) in consecutive
    groups, as many as ``causal_scores`` (the scores of the causal part) is worth."""
    n_groups = min(MAX_QUERY_GROUPS, n_chunks - 1, max(1, round(math.sqrt(causal_scores / GROUP_SCORES))))
    size = -(-(n_chunks - 1) // n_groups)
    return [(first, min(first + size, n_chunks)) for first in range(1, n_chunks, size)]


def select_past_chunks_on_grid(
    rows: torch.Tensor, means: torch.Tensor, rows_per_chunk: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_past_chunks` for a layout without documents, where row r's own chunk is
    ``r // rows_per_chunk``: groups of whole query chunks, masked in their top rows only.

    ``rows: [B, H, R, D]`` fp32, ``means: [B, H_kv, N, D]`` fp32. Each group of query chunks
    scores its past chunks latest first, so the first maximum ``max`` returns is the later
    chunk of a tie; a taken chunk is then set to -inf. Returns ``(indices, valid)``, each
    ``[B, H, R, P]`` with ``P = min(top_k - 1, N - 1)``, in :func:`select_past_chunks`' order.
    """
    B, H, R, D = rows.shape
    H_kv, N = means.shape[1], means.shape[2]
    P = min(top_k - 1, N - 1)
    # Each slot's chunk and validity, for all groups: chunk 0 and invalid where no group writes (chunk
    # 0's rows, and slots past a group's chunks).
    chunks = rows.new_empty((B, H_kv, H // H_kv, P, R), dtype=torch.long)
    chunks[..., :rows_per_chunk].zero_()
    valid = rows.new_zeros((B, H_kv, H // H_kv, P, R), dtype=torch.bool)
    by_column = rows.view(B, H_kv, H // H_kv, R, D).transpose(-1, -2)  # [B, H_kv, g, D, R], a view
    latest_first = means.flip(2)[:, :, None]  # [B, H_kv, 1, N, D]: row i is chunk N-1-i
    groups = query_chunk_groups(N, B * H * R * (N - 1) // 2) if P else []
    spans = [(first, end, slice(first * rows_per_chunk, min(end * rows_per_chunk, R))) for first, end in groups]
    # One buffer for every group's scores: fresh ones per group cost page faults on CPU.
    largest = max((B * H * (end - 1) * (columns.stop - columns.start) for _, end, columns in spans), default=0)
    scores_buffer = rows.new_empty(largest)
    for first, end, columns in spans:
        n_past = end - 1  # the group's past: chunks 0 .. end-2, as score rows end-2 .. 0
        shape = (B, H_kv, H // H_kv, n_past, columns.stop - columns.start)
        scores = scores_buffer[:math.prod(shape)].view(shape)
        fp32_matmul(latest_first[:, :, :, N - n_past:], by_column[..., columns], out=scores)
        _fill_not_past(scores, end - first - 1, rows_per_chunk)  # the top rows: chunks first .. end-2
        taken = min(P, n_past)
        chunks[..., taken:, columns].zero_()
        _slot_maxima(scores, chunks[..., :taken, columns], valid[..., :taken, columns])
    per_head = lambda x: x.view(B, H, P, R).transpose(-1, -2)  # noqa: E731
    return per_head(chunks), per_head(valid)


def select_past_chunks(
    rows: torch.Tensor, means: torch.Tensor, own: torch.Tensor, top_k: int, n_chunks: int,
    first: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``top_k - 1`` chunks in ``[first, own)`` of each position: documents, context
    parallelism, decoding's multi-query steps (the grid's gate is :func:`select_past_chunks_on_grid`).

    ``rows: [B, H, S, D]`` fp32 score against ``means: [B, H_kv, N, D]``; ``own, first: [B, S]``
    index those means (the position's own chunk and its document's first, None: 0); ``n_chunks``
    bounds the chunks of one document. Positions go in spans (:func:`position_spans`), each scored
    against the chunks some position of it may select, latest first, with a -inf bias off each
    position's ``[first, own)``; the maxima come as on the grid (exact ties go to the later chunk, a
    NaN or -inf score is never selected). Returns ``(indices, valid)``, each ``[B, H, S, P]`` with
    ``P = min(top_k - 1, n_chunks - 1)``, indices counted from ``first``.
    """
    B, H, S, D = rows.shape
    H_kv, N = means.shape[1], means.shape[2]
    P = min(top_k - 1, n_chunks - 1)
    rows = rows.contiguous()  # viewed per KV head below
    latest_first = means.flip(2)  # [B, H_kv, N, D]: row i is chunk N-1-i
    spans = position_spans(own, H, N, first) if P else []
    parts = [(slice(start, end), *_span_maxima(latest_first, rows, start, end, own, first, low, high, P))
             for start, end, low, high in spans]
    if len(parts) == 1 and spans[0][:2] == (0, S) and parts[0][1].shape[-2] == P:
        indices, valid = parts[0][1:]  # one span of every position and slot: no buffers
    else:
        indices = rows.new_zeros(B, H_kv, H // H_kv, P, S, dtype=torch.long)
        valid = rows.new_zeros(B, H_kv, H // H_kv, P, S, dtype=torch.bool)
        for columns, chunks, chosen in parts:
            indices[..., :chunks.shape[-2], columns] = chunks
            valid[..., :chosen.shape[-2], columns] = chosen
    per_head = lambda x: x.reshape(B, H, P, S).transpose(-1, -2).contiguous()  # noqa: E731
    if first is None:
        return per_head(indices), per_head(valid)
    return (per_head(indices) - first[:, None, :, None]).clamp_(0, max(n_chunks - 1, 0)), per_head(valid)


def _span_maxima(latest_first, rows, start: int, end: int, own, first, low: int, high: int, count: int):
    """The best ``min(count, high - low)`` chunks in ``[low, high)`` of positions ``[start, end)`` as
    ``(global chunk, valid)``, each ``[B, H_kv, g, taken, end - start]``, under a -inf bias off each
    position's ``[first, own)`` (``rows: [B, H, S, D]``, ``latest_first: [B, H_kv, N, D]``)."""
    B, H, S, D = rows.shape
    H_kv, N = latest_first.shape[1], latest_first.shape[2]
    g, n, columns = H // H_kv, high - low, slice(start, end)
    candidates = latest_first[:, :, N - high:N - low]
    every_position = (start, end) == (0, S)
    if every_position:  # one product per KV head: chunks x (head in group, position)
        scores = fp32_matmul(candidates, rows.view(B, H_kv, g * S, D).transpose(-1, -2))  # [B, H_kv, n, g * S]
        per_column = scores.view(B, H_kv, n, g, S)
    else:
        by_column = rows.view(B, H_kv, g, S, D)[:, :, :, columns].transpose(-1, -2)  # [B, H_kv, g, D, c], a view
        scores = per_column = fp32_matmul(candidates[:, :, None], by_column)  # [B, H_kv, g, n, c]
    chunk = torch.arange(high - 1, low - 1, -1, device=scores.device)[:, None]
    past = chunk < own[:, None, columns]  # [B, n, c]
    if first is not None:
        past &= chunk >= first[:, None, columns]
    not_past = ~(past[:, None, :, None] if every_position else past[:, None, None])
    if scores.numel() <= FEW_SCORES:  # few scores: fewer ops
        per_column.masked_fill_(not_past, float("-inf"))
    else:  # a masked fill of many scores costs more than adding a bias
        per_column.add_(torch.zeros(not_past.shape, device=scores.device).masked_fill_(not_past, float("-inf")))
    chunks, valid = _latest_first_maxima(scores, min(count, n))  # inf - inf: NaN, never selected
    if every_position:  # [B, H_kv, taken, g * S] -> [B, H_kv, g, taken, S]
        chunks, valid = (x.view(B, H_kv, -1, g, S).transpose(2, 3) for x in (chunks, valid))
    return chunks.add(low) if low else chunks, valid


def position_spans(own: torch.Tensor, heads: int, n_global: int,
                   first: torch.Tensor | None = None) -> list[tuple[int, int, int, int]]:
    """``[(start, end, low, high), ...]``: positions ``[start, end)`` in consecutive spans, and the
    chunks ``[low, high)`` any of them may select (``own, first: [B, S]``, over the batch; ``first``
    None: 0). As many spans as the causal part of the scores is worth (see
    :func:`query_chunk_groups`), on CPU; elsewhere, and when one span is worth it, one span of every
    chunk: its bounds need no host read (a device sync off CPU)."""
    B, S = own.shape
    n_spans = min(MAX_QUERY_GROUPS, S, max(1, round(math.sqrt(B * heads * S * n_global / 2 / SPAN_SCORES))))
    if n_spans == 1 or own.device.type != "cpu":
        return [(0, S, 0, n_global)]
    bounds = [S * i // n_spans for i in range(n_spans + 1)]
    edges = list(zip(bounds[:-1], bounds[1:], strict=True))
    high = torch.stack([own[:, start:end].max() for start, end in edges])
    low = torch.zeros_like(high) if first is None else torch.stack([first[:, start:end].min() for start, end in edges])
    lows, highs = torch.stack([low, high]).tolist()  # the host read
    return [(start, end, lo, hi) for (start, end), lo, hi in zip(edges, lows, highs, strict=True) if hi > lo]


def _nan_to_minus_inf(scores: torch.Tensor) -> torch.Tensor:
    """NaN scores to -inf, in place (never selected); infinities stay, which ``nan_to_num`` alone
    would make finite."""
    return scores.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def _fill_not_past(scores: torch.Tensor, n_rows: int, rows_per_chunk: int) -> None:
    """-inf, in place, where the top ``n_rows`` rows of a group's ``scores: [..., n_past, columns]`` are not
    past: row i is chunk ``n_rows - 1 - i`` counted from the group's first chunk, column r a row of its
    chunk ``r // rows_per_chunk``, so row i's first ``(n_rows - i) * rows_per_chunk`` columns (that chunk's
    rows and the earlier chunks') are not past. One fill per row: half the time of adding a -inf bias."""
    for i, row in enumerate(scores.unbind(-2)[:n_rows]):
        row[..., :(n_rows - i) * rows_per_chunk].fill_(float("-inf"))


# Up to this many scores, ``max`` with its indices (one call per slot) costs less than the passes of
# :func:`_slot_maxima` that replace it on large blocks of scores (decoding's gate: a few chunks per
# head; measured against the amax passes).
FEW_SCORES = 2**14


def _latest_first_maxima(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` best chunks of each column of ``scores: [..., n_past, r]`` (contiguous; row i is past
    chunk ``n_past - 1 - i``) as ``(chunk indices, valid)``, each ``[..., count, r]``, best first;
    overwrites ``scores``. Of equal maxima the first row, the later chunk, wins; a NaN or -inf score
    is never selected."""
    if scores.numel() <= FEW_SCORES:
        return _latest_first_maxima_by_max(scores, count)
    shape = (*scores.shape[:-2], count, scores.shape[-1])
    chunks, valid = scores.new_empty(shape, dtype=torch.long), scores.new_empty(shape, dtype=torch.bool)
    _slot_maxima(scores, chunks, valid)
    return chunks, valid


def _latest_first_maxima_by_max(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_latest_first_maxima` with one ``max`` call per slot: cheaper on few scores."""
    n_past = scores.shape[-2]
    _nan_to_minus_inf(scores)
    rows, maxima = [], []
    for slot in range(count):
        best, row = scores.max(-2, keepdim=True)
        rows.append(row)
        maxima.append(best)
        if slot + 1 < count:
            scores.scatter_(-2, row, float("-inf"))
    return n_past - 1 - torch.cat(rows, -2), torch.cat(maxima, -2) > float("-inf")


# Devices on which a slot's maxima come from max_pool2d (:func:`_pooled_maxima`); elsewhere from amax
# passes (:func:`_ranked_maxima`), as CUDA's pooling kernel takes 32-bit offsets.
POOLED_MAXIMA_DEVICES = ("cpu",)


def _slot_maxima(scores: torch.Tensor, chunks: torch.Tensor, valid: torch.Tensor) -> None:
    """:func:`_latest_first_maxima` on many scores, into ``chunks`` (long) and ``valid`` (bool, False where
    no chunk is left), each ``[..., count, r]``; overwrites ``scores``. A taken chunk is set to -inf, one
    element per column addressed in the flat scores."""
    maxima_of = _pooled_maxima if scores.device.type in POOLED_MAXIMA_DEVICES else _ranked_maxima
    maxima_of(scores, chunks, valid)


def _column_offsets(scores: torch.Tensor, row: int) -> torch.Tensor:
    """``[N, r]`` flat index of row ``row`` of each column of ``scores: [..., n_past, r]`` (contiguous)."""
    n_past, r = scores.shape[-2], scores.shape[-1]
    first = torch.arange(row * r, scores.numel(), n_past * r, device=scores.device)[:, None]
    return first + torch.arange(r, device=scores.device)


def _pooled_maxima(scores: torch.Tensor, chunks: torch.Tensor, valid: torch.Tensor) -> None:
    """:func:`_slot_maxima` by ``max_pool2d`` over each column: viewed channels last (a column per
    channel), the CPU kernel returns every column's maximum and the first row holding it in one
    vectorised pass, about a third of the time of :func:`_ranked_maxima`'s passes."""
    n_past, r = scores.shape[-2], scores.shape[-1]
    planes = scores.view(-1, n_past, 1, r).permute(0, 3, 1, 2)  # [N, r, n_past, 1], channels last: a view
    count = chunks.shape[-2]
    by_row = scores.view(-1, n_past, r)
    for slot, (slot_chunks, slot_valid) in enumerate(zip(chunks.unbind(-2), valid.unbind(-2), strict=True)):
        best, row = F.max_pool2d(planes, (n_past, 1), return_indices=True)  # [N, r, 1, 1] each
        if slot == 0 and torch.amax(best).isnan():  # a NaN wins its column: clear them all (a host read, CPU)
            _nan_to_minus_inf(scores)
            best, row = F.max_pool2d(planes, (n_past, 1), return_indices=True)
        torch.gt(best.view(slot_valid.shape), float("-inf"), out=slot_valid)
        slot_chunks.copy_(row.view(slot_chunks.shape))  # the row, for now
        if slot + 1 < count:
            by_row.scatter_(1, row.view(-1, 1, r), float("-inf"))
    chunks.neg_().add_(n_past - 1)  # row i is chunk n_past - 1 - i


def _ranked_maxima(scores: torch.Tensor, chunks: torch.Tensor, valid: torch.Tensor) -> None:
    """:func:`_slot_maxima` by ``amax`` passes: ``max`` returns the first row holding the maximum; the
    same row comes from ``amax`` over the rows' chunks where the score equals the column's maximum,
    whose passes cost a tenth of ``max`` with indices on CPU. The comparison writes fp32 (1.0 where
    equal): CPU comparisons writing bool run at a quarter of that speed."""
    n_past, r = scores.shape[-2], scores.shape[-1]
    chunk = torch.arange(n_past - 1, -1, -1, dtype=scores.dtype, device=scores.device)[:, None]
    _nan_to_minus_inf(scores)
    work = torch.empty_like(scores)
    count = chunks.shape[-2]
    if count > 1:
        row_last = _column_offsets(scores, n_past - 1).view(chunks[..., :1, :].shape)
    for slot in range(count):
        best = torch.amax(scores, -2, keepdim=True)
        torch.gt(best, float("-inf"), out=valid[..., slot:slot + 1, :])
        taken = chunks[..., slot:slot + 1, :]
        taken.copy_(torch.amax(torch.eq(scores, best, out=work).mul_(chunk), -2, keepdim=True))
        if slot + 1 < count:  # row n_past - 1 - chunk of each column
            scores.view(-1).index_fill_(0, torch.add(row_last, taken, alpha=-r).view(-1), float("-inf"))


def select_before_chunk(
    rows: torch.Tensor, means: torch.Tensor, own: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_past_chunks` for rows that all sit in chunk ``own`` (a host int): decoding's
    usual step, one new query per row of a cache without padding.

    ``rows: [B, H, R, D]`` fp32, ``means: [B, H_kv, N, D]`` fp32, ``N > own``. Returns
    ``(indices, valid)``, each ``[B, H, R, P]`` with ``P = min(top_k - 1, N - 1)``; slots beyond
    the ``own`` past chunks are invalid.
    """
    B, H, R, D = rows.shape
    H_kv, N = means.shape[1], means.shape[2]
    P, taken = min(top_k - 1, N - 1), min(top_k - 1, own)
    if taken:
        by_column = rows.reshape(B, H_kv, (H // H_kv) * R, D).transpose(-1, -2)
        scores = fp32_matmul(means[:, :, :own], by_column).flip(2)  # [B, H_kv, own, g * R], latest first
        indices, valid = _latest_first_maxima(scores, taken)
    else:
        indices = valid = rows.new_empty(B, H_kv, 0, (H // H_kv) * R)
    if taken < P:  # fewer past chunks than slots
        indices = F.pad(indices, (0, 0, 0, P - taken))
        valid = F.pad(valid, (0, 0, 0, P - taken), value=False)
    per_head = lambda x: x.view(B, H_kv, P, H // H_kv, R).permute(0, 1, 3, 4, 2).reshape(B, H, R, P)  # noqa: E731
    return per_head(indices.long()), per_head(valid.bool())


def fp32_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` of fp32 tensors in fp32 under autocast too (which would run it in bf16), into ``out``
    when given."""
    device = a.device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return torch.matmul(a, b, out=out)
    with torch.autocast(device, enabled=False):
        return torch.matmul(a, b, out=out)


def select_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: MobaSpec | None = None,
    *,
    chunk_size: int | None = None,
    top_k: int | None = None,
    granularity: Granularity | None = None,
    document_ids: torch.Tensor | None = None,
    layout: ChunkLayout | None = None,
) -> Selection:
    """Validate the inputs and run MoBA's gate: the one entry every public function gates through.

    Args:
        q: ``[B, H, S, D]`` queries.
        k: ``[B, H_kv, S, D]`` keys, ``H % H_kv == 0``.
        spec: MoBA's settings (:class:`flexmoba.MobaSpec`; its backend is not the gate's
            concern), or give them as keywords:
        chunk_size: tokens per chunk (chunks restart at each document start).
        top_k: chunks per query, counting its own chunk.
        granularity: ``"token"`` (the paper, the default) or an int tile size dividing ``chunk_size``.
        document_ids: optional ``[B, S]`` ints; each run of equal ids is one document.
        layout: the :func:`flexmoba.layout.chunk_layout` of these documents, when the caller
            built it already (a model builds it once per forward for all its layers).

    Returns:
        The :class:`Selection`.
    """
    spec = resolve_spec(spec, chunk_size, top_k, granularity)
    validation.check_gate_inputs(q, k, document_ids)
    chunk_size, top_k, granularity = spec.chunk_size, spec.top_k, spec.granularity
    B, H, S, _ = q.shape
    if layout is None:
        layout = chunk_layout(B, S, chunk_size, q.device, document_ids)
    validation.check_layout(layout, B, S, chunk_size, document_ids)
    with torch.no_grad():
        rows, own, positions_per_row = gate_rows(q.detach(), layout, granularity)
        if layout.has_documents:
            past_chunks, past_valid = select_past_chunks(rows, chunk_means(k.detach(), layout), layout.global_chunk,
                                                         top_k, layout.n_chunks, first=layout.first_global_chunk)
        else:
            past_chunks, past_valid = select_past_chunks_on_grid(
                rows, chunk_means(k.detach(), layout), chunk_size // positions_per_row, top_k)
        if positions_per_row > 1:
            past_chunks = past_chunks.repeat_interleave(positions_per_row, dim=2)[:, :, :S]
            past_valid = past_valid.repeat_interleave(positions_per_row, dim=2)[:, :, :S]
    return Selection(past_chunks, past_valid, layout, granularity)


def select_against_means(
    q: torch.Tensor, means: torch.Tensor, own: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the inputs and run MoBA's gate against precomputed chunk means (decoding from
    a KV cache, whose running sums hold the means): the scoring and tie rule of :func:`select_chunks`.

    Args:
        q: ``[B, H, S, D]`` queries, each gated alone (token granularity).
        means: ``[B, H_kv, N, D]`` fp32 chunk means, rounded through the key dtype like
            :func:`chunk_means`; query head h gates against KV head ``h // (H / H_kv)``.
        own: ``[B, S]`` ints in ``[0, N)``, each query's own chunk; only chunks before it compete.
        top_k: chunks per query, counting its own chunk.

    Returns:
        ``(past_chunks, past_valid)``, each ``[B, H, S, P]`` with ``P = min(top_k - 1, N - 1)``,
        as in :class:`Selection`.
    """
    validation.check_means_gate(q, means, own)
    top_k = validation.check_positive_int(top_k, "top_k")
    with torch.no_grad():
        return select_past_chunks(q.detach().float(), means, own, top_k, means.shape[2])


def moba_selection(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: MobaSpec | None = None,
    *,
    chunk_size: int | None = None,
    top_k: int | None = None,
    granularity: Granularity | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which chunks each query attends, own chunk included (arguments as :func:`select_chunks`).

    Returns:
        ``[B, H, S, ceil(S / chunk_size)]`` bool; index j is the j-th chunk of the
        query's own document.
    """
    return select_chunks(q, k, spec, chunk_size=chunk_size, top_k=top_k, granularity=granularity,
                         document_ids=document_ids).chunks
