"""MoBA attention: validate, gate once, dispatch to a backend of the table.

Built-in backends (all exact; see :mod:`flexmoba.backends` for the signature):

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
- ``"auto"``: flex on CUDA; on CPU the fastest exact backend for the call, by the
  crossovers measured in ``benchmarks/results/attention_cpu.md`` (see :func:`resolve_backend`):
  gather for token granularity, flex for long tile-granularity inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexmoba import validation
from flexmoba.backends import AUTO, get_backend, register_backend
from flexmoba.block_mask import selection_block_mask
from flexmoba.compiled_flex import compiled_flex_attention
from flexmoba.flex_plan import plan_from_selection
from flexmoba.gate import Selection, select_chunks
from flexmoba.gather import gather_moba_attention
from flexmoba.layout import ChunkLayout
from flexmoba.masks import dense_moba_mask

# CPU crossovers (2-core x86, fp32; benchmarks.attention and B=8 runs at 256-2048 tokens).
# Token granularity: gather beats the regrouped flex plan (with its sink key) at every
# length, and the dense-mask SDPA call from 512 tokens once some chunk can be skipped
# (S > chunk_size * top_k). Tile granularity without gradients: the union BlockMask is
# exactly sparse and fastest at length.
CPU_GATHER_MIN_SEQ = 512
CPU_TILE_FLEX_MIN_SEQ = 4096


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


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


def gather_backend(q, k, v, selection: Selection, scale: float) -> torch.Tensor:
    return gather_moba_attention(q, k, v, selection, scale)


register_backend("flex", flex_backend)
register_backend("flex_union", flex_union_backend)
register_backend("gather", gather_backend)
register_backend("sdpa", sdpa_backend)


def resolve_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    chunk_size: int = 1, top_k: int = 1, granularity="token") -> str:
    """The backend ``backend`` names, with ``"auto"`` resolved for this call.

    ``auto``: ``flex`` off CPU. On CPU, the fastest exact backend measured for the call:
    tile granularity without gradients from ``CPU_TILE_FLEX_MIN_SEQ`` on, ``flex`` (compiled
    once per shape); otherwise ``gather`` once ``S > chunk_size * top_k`` and
    ``S >= CPU_GATHER_MIN_SEQ``, ``sdpa`` below.
    """
    backend = validation.check_backend(backend)
    if backend != AUTO:
        return backend
    if q.device.type != "cpu":
        return "flex"
    S = q.shape[2]
    if granularity != "token" and not needs_grad(q, k, v) and S >= CPU_TILE_FLEX_MIN_SEQ:
        return "flex"
    return "gather" if S > chunk_size * top_k and S >= CPU_GATHER_MIN_SEQ else "sdpa"


def moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int,
    top_k: int,
    granularity="token",
    backend: str = "auto",
    scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    layout: ChunkLayout | None = None,
) -> torch.Tensor:
    """Causal MoBA attention.

    Args:
        q: ``[B, H, S, D]``; k, v: ``[B, H_kv, S, D]`` with ``H % H_kv == 0``.
        chunk_size: tokens per chunk; chunks restart at each document start.
        top_k: chunks per query, counting its own chunk.
        granularity: ``"token"`` (the paper) or an int tile size dividing ``chunk_size``.
        backend: ``"auto"`` or a registered backend (``"flex"``, ``"flex_union"``,
            ``"gather"``, ``"sdpa"``, or one added with :func:`flexmoba.register_backend`).
        scale: softmax scale, default ``D ** -0.5``.
        document_ids: optional ``[B, S]`` ints; nothing attends across documents.
        layout: optional prebuilt chunk layout of these documents (built once per model
            forward and shared by its layers; see :func:`flexmoba.gate.select_chunks`).

    Returns:
        ``[B, H, S, Dv]`` in q's dtype.
    """
    validation.check_qkv(q, k, v)
    scale = validation.check_scale(scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    validation.check_backend(backend)
    selection = select_chunks(
        q, k, chunk_size=chunk_size, top_k=top_k, granularity=granularity, document_ids=document_ids, layout=layout
    )
    backend = resolve_backend(backend, q, k, v, selection.layout.chunk_size, top_k, selection.granularity)
    return get_backend(backend)(q, k, v, selection, scale)
