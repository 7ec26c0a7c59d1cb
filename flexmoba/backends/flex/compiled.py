"""The ``flex_attention`` flexmoba calls: the process-wide compiled kernel, or one the caller sets.

Every FlexAttention call in flexmoba (the regrouped plan, the union-mask backends) goes
through :func:`active_flex_attention`. :func:`use_flex_attention` points them at another
callable with ``flex_attention``'s signature for the duration of a ``with`` block: a
differentiable stand-in in tests, an instrumented kernel, a newer build.

The sink rule. Compiled CPU flex cannot return the log-sum-exp, so on CPU the regrouped
plan recovers it with a sink key (:mod:`flexmoba.backends.flex.plan`). The sink is a property of
that kernel, not of the device: a custom flex must return the log-sum-exp when asked
(``return_aux=AuxRequest(lse=True)``), and while one is active the plan runs without the
sink on every device, as it does with the compiled kernel on GPU. Likewise flex's refusal
to train on CPU is the compiled kernel's: a custom flex brings its own backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.nn.attention.flex_attention import flex_attention

__all__ = ["active_flex_attention", "compiled_flex_attention", "custom_flex_attention", "flex_trains_on",
           "needs_sink", "use_flex_attention", "with_recompile_limit"]

# Each new shape compiles a new flex kernel; dynamo's default limit of 8 per function
# would otherwise drop to the unfused eager path after a few shapes.
FLEX_RECOMPILE_LIMIT = 64

_compiled_flex = None
# Process-wide, not per thread: the autograd engine recomputes checkpointed forwards on its own threads.
_custom_flex: Callable | None = None


def with_recompile_limit(compiled: Callable, limit: int = FLEX_RECOMPILE_LIMIT) -> Callable:
    """``compiled`` called with dynamo's ``recompile_limit`` raised to at least ``limit``
    for the call only; inside an outer ``torch.compile`` it is called as it is."""

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        current = torch._dynamo.config.recompile_limit
        with torch._dynamo.config.patch(recompile_limit=max(current, limit)):
            return compiled(*args, **kwargs)

    return call


def compiled_flex_attention() -> Callable:
    """The process-wide compiled ``flex_attention`` (compiled lazily, once).

    ``dynamic=False``: one kernel per shape. A dynamic kernel breaks on CPU once a second
    shape appears (torch 2.13), and training shapes are fixed anyway. Up to
    ``FLEX_RECOMPILE_LIMIT`` shapes compile; dynamo's setting for other functions is untouched.
    """
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = with_recompile_limit(torch.compile(flex_attention, dynamic=False))
    return _compiled_flex


@contextlib.contextmanager
def use_flex_attention(flex: Callable) -> Iterator[Callable]:
    """Route flexmoba's FlexAttention calls to ``flex`` inside the ``with`` block.

    ``flex`` takes ``(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
    return_aux=None)`` as ``flex_attention`` does and returns ``out`` or, with
    ``return_aux=AuxRequest(lse=True)``, ``(out, aux)`` with ``aux.lse`` the natural-log
    log-sum-exp ``[B, H, L]``. Blocks nest; on exit the previous flex is back.
    """
    global _custom_flex
    if not callable(flex):
        raise TypeError(f"use_flex_attention: flex must be callable, got {type(flex).__name__}")
    previous, _custom_flex = _custom_flex, flex
    try:
        yield flex
    finally:
        _custom_flex = previous


def custom_flex_attention() -> Callable | None:
    """The flex set by :func:`use_flex_attention`, or None."""
    return _custom_flex


def active_flex_attention() -> Callable:
    """The flex flexmoba calls now: the custom one if set, else the compiled kernel."""
    custom = _custom_flex
    return compiled_flex_attention() if custom is None else custom


def needs_sink(device: torch.device) -> bool:
    """Whether the regrouped plan needs the sink key: only the compiled kernel on CPU."""
    return device.type == "cpu" and _custom_flex is None


def flex_trains_on(device: torch.device) -> bool:
    """Whether the active flex has a backward on ``device`` (compiled flex has none on CPU)."""
    return device.type != "cpu" or _custom_flex is not None
