"""MoBA attention backends: one table, one signature.

A backend is a function ``fn(q, k, v, selection, scale) -> out`` that computes exact MoBA
attention for a selection the gate already made:

    q: [B, H, S, D], k, v: [B, H_kv, S, D] (H % H_kv == 0), selection: Selection,
    scale: float  ->  out: [B, H, S, Dv] in q's dtype

:func:`flexmoba.moba_attention` validates its inputs, runs the gate once and calls the
backend by name, so a kernel registered here (a FlashMoBA binding, say) gets flexmoba's
gate, validation and test suites for free. ``"auto"`` is not a backend but a choice among
them, made by :func:`flexmoba.attention.resolve_backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flexmoba.gate import Selection

Backend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "Selection", float], torch.Tensor]

AUTO = "auto"
_TABLE: dict[str, Backend] = {}


def register_backend(name: str, fn: Backend, *, replace: bool = False) -> None:
    """Make ``fn`` callable as ``moba_attention(..., backend=name)``.

    Registering a name that exists raises ``ValueError`` unless ``replace=True``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"backend name must be a non-empty str, got {name!r}")
    if name == AUTO:
        raise ValueError(f"backend name {AUTO!r} is reserved for the automatic choice")
    if not callable(fn):
        raise TypeError(f"backend {name!r} must be callable fn(q, k, v, selection, scale), got {type(fn).__name__}")
    if name in _TABLE and not replace:
        raise ValueError(f"backend {name!r} is already registered; pass replace=True to replace it")
    _TABLE[name] = fn


def unregister_backend(name: str) -> None:
    """Remove a registered backend (``KeyError`` if there is none of that name)."""
    del _TABLE[name]


def get_backend(name: str) -> Backend:
    return _TABLE[check_backend(name)]


def backend_names() -> tuple[str, ...]:
    """Every registered backend, in registration order (``"auto"`` excluded)."""
    return tuple(_TABLE)


def check_backend(name) -> str:
    if name != AUTO and name not in _TABLE:
        raise ValueError(f"backend must be one of {(AUTO, *_TABLE)}, got {name!r}")
    return name
