"""The FlexAttention backends. Both train on CUDA; on CPU they are inference only (FlexAttention
has no CPU backward), unless :func:`flexmoba.backends.flex.compiled.use_flex_attention` sets a flex that has
one. Neither decodes.

- ``"flex"``: block-sparse. Token granularity runs the regrouped plan (:mod:`flexmoba.backends.flex.plan`:
  one virtual row per (query, selected chunk), merged by log-sum-exp), queries at any
  ``query_start``; tile granularity runs the union ``BlockMask``, which is exactly sparse there.
- ``"flex_union"``: the union ``BlockMask`` over the original query order, any granularity. Exact,
  but at token granularity a tile's union of selections is nearly dense, so it costs about as
  much as full attention; no context-parallel path.

The compiled CPU kernel turns a row whose logits hit NaN or +inf in a partly masked block into
zeros, not NaN; such calls run ``gather`` (exact) instead.
"""

from __future__ import annotations

import torch

from flexmoba.backends.flex.block_mask import selection_block_mask
from flexmoba.backends.flex.compiled import active_flex_attention, flex_trains_on, needs_sink
from flexmoba.backends.flex.plan import plan_from_selection
from flexmoba.backends.gather import backend as gather
from flexmoba.backends.registry import Backend, needs_grad
from flexmoba.gate import Selection

__all__ = ["BACKENDS", "attend", "attend_union", "drops_non_finite_keys"]


def _refuse_cpu_grad(q, k, v) -> None:
    if not flex_trains_on(q.device) and needs_grad(q, k, v):
        raise ValueError(
            "backend='flex' cannot compute gradients on CPU (FlexAttention has no CPU backward); "
            "use backend='gather' or 'auto', or call under torch.no_grad()"
        )


def drops_non_finite_keys(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this flex call would lose a non-finite key (one check of the keys, on CPU only: no
    device sync)."""
    return needs_sink(q.device) and not bool(torch.isfinite(k).all())


def attend_union(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Selection, scale: float, *,
                 query_start: int = 0) -> torch.Tensor:
    """Compiled flex over the union ``BlockMask`` in the original query order (``query_start`` 0 only)."""
    if query_start:
        raise ValueError("backend 'flex_union' takes no query_start; use 'flex', 'gather' or 'sdpa'")
    _refuse_cpu_grad(q, k, v)
    if drops_non_finite_keys(q, k):
        return gather.attend(q, k, v, selection, scale)
    block_mask = selection_block_mask(selection, compute_q_blocks=needs_grad(q, k, v))
    return active_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: Selection, scale: float, *,
           query_start: int = 0) -> torch.Tensor:
    """Regrouped flex for token granularity, the (exactly sparse) union mask for tiles:
    ``q: [B, H, S, D]`` at ``[query_start, query_start + S)``, ``k, v: [B, H_kv, query_start + S, D]``."""
    if selection.granularity != "token":
        return attend_union(q, k, v, selection, scale, query_start=query_start)
    _refuse_cpu_grad(q, k, v)
    if drops_non_finite_keys(q, k):
        return gather.attend(q, k, v, selection, scale, query_start=query_start)
    plan = plan_from_selection(selection, k.shape[1], sink=needs_sink(q.device),
                               compute_q_blocks=needs_grad(q, k, v), query_start=query_start)
    return plan.attention(q, k, v, scale=scale)


BACKENDS = {"flex": Backend(attend), "flex_union": Backend(attend_union, context_parallel=False)}
