"""FLOP accounting for :class:`flexmoba.model.GPT`.

Two numbers, kept apart on purpose:

- ``6 * N * D``: the paper's compute (Kaplan et al.), N non-embedding parameters, D tokens.
  It ignores attention, so MoBA and full attention cost the same by this measure.
- attention FLOPs actually done: ``QK^T`` and ``AV`` over the keys each query attends,
  ``2 * 2 * H * D_head`` per (query, key) pair forward, times 3 for training (forward plus
  a backward twice as costly). Full causal attention: query t attends ``t + 1`` keys.
  MoBA: its own chunk causally plus up to ``top_k - 1`` whole past chunks, about
  ``min(t + 1, chunk_size * top_k)`` keys.
"""

from __future__ import annotations

from flexmoba.model import ModelConfig

TRAINING_MULTIPLIER = 3  # forward + backward (~2x forward)


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


def keys_attended(config: ModelConfig, seq_len: int, kind: str) -> int:
    if kind == "full":
        return keys_attended_full(seq_len)
    return keys_attended_moba(seq_len, config.moba_chunk_size, config.moba_top_k)


def attention_flops_per_sequence(
    config: ModelConfig, seq_len: int, layer_attention: list[str] | None = None, training: bool = True
) -> int:
    """Attention score and value FLOPs for one sequence through all layers.

    ``layer_attention`` overrides the per-layer kinds (e.g. after a phase switch).
    """
    kinds = layer_attention or config.layer_attention()
    per_pair = 4 * config.n_heads * config.head_dim  # QK^T and AV, multiply-add = 2 FLOPs
    forward = sum(per_pair * keys_attended(config, seq_len, kind) for kind in kinds)
    return forward * (TRAINING_MULTIPLIER if training else 1)


def attention_flops_per_token(
    config: ModelConfig, seq_len: int, layer_attention: list[str] | None = None, training: bool = True
) -> float:
    return attention_flops_per_sequence(config, seq_len, layer_attention, training) / seq_len


def dense_flops_per_token(config: ModelConfig, training: bool = True) -> int:
    """``6 N`` for training (``2 N`` forward), N = non-embedding parameters."""
    n = config.num_parameters(non_embedding=True)
    return (6 if training else 2) * n


def flops_per_token(config: ModelConfig, seq_len: int, layer_attention: list[str] | None = None,
                    training: bool = True) -> float:
    """``6 N`` plus the attention FLOPs actually done, per token."""
    return dense_flops_per_token(config, training) + attention_flops_per_token(
        config, seq_len, layer_attention, training
    )


def attention_sparsity(config: ModelConfig, seq_len: int) -> float:
    """Fraction of causal query-key pairs MoBA skips (0 when it equals full attention)."""
    return 1.0 - keys_attended_moba(seq_len, config.moba_chunk_size, config.moba_top_k) / keys_attended_full(seq_len)
