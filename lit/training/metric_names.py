"""The names LitLM logs its metrics under: written here once, read by every report.

``stage`` is ``"train"``, ``"val"`` or ``"test"``; position windows are ``[start, end)``
target positions.
"""

from __future__ import annotations

import re

POSITION_KEY = re.compile(r"^(\w+)/loss_pos_(\d+)_(\d+)$")


def loss(stage: str) -> str:
    """Token-mean cross-entropy, nats per token."""
    return f"{stage}/loss"


def perplexity(stage: str) -> str:
    return f"{stage}/ppl"


def bits_per_byte(stage: str) -> str:
    return f"{stage}/bpb"


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
