"""Selection: the top ``top_k - 1`` past chunks of each query, on the three shapes the gate meets.

- the grid (no documents): row r's own chunk is ``r // rows_per_chunk``
  (:func:`select_past_chunks_on_grid`);
- positions with their own ``[first, own)`` range of candidates: documents, context
  parallelism, decoding's multi-query steps (:func:`select_past_chunks`);
- rows that all sit in one chunk: decoding's usual step (:func:`select_before_chunk`).

Each scores candidate chunks as rows in :mod:`flexmoba.gate.ties`' order and takes maxima with
:mod:`flexmoba.gate.maxima`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flexmoba.gate.maxima import best_rows, best_rows_into
from flexmoba.gate.scores import fp32_matmul
from flexmoba.gate.ties import candidate_rows, chunk_of_row, row_of_chunk
from flexmoba.tuning import Tuning, tuning_for

__all__ = ["position_spans", "select_before_chunk", "select_past_chunks", "select_past_chunks_on_grid"]


def query_chunk_groups(n_chunks: int, pair_scores: int, tuning: Tuning) -> list[tuple[int, int]]:
    """``[(first, end), ...]``: the query chunks ``1 .. n_chunks - 1`` (chunk 0 has no past) in consecutive
    groups of equal size; ``pair_scores`` is the scores of one query chunk against one candidate chunk.

    g groups compute the causal part of the scores and about 1/g of it again; each group costs a fixed
    run of small calls, so the best g grows as ``sqrt(causal scores / group_scores)``, up to
    ``max_query_groups``. Memory bounds the size too: a group scores every chunk before its last, so
    its buffer holds at most ``gate_buffer_scores`` (one query chunk each at least; linear in S).
    """
    causal_scores = pair_scores * n_chunks * (n_chunks - 1) // 2
    n_groups = min(tuning.max_query_groups, n_chunks - 1, max(1, round(math.sqrt(causal_scores / tuning.group_scores))))
    size = -(-(n_chunks - 1) // n_groups)
    size = max(1, min(size, tuning.gate_buffer_scores // (pair_scores * (n_chunks - 1))))
    return [(first, min(first + size, n_chunks)) for first in range(1, n_chunks, size)]


def select_past_chunks_on_grid(
    rows: torch.Tensor, means: torch.Tensor, rows_per_chunk: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_past_chunks` for a layout without documents, where row r's own chunk is
    ``r // rows_per_chunk``: groups of whole query chunks, each scoring the chunks before its last.

    ``rows: [B, H, R, D]`` (scored in fp32 a group at a time), ``means: [B, H_kv, N, D]`` fp32. Returns
    ``(indices, valid)``, each ``[B, H, R, P]`` with ``P = min(top_k - 1, N - 1)``, in
    :func:`select_past_chunks`' order.
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
    groups = query_chunk_groups(N, B * H * rows_per_chunk, tuning_for(rows.device)) if P else []
    spans = [(first, end, slice(first * rows_per_chunk, min(end * rows_per_chunk, R))) for first, end in groups]
    # One buffer for every group's scores: fresh ones per group cost page faults on CPU.
    largest = max((B * H * (end - 1) * (columns.stop - columns.start) for _, end, columns in spans), default=0)
    scores_buffer = rows.new_empty(largest, dtype=torch.float32)
    for first, end, columns in spans:
        n_past = end - 1  # the group's candidates: chunks 0 .. end-2
        shape = (B, H_kv, H // H_kv, n_past, columns.stop - columns.start)
        scores = scores_buffer[:math.prod(shape)].view(shape)
        fp32_matmul(candidate_rows(means, 0, n_past)[:, :, None], by_column[..., columns].float(), out=scores)
        _fill_not_past(scores, first, end, rows_per_chunk)
        taken = min(P, n_past)
        chunks[..., taken:, columns].zero_()
        group_chunks = chunks[..., :taken, columns]
        best_rows_into(scores, group_chunks, valid[..., :taken, columns])
        group_chunks.copy_(chunk_of_row(group_chunks, 0, n_past))
    per_head = lambda x: x.view(B, H, P, R).transpose(-1, -2)  # noqa: E731
    return per_head(chunks), per_head(valid)


def _fill_not_past(scores: torch.Tensor, first: int, end: int, rows_per_chunk: int) -> None:
    """-inf, in place, where a candidate of a group's ``scores: [..., end - 1, columns]`` is not in a
    column's past: column i is a row of chunk ``first + i // rows_per_chunk``, so candidate chunk
    ``c >= first`` is not past for the first ``(c - first + 1) * rows_per_chunk`` columns. One fill
    per such candidate: half the time of adding a -inf bias."""
    by_row = scores.unbind(-2)
    for chunk in range(first, end - 1):
        by_row[row_of_chunk(chunk, 0, end - 1)][..., :(chunk - first + 1) * rows_per_chunk].fill_(float("-inf"))


def select_past_chunks(
    rows: torch.Tensor, means: torch.Tensor, own: torch.Tensor, top_k: int, n_chunks: int,
    first: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``top_k - 1`` chunks in ``[first, own)`` of each position: documents, context
    parallelism, decoding's multi-query steps.

    ``rows: [B, H, S, D]`` (scored in fp32 a span at a time) score against ``means: [B, H_kv, N, D]``;
    ``own, first: [B, S]`` index those means (the position's own chunk and its document's first, None: 0); ``n_chunks``
    bounds the chunks of one document. Positions go in spans (:func:`position_spans`), each scored
    against the chunks some position of it may select, with a -inf bias off each position's
    ``[first, own)``. Returns ``(indices, valid)``, each ``[B, H, S, P]`` with
    ``P = min(top_k - 1, n_chunks - 1)``, indices counted from ``first``.
    """
    B, H, S, D = rows.shape
    H_kv, N = means.shape[1], means.shape[2]
    P = min(top_k - 1, n_chunks - 1)
    rows = rows.contiguous()  # viewed per KV head below
    spans = position_spans(own, H, N, first) if P else []
    parts = [(slice(start, end), *_span_maxima(means, rows, start, end, own, first, low, high, P))
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


def _span_maxima(means, rows, start: int, end: int, own, first, low: int, high: int, count: int):
    """The best ``min(count, high - low)`` chunks in ``[low, high)`` of positions ``[start, end)`` as
    ``(global chunk, valid)``, each ``[B, H_kv, g, taken, end - start]``, under a -inf bias off each
    position's ``[first, own)`` (``rows: [B, H, S, D]``, ``means: [B, H_kv, N, D]``)."""
    B, H, S, D = rows.shape
    H_kv = means.shape[1]
    g, n, columns = H // H_kv, high - low, slice(start, end)
    candidates = candidate_rows(means, low, high)
    every_position = (start, end) == (0, S)
    if every_position:  # one product per KV head: chunks x (head in group, position)
        scores = fp32_matmul(candidates, rows.view(B, H_kv, g * S, D).transpose(-1, -2).float())  # [B, H_kv, n, g * S]
        per_column = scores.view(B, H_kv, n, g, S)
    else:
        by_column = rows.view(B, H_kv, g, S, D)[:, :, :, columns].transpose(-1, -2)  # [B, H_kv, g, D, c], a view
        scores = per_column = fp32_matmul(candidates[:, :, None], by_column.float())  # [B, H_kv, g, n, c]
    chunk = chunk_of_row(torch.arange(n, device=scores.device), low, high)[:, None]
    past = chunk < own[:, None, columns]  # [B, n, c]
    if first is not None:
        past &= chunk >= first[:, None, columns]
    not_past = ~(past[:, None, :, None] if every_position else past[:, None, None])
    if scores.numel() <= tuning_for(scores.device).few_scores:  # few scores: fewer ops
        per_column.masked_fill_(not_past, float("-inf"))
    else:  # a masked fill of many scores costs more than adding a bias
        per_column.add_(torch.zeros(not_past.shape, device=scores.device).masked_fill_(not_past, float("-inf")))
    best, valid = best_rows(scores, min(count, n))  # inf - inf: NaN, never selected
    chunks = chunk_of_row(best, low, high)
    if every_position:  # [B, H_kv, taken, g * S] -> [B, H_kv, g, taken, S]
        chunks, valid = (x.view(B, H_kv, -1, g, S).transpose(2, 3) for x in (chunks, valid))
    return chunks, valid


def position_spans(own: torch.Tensor, heads: int, n_global: int,
                   first: torch.Tensor | None = None) -> list[tuple[int, int, int, int]]:
    """``[(start, end, low, high), ...]``: positions ``[start, end)`` in consecutive spans, and the
    chunks ``[low, high)`` any of them may select (``own, first: [B, S]``, over the batch; ``first``
    None: 0). As many spans as the causal part of the scores is worth (see
    :func:`query_chunk_groups`) where the profile reads the bounds from the host; otherwise, and
    when one span is worth it, spans of every chunk, whose bounds need no host read. Either way at
    least as many spans as keep each one's scores of every chunk within ``gate_buffer_scores``."""
    B, S = own.shape
    tuning = tuning_for(own.device)
    every_chunk_scores = B * heads * S * n_global
    n_spans = min(tuning.max_query_groups, S, max(1, round(math.sqrt(every_chunk_scores / 2 / tuning.span_scores))))
    if not tuning.spans_read_host:
        n_spans = 1
    n_spans = max(n_spans, min(S, -(-every_chunk_scores // tuning.gate_buffer_scores)))  # memory: linear in S
    bounds = [S * i // n_spans for i in range(n_spans + 1)]
    edges = list(zip(bounds[:-1], bounds[1:], strict=True))
    if not tuning.spans_read_host or n_spans == 1:
        return [(start, end, 0, n_global) for start, end in edges]
    high = torch.stack([own[:, start:end].max() for start, end in edges])
    low = torch.zeros_like(high) if first is None else torch.stack([first[:, start:end].min() for start, end in edges])
    lows, highs = torch.stack([low, high]).tolist()  # the host read
    return [(start, end, lo, hi) for (start, end), lo, hi in zip(edges, lows, highs, strict=True) if hi > lo]


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
        scores = fp32_matmul(candidate_rows(means, 0, own), by_column)  # [B, H_kv, own, g * R]
        best, valid = best_rows(scores, taken)
        indices = chunk_of_row(best, 0, own)
    else:
        indices = valid = rows.new_empty(B, H_kv, 0, (H // H_kv) * R)
    if taken < P:  # fewer past chunks than slots
        indices = F.pad(indices, (0, 0, 0, P - taken))
        valid = F.pad(valid, (0, 0, 0, P - taken), value=False)
    per_head = lambda x: x.view(B, H_kv, P, H // H_kv, R).permute(0, 1, 3, 4, 2).reshape(B, H, R, P)  # noqa: E731
    return per_head(indices.long()), per_head(valid.bool())
