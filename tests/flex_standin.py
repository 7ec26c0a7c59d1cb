"""A differentiable FlexAttention stand-in: what the compiled kernel computes, in plain torch.

FlexAttention has no CPU backward, so the GPU training path (the regrouped plan without the
sink, flex's own log-sum-exp, the gradient through the merge) cannot run on CPU. This
function can: dense math over small shapes, autograd through the output and the LSE.

It follows the compiled kernel, not eager flex. For query block i the kernel visits only the
key blocks its ``BlockMask`` lists: the partial ones (``kv_num_blocks`` / ``kv_indices``)
with ``mask_mod`` applied, the full ones (``full_kv_num_blocks`` / ``full_kv_indices``)
without it; every other key is skipped. Eager flex instead applies ``mask_mod`` to every
pair and ignores the tables, so a wrong table shows here and not there.

Conventions as flex's: ``score_mod`` modifies ``q . k * scale``; the LSE is the natural log
(flex's kernels work in base 2 and the frontend converts, see pytorch PR 133159), fp32,
``[B, H, L]``; a row that attends nothing gets output 0 and LSE ``-inf``.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask


def listed_blocks(num: torch.Tensor, indices: torch.Tensor, n_kv_blocks: int) -> torch.Tensor:
    """``num: [B, H, T]``, ``indices: [B, H, T, N]`` -> ``[B, H, T, n_kv_blocks]`` bool: the first
    ``num`` entries of each row of ``indices``, as a dense map."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num[..., None]
    slots = torch.where(listed, indices.long(), n_kv_blocks)  # unlisted: a spare column
    dense = torch.zeros(*indices.shape[:-1], n_kv_blocks + 1, dtype=torch.bool, device=indices.device)
    return dense.scatter(-1, slots, True)[..., :n_kv_blocks]


def block_map_to_pairs(blocks: torch.Tensor, block_size: tuple[int, int], q_len: int, kv_len: int) -> torch.Tensor:
    """``[B, H, T, N]`` bool block map -> ``[B, H, q_len, kv_len]`` bool, per (query, key)."""
    Bq, Bk = block_size
    tile = torch.arange(q_len, device=blocks.device) // Bq
    column = torch.arange(kv_len, device=blocks.device) // Bk
    return blocks[:, :, tile][:, :, :, column]


def visited_pairs(block_mask: BlockMask, B: int, H: int, q_len: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``, each ``[B, H, q_len, kv_len]`` bool: the pairs in a listed partial
    block and those in a listed full block (tables of batch or head size 1 broadcast)."""
    Bq, Bk = block_mask.BLOCK_SIZE
    n_kv_blocks = -(-kv_len // Bk)
    maps = []
    for num, indices in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                         (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if num is None:
            maps.append(torch.zeros(B, H, q_len, kv_len, dtype=torch.bool, device=block_mask.kv_indices.device))
            continue
        blocks = listed_blocks(num, indices, n_kv_blocks).expand(B, H, -1, -1)
        maps.append(block_map_to_pairs(blocks, (Bq, Bk), q_len, kv_len))
    return maps[0], maps[1]


def index_grid(B: int, H: int, q_len: int, kv_len: int, device) -> tuple[torch.Tensor, ...]:
    """``(b, h, q_idx, kv_idx)`` int64 index tensors that broadcast to ``[B, H, q_len, kv_len]``."""
    def axis(n, dim):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(n, device=device).view(shape)

    return axis(B, 0), axis(H, 1), axis(q_len, 2), axis(kv_len, 3)


def check_lengths(block_mask: BlockMask, q_len: int, kv_len: int) -> None:
    if tuple(block_mask.seq_lengths) != (q_len, kv_len):
        raise ValueError(f"flex_standin: block_mask is for (q_len, kv_len) = {tuple(block_mask.seq_lengths)}, "
                         f"got ({q_len}, {kv_len})")


def attend(scores: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``scores``, ``allowed``: ``[B, H, L, S]``, ``v: [B, H, S, Dv]`` -> (out fp32, natural-log lse).

    Safe where a row attends nothing (out 0, lse -inf) and finite gradients there.
    """
    masked = scores.masked_fill(~allowed, float("-inf"))
    row_max = masked.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    weights = torch.exp(masked - row_max)  # 0 where not allowed
    total = weights.sum(-1, keepdim=True)
    attended = total > 0
    safe_total = torch.where(attended, total, torch.ones_like(total))
    out = (weights / safe_total) @ v.float()
    lse = torch.where(attended, row_max + torch.log(safe_total), torch.full_like(total, float("-inf")))
    return out, lse[..., 0]


def flex_standin(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
                 kernel_options=None, *, return_aux: AuxRequest | None = None):
    """``flex_attention`` as the compiled kernel computes it, differentiable, on any device.

    ``q: [B, H, L, D]``, ``k: [B, H_kv, S, D]``, ``v: [B, H_kv, S, Dv]`` (``H_kv < H`` needs
    ``enable_gqa``) -> ``out: [B, H, L, Dv]`` in q's dtype, or ``(out, AuxOutput(lse=[B, H, L]))``
    with ``return_aux=AuxRequest(lse=True)``. ``kernel_options`` are accepted and ignored.
    """
    H, D = q.shape[1], q.shape[3]
    H_kv = k.shape[1]
    if H_kv != H:
        if not enable_gqa:
            raise ValueError(f"flex_standin: {H} query heads but {H_kv} key heads need enable_gqa=True")
        k, v = (x.repeat_interleave(H // H_kv, dim=1) for x in (k, v))
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    with torch.autocast(q.device.type, enabled=False) if torch.amp.is_autocast_available(q.device.type) \
            else contextlib.nullcontext():  # flex is not autocast: fp32 math on the given dtype
        out, lse = _flex_math(q, k, v, score_mod, block_mask, scale)
    out = out.to(q.dtype)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=None)
    return (out, lse) if return_lse else out


def _flex_math(q, k, v, score_mod, block_mask, scale):
    B, H, L, _ = q.shape
    S = k.shape[2]
    b, h, q_idx, kv_idx = index_grid(B, H, L, S, q.device)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx).float()
    if block_mask is None:
        allowed = torch.ones(B, H, L, S, dtype=torch.bool, device=q.device)
    else:
        check_lengths(block_mask, L, S)
        partial, full = visited_pairs(block_mask, B, H, L, S)
        allowed = full | (partial & block_mask.mask_mod(b, h, q_idx, kv_idx))
    return attend(scores, allowed, v)
