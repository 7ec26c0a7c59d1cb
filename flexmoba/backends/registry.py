"""The backend registry: names to :class:`Backend` entries, the built-ins loaded on first use.

Loading lazily lets :class:`flexmoba.MobaSpec` check a backend's name without importing a kernel.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flexmoba.backends.protocol import AttendFn, DecodeFn
from flexmoba.tuning import tuning_for

__all__ = [
    "AUTO",
    "Backend",
    "backend_names",
    "get_backend",
    "get_decode_backend",
    "needs_grad",
    "register_backend",
    "resolve_backend",
    "resolve_decode_backend",
]

AUTO = "auto"

# Each built-in backend's module defines BACKENDS: {name: Backend}.
BUILT_IN = {
    "flex": "flexmoba.backends.flex.backend",
    "flex_union": "flexmoba.backends.flex.backend",
    "gather": "flexmoba.backends.gather.backend",
    "sdpa": "flexmoba.backends.sdpa.backend",
}


@dataclass(frozen=True)
class Backend:
    """One backend.

    Attributes:
        attend: ``attend(q, k, v, selection, scale, *, query_start=0) -> out`` (the protocol in
            :mod:`flexmoba.backends`).
        decode: ``decode(step) -> out``, or None: the backend does not decode.
        context_parallel: whether ``attend`` takes queries at ``query_start > 0`` (keys
            ``[0, query_start + S)``), which context parallelism needs.
        checked: whether its outputs are checked where it is called (one registered with
            :func:`register_backend`; the built-ins are proven by the test suites).
        debug: whether the check also compares values with the dense math.
    """

    attend: AttendFn
    decode: DecodeFn | None = None
    context_parallel: bool = True
    checked: bool = False
    debug: bool = False


_registered: dict[str, Backend] = {}


def _takes_query_start(fn: Callable) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension without a signature: trust it
        return True
    return any(p.name == "query_start" or p.kind is p.VAR_KEYWORD for p in parameters)


def register_backend(name: str, fn: AttendFn, *, decode: DecodeFn | None = None, context_parallel: bool = True,
                     replace: bool = False, debug: bool = False) -> None:
    """Make ``fn`` callable as ``moba_attention(..., backend=name)``, ``decode`` (if given) as
    ``moba_decode_attention(..., backend=name)``, and both under context parallelism unless
    ``context_parallel=False`` (then context parallelism refuses the name).

    ``fn(q, k, v, selection, scale, *, query_start=0)`` must take ``query_start``. Registering a
    name that exists raises ``ValueError`` unless ``replace=True``.

    Every call's output is checked (shape ``[B, H, S, Dv]``, q's dtype and device; a ``RuntimeError``
    naming the backend otherwise). ``debug=True`` also compares each call's output on a sample of query
    rows (decode: every new query) with MoBA's dense math, and raises at the first row that differs
    (:mod:`flexmoba.backends.checked`): slower, for proving a kernel in a real model.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"backend name must be a non-empty str, got {name!r}")
    if name == AUTO:
        raise ValueError(f"backend name {AUTO!r} is reserved for the automatic choice")
    if fn is None:
        raise TypeError(f"backend {name!r} must be callable fn(q, k, v, selection, scale, *, query_start=0), got None")
    for role, f in (("fn", fn), ("decode", decode)):
        if f is not None and not callable(f):
            raise TypeError(f"backend {name!r}: {role} must be callable, got {type(f).__name__}")
    if not _takes_query_start(fn):
        raise TypeError(f"backend {name!r}: fn must take the keyword query_start (fn(q, k, v, selection, scale, *, "
                        "query_start=0)); declare context_parallel=False if it only handles query_start=0")
    for flag, value in (("context_parallel", context_parallel), ("debug", debug)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {value!r}")
    if name in backend_names() and not replace:
        raise ValueError(f"backend {name!r} is already registered; pass replace=True to replace it")
    _registered[name] = Backend(fn, decode, context_parallel, checked=True, debug=debug)


def backend_names() -> tuple[str, ...]:
    """Every backend, the built-ins first, then in registration order (``"auto"`` excluded)."""
    return (*BUILT_IN, *(name for name in _registered if name not in BUILT_IN))


def backend(name: str) -> Backend:
    """The entry of backend ``name`` (``ValueError`` naming the registered ones otherwise)."""
    if name not in _registered and name in BUILT_IN:
        _registered[name] = importlib.import_module(BUILT_IN[name]).BACKENDS[name]
    if name not in _registered:
        raise ValueError(f"backend must be one of {(AUTO, *backend_names())}, got {name!r}")
    return _registered[name]


def get_backend(name: str) -> AttendFn:
    """The attention function of a registered backend."""
    return backend(name).attend


def get_decode_backend(name: str) -> DecodeFn:
    """The decode function of a registered backend; ``ValueError`` naming it if it does not decode."""
    decode = backend(name).decode
    if decode is None:
        decoders = tuple(n for n in backend_names() if backend(n).decode is not None)
        raise ValueError(f"backend {name!r} does not decode; decode with backend='auto' or one of {decoders}")
    return decode


def get_context_parallel_backend(name: str) -> AttendFn:
    """The attention function of a backend that takes queries at an offset; ``ValueError`` naming it
    if it declared it cannot."""
    entry = backend(name)
    if not entry.context_parallel:
        able = tuple(n for n in backend_names() if backend(n).context_parallel)
        raise ValueError(f"MobaSpec.backend={name!r} has no context-parallel path; use one of {(AUTO, *able)}")
    return entry.attend


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def resolve_backend(spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The backend ``spec.backend`` names (``spec``: a :class:`flexmoba.MobaSpec`), with ``"auto"`` resolved
    for this call by the device's profile (:mod:`flexmoba.tuning`).

    ``auto``: ``flex`` where the profile sets no ``auto_gather_min_seq`` (GPUs). On CPU, the fastest
    exact backend measured for the call: tile granularity without gradients from
    ``auto_tile_flex_min_seq`` on, ``flex`` (compiled once per shape); otherwise ``gather`` once
    ``S > chunk_size * top_k`` and ``S >= auto_gather_min_seq``, ``sdpa`` below.
    """
    if spec.backend != AUTO:
        return spec.backend
    tuning = tuning_for(q.device)
    if tuning.auto_gather_min_seq is None:
        return "flex"
    S = q.shape[2]
    tile_flex = tuning.auto_tile_flex_min_seq
    if spec.granularity != "token" and not needs_grad(q, k, v) and tile_flex is not None and S >= tile_flex:
        return "flex"
    return "gather" if S > spec.chunk_size * spec.top_k and S >= tuning.auto_gather_min_seq else "sdpa"


def resolve_context_parallel_backend(backend: str, q: torch.Tensor) -> str:
    """``auto`` under context parallelism: ``flex`` where the profile picks it, else ``gather`` (exact
    at any length; the dense mask would be ``[S / n, S]``)."""
    if backend != AUTO:
        return backend
    return "flex" if tuning_for(q.device).auto_gather_min_seq is None else "gather"


def resolve_decode_backend(backend: str, n_queries: int, n_chunks: int, top_k: int,
                           device: torch.device | str = "cpu") -> str | None:
    """The decode backend ``backend`` names, with ``"auto"`` resolved; ``None``: dense attention.

    ``auto``: when every query's own chunk index is below ``top_k`` (``n_chunks <= top_k``,
    ``n_chunks`` of the longest row), MoBA selects every earlier chunk and equals full causal
    attention, so it runs as dense attention (``None``), no gate, no chunk state. (One
    difference, on non-finite input only: MoBA never selects a past chunk whose gate score
    is NaN or -inf; dense attention attends it.) Otherwise ``gather`` for up to the profile's
    ``decode_gather_max_queries`` new queries, ``sdpa`` for more. A named backend is returned as
    it is, at every context length.
    """
    if backend != AUTO:
        return backend
    if n_chunks <= top_k:
        return None
    return "gather" if n_queries <= tuning_for(device).decode_gather_max_queries else "sdpa"
