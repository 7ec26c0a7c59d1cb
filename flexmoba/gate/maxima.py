"""The best rows of gate scores, slot after slot: each slot takes every column's maximum, the first
row holding it (rows are in :mod:`flexmoba.gate.ties`' preference order, so this is where a tie is
decided), and then sets the taken row to -inf. A NaN or -inf score is never taken.

Three ways, equal in result and chosen by size and device (:mod:`flexmoba.tuning`): ``max`` with
indices on few scores, ``max_pool2d`` on many on CPU, ``amax`` passes on many elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexmoba.tuning import tuning_for

__all__ = ["best_rows", "best_rows_into"]


def nan_to_minus_inf(scores: torch.Tensor) -> torch.Tensor:
    """NaN scores to -inf, in place (never selected); infinities stay, which ``nan_to_num`` alone
    would make finite."""
    return scores.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def best_rows(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` best rows of each column of ``scores: [..., n, r]`` (contiguous) as
    ``(rows, valid)``, each ``[..., count, r]``, best first; overwrites ``scores``."""
    if scores.numel() <= tuning_for(scores.device).few_scores:
        return _best_rows_by_max(scores, count)
    shape = (*scores.shape[:-2], count, scores.shape[-1])
    rows, valid = scores.new_empty(shape, dtype=torch.long), scores.new_empty(shape, dtype=torch.bool)
    best_rows_into(scores, rows, valid)
    return rows, valid


def _best_rows_by_max(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`best_rows` with one ``max`` call per slot: cheaper on few scores."""
    nan_to_minus_inf(scores)
    rows, maxima = [], []
    for slot in range(count):
        best, row = scores.max(-2, keepdim=True)
        rows.append(row)
        maxima.append(best)
        if slot + 1 < count:
            scores.scatter_(-2, row, float("-inf"))
    return torch.cat(rows, -2), torch.cat(maxima, -2) > float("-inf")


def best_rows_into(scores: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
    """:func:`best_rows` on many scores, into ``rows`` (long) and ``valid`` (bool, False where no
    row is left), each ``[..., count, r]``; overwrites ``scores``."""
    maxima_of = _pooled_rows if tuning_for(scores.device).pooled_maxima else _ranked_rows
    maxima_of(scores, rows, valid)


def _pooled_rows(scores: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
    """:func:`best_rows_into` by ``max_pool2d`` over each column: viewed channels last (a column per
    channel), the CPU kernel returns every column's maximum and the first row holding it in one
    vectorised pass, about a third of the time of :func:`_ranked_rows`' passes. (The first row:
    ``test_gate.py`` pins this property of the kernel.)"""
    n, r = scores.shape[-2], scores.shape[-1]
    planes = scores.view(-1, n, 1, r).permute(0, 3, 1, 2)  # [N, r, n, 1], channels last: a view
    count = rows.shape[-2]
    by_row = scores.view(-1, n, r)
    for slot, (slot_rows, slot_valid) in enumerate(zip(rows.unbind(-2), valid.unbind(-2), strict=True)):
        best, row = F.max_pool2d(planes, (n, 1), return_indices=True)  # [N, r, 1, 1] each
        if slot == 0 and torch.amax(best).isnan():  # a NaN wins its column: clear them all (a host read, CPU)
            nan_to_minus_inf(scores)
            best, row = F.max_pool2d(planes, (n, 1), return_indices=True)
        torch.gt(best.view(slot_valid.shape), float("-inf"), out=slot_valid)
        slot_rows.copy_(row.view(slot_rows.shape))
        if slot + 1 < count:
            by_row.scatter_(1, row.view(-1, 1, r), float("-inf"))


def _column_offsets(scores: torch.Tensor) -> torch.Tensor:
    """``[N, r]`` flat index of row 0 of each column of ``scores: [..., n, r]`` (contiguous)."""
    n, r = scores.shape[-2], scores.shape[-1]
    first = torch.arange(0, scores.numel(), n * r, device=scores.device)[:, None]
    return first + torch.arange(r, device=scores.device)


def _ranked_rows(scores: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
    """:func:`best_rows_into` by ``amax`` passes: the first row holding a column's maximum is
    ``n - amax(equal * (n - row))``, whose passes cost a tenth of ``max`` with indices on CPU. The
    comparison writes fp32 (1.0 where equal): CPU comparisons writing bool run at a quarter of that
    speed."""
    n, r = scores.shape[-2], scores.shape[-1]
    countdown = torch.arange(n, 0, -1, dtype=scores.dtype, device=scores.device)[:, None]  # row i: n - i
    nan_to_minus_inf(scores)
    work = torch.empty_like(scores)
    count = rows.shape[-2]
    if count > 1:
        row_zero = _column_offsets(scores).view(rows[..., :1, :].shape)
    for slot in range(count):
        best = torch.amax(scores, -2, keepdim=True)
        torch.gt(best, float("-inf"), out=valid[..., slot:slot + 1, :])
        taken = rows[..., slot:slot + 1, :]
        first = torch.amax(torch.eq(scores, best, out=work).mul_(countdown), -2, keepdim=True)
        taken.copy_(first.neg_().add_(n))
        if slot + 1 < count:
            scores.view(-1).index_fill_(0, torch.add(row_zero, taken, alpha=r).view(-1), float("-inf"))
