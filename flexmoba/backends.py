"""MoBA attention backends: one table, one signature, one ``"auto"`` policy.

A backend computes exact MoBA attention for a selection the gate already made:

    attend(q, k, v, selection, scale) -> out
    q: [B, H, S, D], k, v: [B, H_kv, S, D] (H % H_kv == 0), selection: Selection,
    scale: float  ->  out: [B, H, S, Dv] in q's dtype

and may also decode: ``decode(step) -> out`` for a gated decode call
(:class:`flexmoba.decode.DecodeStep`: new queries at the end of a KV cache). A backend
without ``decode`` is refused by name when decoding asks for it.

:func:`flexmoba.moba_attention` and :func:`flexmoba.moba_decode_attention` validate their
inputs, run the gate once and call the backend by name, so a kernel registered here (a
FlashMoBA binding, say) gets flexmoba's gate, validation and test suites for free.
``"auto"`` is not a backend but a choice among them (:func:`resolve_backend`).

Built-in backends (all exact):

- ``"flex"``: FlexAttention, block-sparse. Token granularity runs the regrouped plan
  (:mod:`flexmoba.flex_plan`: one virtual row per (query, selected chunk), merged by
  log-sum-exp); tile granularity runs the union ``BlockMask``, which is exactly sparse
  there. Trains on CUDA; on CPU it is inference only (FlexAttention has no CPU backward).
- ``"flex_union"``: the union ``BlockMask`` over the original query order, any
  granularity. Exact, but at token granularity a tile's union of selections is nearly
  dense, so it costs about as much as full attention.
- ``"gather"``: queries regrouped per selected chunk, dense attention per group, partial
  results merged by log-sum-exp (:mod:`flexmoba.gather`): differentiable on every device,
  fused on CPU, work and memory O(S * top_k * chunk_size).
- ``"sdpa"``: the mask made dense ``[B, H, S, S]`` for SDPA: differentiable everywhere,
  O(S^2) memory; the fastest for short sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from flexmoba.block_mask import selection_block_mask
from flexmoba.compiled_flex import compiled_flex_attention
from flexmoba.flex_plan import plan_from_selection
from flexmoba.gather import gather_moba_attention
from flexmoba.masks import dense_moba_mask

if TYPE_CHECKING:
    from flexmoba.decode import DecodeStep
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


def _refuse_cpu_grad(q, k, v) -> None:
    if q.device.type == "cpu" and needs_grad(q, k, v):
        raise ValueError(
            "backend='flex' cannot compute gradients on CPU (FlexAttention has no CPU backward); "
            "use backend='gather' or 'auto', or call under torch.no_grad()"
        )


def flex_union_backend(q, k, v, selection: Selection, scale: float) -> torch.Tensor:
    """Compiled flex over the union ``BlockMask`` in the original query order."""
    _refuse_cpu_grad(q, k, v)
    block_mask = selection_block_mask(selection, compute_q_blocks=needs_grad(q, k, v))
    return compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def flex_backend(q, k, v, selection: Selection, scale: float) -> torch.Tensor:
    """Regrouped flex for token granularity, the (exactly sparse) union mask for tiles."""
    if selection.granularity != "token":
        return flex_union_backend(q, k, v, selection, scale)
    _refuse_cpu_grad(q, k, v)
    plan = plan_from_selection(selection, k.shape[1], sink=q.device.type == "cpu",
                               compute_q_blocks=needs_grad(q, k, v))
    return plan.attention(q, k, v, scale=scale)


def sdpa_backend(q, k, v, selection: Selection, scale: float) -> torch.Tensor:
    mask = dense_moba_mask(selection)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


register_backend("flex", flex_backend)
register_backend("flex_union", flex_union_backend)
register_backend("gather", gather_moba_attention)
register_backend("sdpa", sdpa_backend)
