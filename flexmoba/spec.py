"""MobaSpec: what MoBA attends and which backend computes it, validated once.

One frozen value holds MoBA's settings wherever they live: the functional API
(``moba_attention(q, k, v, spec)``), :class:`flexmoba.model.ModelConfig`'s ``moba`` field,
the Hugging Face adapter's ``config.moba`` and the sweep's attention entries. Its
constructor checks every field and names the one that is wrong, so a bad value fails
where it is written, not at the first forward.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from flexmoba import validation
from flexmoba.backends.registry import AUTO, backend_names

__all__ = ["Granularity", "MobaSpec", "resolve_spec", "takes_settings"]

Granularity = Literal["token"] | int


@dataclass(frozen=True)
class MobaSpec:
    """MoBA's settings.

    Attributes:
        chunk_size: tokens per chunk (chunks restart at each document start).
        top_k: chunks each query attends, its own chunk included.
        granularity: ``"token"`` (the paper: every query gates alone) or an int tile size
            dividing ``chunk_size`` (the queries of a tile share one selection).
        backend: ``"auto"`` or a registered backend (:func:`flexmoba.backend_names`).
    """

    chunk_size: int
    top_k: int
    granularity: Granularity = "token"
    backend: str = "auto"

    def __post_init__(self) -> None:
        chunk_size = validation.check_positive_int(self.chunk_size, "MobaSpec.chunk_size")
        validation.check_positive_int(self.top_k, "MobaSpec.top_k")
        validation.check_granularity(self.granularity, chunk_size, "MobaSpec.granularity")
        if self.backend != AUTO and self.backend not in backend_names():
            raise ValueError(f"MobaSpec.backend must be one of {(AUTO, *backend_names())}, got {self.backend!r}")


def resolve_spec(spec: MobaSpec | None, chunk_size=None, top_k=None, granularity=None, backend=None) -> MobaSpec:
    """The spec of a call that takes either ``spec`` or the keyword settings, never both."""
    keywords = {"chunk_size": chunk_size, "top_k": top_k, "granularity": granularity, "backend": backend}
    given = {name: value for name, value in keywords.items() if value is not None}
    if spec is not None:
        if not isinstance(spec, MobaSpec):
            raise TypeError(f"spec must be a MobaSpec, got {type(spec).__name__}")
        if given:
            raise ValueError(f"pass MoBA's settings as spec or as keywords, not both (got spec and {sorted(given)})")
        return spec
    missing = [name for name in ("chunk_size", "top_k") if name not in given]
    if missing:
        raise TypeError(f"missing MoBA setting(s) {', '.join(missing)}: give them as keywords or as spec=MobaSpec(...)")
    return MobaSpec(**given)


SETTINGS = ("chunk_size", "top_k", "granularity", "backend")
F = TypeVar("F", bound=Callable)


def takes_settings(fn: F) -> F:
    """Let ``fn(..., spec, ...)`` take MoBA's settings as the keywords ``chunk_size``, ``top_k``,
    ``granularity`` and ``backend`` instead of ``spec``: they become its :class:`MobaSpec` here,
    so ``fn`` always receives one (:func:`resolve_spec`'s rules)."""
    signature = inspect.signature(fn)
    parameters = [p.replace(default=None) if p.name == "spec" else p for p in signature.parameters.values()]
    binder = signature.replace(parameters=parameters)

    @functools.wraps(fn)
    def with_spec(*args, **kwargs):
        given = {name: kwargs.pop(name) for name in SETTINGS if name in kwargs}
        bound = binder.bind(*args, **kwargs)
        bound.arguments["spec"] = resolve_spec(bound.arguments.get("spec"), **given)
        return fn(*bound.args, **bound.kwargs)

    settings = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in SETTINGS]
    keyword_only = next((i for i, p in enumerate(parameters) if p.kind is p.KEYWORD_ONLY), len(parameters))
    shown = parameters[:keyword_only] + settings + parameters[keyword_only:]
    with_spec.__signature__ = binder.replace(parameters=shown)
    return with_spec
