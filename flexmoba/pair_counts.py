"""(Query, key) pairs attended over one causal sequence of ``S`` tokens, in closed form.

Full causal attention: query t attends ``t + 1`` keys. MoBA: its own chunk causally plus
``min(top_k - 1, t // chunk_size)`` whole past chunks. The counts are O(1) to compute, so
the FLOP accounting (``4 H D`` FLOPs per pair, :meth:`flexmoba.model.ModelConfig.flops_per_token`)
and the flex plan's static sizes (:func:`flexmoba.backends.flex.plan.virtual_lengths`) can ask for
them on every batch. :func:`selection_pairs` counts the pairs of a selection already made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flexmoba import validation

if TYPE_CHECKING:
    from flexmoba.gate import Selection

__all__ = ["keys_attended_full", "keys_attended_moba", "own_chunk_pairs", "past_chunk_slots", "selection_pairs"]


def keys_attended_full(seq_len: int) -> int:
    """Query-key pairs of causal attention over one sequence: ``S (S + 1) / 2``."""
    return seq_len * (seq_len + 1) // 2


def own_chunk_pairs(seq_len: int, chunk_size: int) -> int:
    """Query-key pairs inside each query's own chunk (causal): ``S // c`` whole chunks and a partial last one."""
    validation.check_positive_int(chunk_size, "chunk_size")
    whole, rest = divmod(seq_len, chunk_size)
    return whole * keys_attended_full(chunk_size) + keys_attended_full(rest)


def past_chunk_slots(seq_len: int, chunk_size: int, top_k: int) -> int:
    """(Query, past chunk) pairs: the sum over queries t of ``min(top_k - 1, t // chunk_size)``.

    Counted by slot instead of by query: slot i (``1 <= i <= top_k - 1``) is filled by every
    query at ``t >= i * chunk_size``, that is ``S - i c`` queries, for the ``M`` slots with
    ``i c < S``. Their sum is ``M S - c M (M + 1) / 2``.
    """
    validation.check_positive_int(chunk_size, "chunk_size")
    validation.check_positive_int(top_k, "top_k")
    slots = max(0, min(top_k - 1, (seq_len - 1) // chunk_size))
    return slots * seq_len - chunk_size * slots * (slots + 1) // 2


def keys_attended_moba(seq_len: int, chunk_size: int, top_k: int) -> int:
    """Query-key pairs MoBA attends over one sequence (selected chunks, own chunk causal)."""
    return own_chunk_pairs(seq_len, chunk_size) + chunk_size * past_chunk_slots(seq_len, chunk_size, top_k)


def selection_pairs(selection: Selection, query_start: int = 0) -> int:
    """(Query, key) pairs a selection attends: its own chunk up to the query, ``chunk_size``
    keys per selected past chunk, summed over batch, heads and queries."""
    layout = selection.layout
    S = layout.doc_start.shape[1]
    t = query_start + torch.arange(S, device=layout.doc_start.device)
    own = (t - layout.chunk_start + 1).sum() * selection.past_chunks.shape[1]
    return int(own) + int(selection.past_valid.sum()) * layout.chunk_size
