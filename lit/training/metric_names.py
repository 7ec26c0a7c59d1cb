"""The names LitLM and its callbacks log metrics under: written here once, read by every report.

``stage`` is ``"train"``, ``"val"`` or ``"test"``; position windows are ``[start, end)``
target positions.
"""

from __future__ import annotations

import re

POSITION_KEY = re.compile(r"^(\w+)/loss_pos_(\d+)_(\d+)$")

# The model's size, logged once when a fit starts.
PARAMS_NON_EMBEDDING = "params/non_embedding"
PARAMS_TOTAL = "params/total"
DENSE_FLOPS_PER_TOKEN = "flops/dense_per_token"
ATTENTION_FLOPS_PER_TOKEN = "flops/attention_per_token"


def loss(stage: str) -> str:
    """Token-mean cross-entropy, nats per token."""
    return f"{stage}/loss"


def perplexity(stage: str) -> str:
    return f"{stage}/ppl"


def bits_per_byte(stage: str) -> str:
    return f"{stage}/bpb"


def learning_rate(stage: str) -> str:
    return f"{stage}/lr"


def grad_norm(stage: str) -> str:
    """Total gradient norm before clipping."""
    return f"{stage}/grad_norm"


def moba_layers(stage: str) -> str:
    """How many layers run MoBA (a hybrid's count drops when it switches to full attention)."""
    return f"{stage}/moba_layers"


def throughput(stage: str, key: str) -> str:
    """A :class:`lit.training.throughput.ModelFlopsThroughput` value (Lightning's ``key``, e.g. ``time``,
    ``lengths``, ``device/mfu``), kept apart from the stage's own metrics."""
    return f"throughput/{stage}/{key}"


def of_stage(key: str, stage: str) -> bool:
    """Whether ``key`` is one of ``stage``'s own metrics (``train/...``; a throughput key is not)."""
    return key.startswith(f"{stage}/")


EVAL_COUNTS = ("batches", "sequences", "tokens")  # what an evaluation counts as it runs


def eval_count(stage: str, what: str) -> str:
    """How many batches, sequences or scored target tokens an evaluation of ``stage`` really read (all
    processes together): what ran, not the configured limit."""
    if what not in EVAL_COUNTS:
        raise ValueError(f"what must be one of {EVAL_COUNTS}, got {what!r}")
    return f"{stage}/{what}"


def trailing_loss(stage: str) -> str:
    """Loss over the trailing window of positions."""
    return f"{stage}/loss_trailing"


def position_loss(stage: str, start: int, end: int) -> str:
    """Loss over target positions ``[start, end)``."""
    return f"{stage}/loss_pos_{start:06d}_{end:06d}"


def position_window(key: str) -> tuple[int, int] | None:
    """``(start, end)`` of a :func:`position_loss` key, or None for any other key."""
    match = POSITION_KEY.match(key)
    return (int(match[2]), int(match[3])) if match else None


def bin_label(low: int, high: int | None) -> str:
    """A distance bin's label: ``"128–256"``, or ``"512–∞"`` for the open last bin."""
    return f"{low:,}–" + ("∞" if high is None else f"{high:,}")
