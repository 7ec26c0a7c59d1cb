"""MoBA attention backends: one protocol, one registry, one ``"auto"`` policy.

A backend computes exact MoBA attention for a selection the gate already made, for queries
at any place of the sequence:

    attend(q, k, v, selection, scale, *, query_start=0) -> out
    q: [B, H, S, D] at positions [query_start, query_start + S),
    k, v: [B, H_kv, query_start + S, D] (H % H_kv == 0), every key up to the last query,
    selection: Selection of those queries (layout rows in global positions), scale: float
    ->  out: [B, H, S, Dv] in q's dtype

``query_start`` is 0 for a whole sequence; context parallelism (:mod:`flexmoba.context_parallel`)
passes each rank's first position. A backend may also decode new queries at the end of a KV
cache, gated already:

    decode(step) -> out
    step: flexmoba.backends.protocol.DecodeStep (the new queries, every cached key and value,
    the chunk state, the gate's choice)  ->  out: [B, H, S_new, Dv] in q's dtype

A backend that does not decode, or takes no ``query_start > 0``, says so when registered
(:func:`register_backend`); decoding and context parallelism then refuse it by name, never
replace it by another one.

:func:`flexmoba.moba_attention`, :func:`flexmoba.moba_decode_attention` and
:func:`flexmoba.context_parallel.context_parallel_attention` validate their inputs, run the gate
once and call the backend by name, so a kernel registered here (a FlashMoBA binding, say) gets
flexmoba's gate, validation, context parallelism and test suites for free. Its output is checked
on every call (shape, dtype, device), and with ``register_backend(..., debug=True)`` against the
dense math on a sample of rows (:mod:`flexmoba.backends.checked`). ``"auto"`` is not a
backend but a choice among them, by the device's profile (:mod:`flexmoba.tuning`).

Built-in backends (all exact), each in its module, loaded on first use: ``"flex"`` and
``"flex_union"`` (:mod:`flexmoba.backends.flex`), ``"gather"`` (:mod:`flexmoba.backends.gather`),
``"sdpa"`` (:mod:`flexmoba.backends.sdpa`).
"""

from flexmoba.backends.registry import (
    AUTO,
    Backend,
    backend,
    backend_names,
    get_backend,
    get_context_parallel_backend,
    get_decode_backend,
    needs_grad,
    register_backend,
    resolve_backend,
    resolve_context_parallel_backend,
    resolve_decode_backend,
)

__all__ = [
    "AUTO",
    "Backend",
    "backend",
    "backend_names",
    "get_backend",
    "get_context_parallel_backend",
    "get_decode_backend",
    "needs_grad",
    "register_backend",
    "resolve_backend",
    "resolve_context_parallel_backend",
    "resolve_decode_backend",
]
