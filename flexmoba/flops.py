"""(Query, key) pairs attended over one causal sequence: full attention and MoBA.

Full causal attention: query t attends ``t + 1`` keys. MoBA: its own chunk causally plus up
to ``top_k - 1`` whole past chunks, about ``min(t + 1, chunk_size * top_k)`` keys. Attention
FLOPs are these counts times ``4 H D`` (``QK^T`` and ``AV``); the model's FLOP accounting
is :meth:`flexmoba.model.ModelConfig.flops_per_token`.
"""

from __future__ import annotations

__all__ = ["keys_attended_full", "keys_attended_moba"]


def keys_attended_full(seq_len: int) -> int:
    """Query-key pairs of causal attention over one sequence: ``S (S + 1) / 2``."""
    return seq_len * (seq_len + 1) // 2


def keys_attended_moba(seq_len: int, chunk_size: int, top_k: int) -> int:
    """Query-key pairs MoBA attends over one sequence (selected chunks, own chunk causal)."""
    total = 0
    for t in range(seq_len):
        own = t // chunk_size
        total += (t - own * chunk_size + 1) + min(top_k - 1, own) * chunk_size
    return total
