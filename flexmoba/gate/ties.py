"""The tie rule, written once: of exactly equal gate scores, the later chunk wins.

The gate ranks candidate chunks as the rows of a score matrix, and every way it takes a
maximum (:mod:`flexmoba.gate.maxima`) returns the first row holding it. So the order of the
rows is the tie rule, and it is this module's :func:`preference_order`; the rest map rows to
chunks through it. (Later chunks first matches the official implementation's top-k over
chunks scored in order, whose ties go to the higher index.)
"""

from __future__ import annotations

import torch

__all__ = ["candidate_rows", "chunk_of_row", "preference_order", "row_of_chunk"]


def preference_order(low: int, high: int) -> range:
    """Chunks ``[low, high)`` in the order exactly equal scores prefer them: latest first."""
    return range(high - 1, low - 1, -1)


def candidate_rows(means: torch.Tensor, low: int, high: int, dim: int = -2) -> torch.Tensor:
    """Chunks ``[low, high)`` of ``means`` along ``dim`` as rows in preference order (a copy
    when the order is reversed)."""
    order = preference_order(low, high)
    rows = means.narrow(dim, low, high - low)
    return rows.flip(dim) if order.step < 0 else rows


def chunk_of_row(row, low: int, high: int):
    """The chunk of candidate row ``row`` (an int or an int tensor) of chunks ``[low, high)``."""
    order = preference_order(low, high)
    return order.start + order.step * row if len(order) else row


def row_of_chunk(chunk: int, low: int, high: int) -> int:
    """The candidate row of ``chunk`` among chunks ``[low, high)``."""
    order = preference_order(low, high)
    return (chunk - order.start) * order.step
