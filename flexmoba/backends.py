"""MoBA attention backends: one table, one signature, one ``"auto"`` policy.

A backend computes exact MoBA attention for a selection the gate already made:

    attend(q, k, v, selection, scale) -> out
    q: [B, H, S, D], k, v: [B, H_kv, S, D] (H % H_kv == 0), selection: Selection,
    scale: float  ->  out: [B, H, S, Dv] in q's dtype

and may also decode new queries at the end of a KV cache, gated already:

    decode(step) -> out
    step: flexmoba.decode_kernels.DecodeStep, with
        q: [B, H, S_new, D]             the new queries, at the last S_new cached positions
        keys, values: [B, H_kv, T, D]   every cached key and value
        sums: ChunkKeySums              chunk_size, start [B] (left padding), key blocks
        scale: float
        q_pos: [S_new]                  absolute positions, T - S_new + i
        q_local: [B, S_new]             positions from each row's start (< 0: padding)
        own: [B, S_new]                 each query's own chunk
        past, valid: [B, H, S_new, P]   the selected past chunks and which slots are used
    ->  out: [B, H, S_new, Dv] in q's dtype

(what each query attends: :class:`flexmoba.decode_kernels.DecodeStep`). A backend
registered without ``decode`` is refused by name when decoding asks for it, never
replaced by another one.

:func:`flexmoba.moba_attention` and :func:`flexmoba.moba_decode_attention` validate their
inputs, run the gate once and call the backend by name, so a kernel registered here (a
FlashMoBA binding, say) gets flexmoba's gate, validation and test suites for free.
``"auto"`` is not a backend but a choice among them (:func:`resolve_backend` for
attention, :func:`resolve_decode_backend` for decoding).

Built-in backends (all exact):

- ``"flex"``: FlexAttention, block-sparse. Token granularity runs the regrouped plan
  (:mod:`flexmoba.flex_plan`: one virtual row per (query, selected chunk), merged by
  log-sum-exp); tile granularity runs the union ``BlockMask``, which is exactly sparse
  there. Trains on CUDA; on CPU it is inference only (FlexAttention has no CPU backward),
  unless :func:`flexmoba.compiled_flex.use_flex_attention` sets a flex that has one.
- ``"flex_union"``: the union ``BlockMask`` over the original query order, any
  granularity. Exact, but at token granularity a tile's union of selections is nearly
  dense, so it costs about as much as full attention.
- ``"gather"``: queries regrouped per selected chunk, dense attention per group, partial
  results merged by log-sum-exp (:mod:`flexmoba.gather`): differentiable on every device,
  fused on CPU, work and memory O(S * top_k * chunk_size). Decodes by reading each query's
  selected keys (:func:`flexmoba.decode_kernels.gather_decode`: ``embedding_bag`` over the
  cache's transposed key blocks in fp32, a gathered copy otherwise).
- ``"sdpa"``: the mask made dense ``[B, H, S, S]`` for SDPA: differentiable everywhere,
  O(S^2) memory; the fastest for short sequences. Decodes with one ``[S_new, T]`` mask
  (:func:`flexmoba.decode_kernels.sdpa_decode`), the choice for chunked prefill.

``"flex"`` and ``"flex_union"`` do not decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flexmoba.block_mask import selection_block_mask
from flexmoba.compiled_flex import active_flex_attention, flex_trains_on, needs_sink
from flexmoba.decode_kernels import gather_decode, masked_attention, sdpa_decode
from flexmoba.flex_plan import plan_from_selection
from flexmoba.gather import gather_moba_attention
from flexmoba.masks import dense_moba_mask

if TYPE_CHECKING:
    from flexmoba.decode_kernels import DecodeStep
    from flexmoba.gate import Selection

__all__ = [
    "AUTO",
    "Backend",
    "DecodeBackend",
    "backend_names",
    "get_backend",
    "get_decode_backend",
    "register_backend",
    "resolve_backend",
    "resolve_decode_backend",
]

Backend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "Selection", float], torch.Tensor]
DecodeBackend = Callable[["DecodeStep"], torch.Tensor]

AUTO = "auto"

# CPU crossovers (2-core x86, fp32; benchmarks.attention and B=8 runs at 256-2048 tokens).
# Token granularity: gather beats the regrouped flex plan (with its sink key) at every
# length, and the dense-mask SDPA call from 512 tokens once some chunk can be skipped
# (S > chunk_size * top_k). Tile granularity without gradients: the union BlockMask is
# exactly sparse and fastest at length.
CPU_GATHER_MIN_SEQ = 512
CPU_TILE_FLEX_MIN_SEQ = 4096
# Decoding: up to this many new queries, read each query's selected keys (O(top_k *
# chunk_size) per query); beyond it (chunked prefill) one [S_new, T] mask for SDPA.
DECODE_GATHER_MAX_QUERIES = 16


@dataclass(frozen=True)
class BackendEntry:
    attend: Backend
    decode: DecodeBackend | None = None


_TABLE: dict[str, BackendEntry] = {}


def register_backend(name: str, fn: Backend, *, decode: DecodeBackend | None = None, replace: bool = False) -> None:
    """Make ``fn`` callable as ``moba_attention(..., backend=name)``, and ``decode`` (if given)
    as ``moba_decode_attention(..., backend=name)``.

    Registering a name that exists raises ``ValueError`` unless ``replace=True``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"backend name must be a non-empty str, got {name!r}")
    if name == AUTO:
        raise ValueError(f"backend name {AUTO!r} is reserved for the automatic choice")
    for role, f in (("fn", fn), ("decode", decode)):
        if f is not None and not callable(f):
            raise TypeError(f"backend {name!r}: {role} must be callable, got {type(f).__name__}")
    if fn is None:
        raise TypeError(f"backend {name!r} must be callable fn(q, k, v, selection, scale), got None")
    if name in _TABLE and not replace:
        raise ValueError(f"backend {name!r} is already registered; pass replace=True to replace it")
    _TABLE[name] = BackendEntry(fn, decode)


def backend_names() -> tuple[str, ...]:
    """Every registered backend, in registration order (``"auto"`` excluded)."""
    return tuple(_TABLE)


def get_backend(name: str) -> Backend:
    """The attention function of a registered backend (``KeyError`` for an unknown name)."""
    return _TABLE[name].attend


def get_decode_backend(name: str) -> DecodeBackend:
    """The decode function of a registered backend; ``ValueError`` naming it if it does not decode."""
    decode = _TABLE[name].decode
    if decode is None:
        decoders = tuple(n for n, entry in _TABLE.items() if entry.decode is not None)
        raise ValueError(f"backend {name!r} does not decode; decode with backend='auto' or one of {decoders}")
    return decode


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def resolve_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    chunk_size: int = 1, top_k: int = 1, granularity="token") -> str:
    """The backend ``backend`` names, with ``"auto"`` resolved for this call.

    ``auto``: ``flex`` off CPU. On CPU, the fastest exact backend measured for the call:
    tile granularity without gradients from ``CPU_TILE_FLEX_MIN_SEQ`` on, ``flex`` (compiled
    once per shape); otherwise ``gather`` once ``S > chunk_size * top_k`` and
    ``S >= CPU_GATHER_MIN_SEQ``, ``sdpa`` below.
    """
    if backend != AUTO:
        return backend
    if q.device.type != "cpu":
        return "flex"
    S = q.shape[2]
    if granularity != "token" and not needs_grad(q, k, v) and S >= CPU_TILE_FLEX_MIN_SEQ:
        return "flex"
    return "gather" if S > chunk_size * top_k and S >= CPU_GATHER_MIN_SEQ else "sdpa"


def resolve_decode_backend(backend: str, n_queries: int, n_chunks: int, top_k: int) -> str | None:
    """The decode backend ``backend`` names, with ``"auto"`` resolved; ``None``: dense attention.

    ``auto``: when every query's own chunk index is below ``top_k`` (``n_chunks <= top_k``,
    ``n_chunks`` of the longest row), MoBA selects every earlier chunk and equals full causal
    attention, so it runs as dense attention (``None``), no gate, no chunk state. (One
    difference, on non-finite input only: MoBA never selects a past chunk whose gate score
    is NaN or -inf; dense attention attends it.) Otherwise ``gather`` for up to
    ``DECODE_GATHER_MAX_QUERIES`` new queries, ``sdpa`` for more. A named backend is
    returned as it is, at every context length.
    """
    if backend != AUTO:
        return backend
    if n_chunks <= top_k:
        return None
    return "gather" if n_queries <= DECODE_GATHER_MAX_QUERIES else "sdpa"


def _refuse_cpu_grad(q, k, v) -> None:
    if not flex_trains_on(q.device) and needs_grad(q, k, v):
        raise ValueError(
            "backend='flex' cannot compute gradients on CPU (FlexAttention has no CPU backward); "
            "use backend='gather' or 'auto', or call under torch.no_grad()"
        )


def drops_non_finite_keys(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this flex call would lose a non-finite key: the compiled CPU kernel turns a row whose
    logits hit NaN or +inf in a partly masked block into zeros, not NaN. Such calls run ``gather``
    (exact) instead; one check of the keys, on CPU only (no device sync)."""
    return needs_sink(q.device) and not bool(torch.isfinite(k).all())


def flex_union_backend(q, k, v, selection: Selection, scale: float) -> torch.Tensor:
    """Compiled flex over the union ``BlockMask`` in the original query order."""
    _refuse_cpu_grad(q, k, v)
    if drops_non_finite_keys(q, k):
        return gather_moba_attention(q, k, v, selection, scale)
    block_mask = selection_block_mask(selection, compute_q_blocks=needs_grad(q, k, v))
    return active_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def flex_backend(q, k, v, selection: Selection, scale: float) -> torch.Tensor:
    """Regrouped flex for token granularity, the (exactly sparse) union mask for tiles."""
    if selection.granularity != "token":
        return flex_union_backend(q, k, v, selection, scale)
    _refuse_cpu_grad(q, k, v)
    if drops_non_finite_keys(q, k):
        return gather_moba_attention(q, k, v, selection, scale)
    plan = plan_from_selection(selection, k.shape[1], sink=needs_sink(q.device),
                               compute_q_blocks=needs_grad(q, k, v))
    return plan.attention(q, k, v, scale=scale)


def sdpa_backend(q, k, v, selection: Selection, scale: float) -> torch.Tensor:
    return masked_attention(q, k, v, dense_moba_mask(selection), scale)


register_backend("flex", flex_backend)
register_backend("flex_union", flex_union_backend)
register_backend("gather", gather_moba_attention, decode=gather_decode)
register_backend("sdpa", sdpa_backend, decode=sdpa_decode)
