"""Dense attention, the exact math every backend and entry point shares.

- :func:`dense_attention` and :func:`dense_attention_backward`: ``q: [N, 1, L, D]`` against
  ``k, v: [N, 1, M, D]``, causal or not, returning the log-sum-exp with the output (the parts the
  ``gather`` backend and context parallelism merge); torch's fused CPU flash kernel where it can, plain
  operations in bounded pieces elsewhere.
- :func:`masked_attention` and :func:`dense_causal_attention`: queries at the end of a KV cache under a
  boolean mask (SDPA), or fully causal: decoding's dense shortcut and the ``sdpa`` backend's decode.

Padding (left, ``start[b]`` the first real position of row b): real queries never attend the positions
before ``start``, even when they hold non-finite values; padding queries attend only themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexmoba.masks import cache_causal_mask
from flexmoba.tuning import tuning_for

__all__ = ["dense_attention", "dense_attention_backward", "dense_causal_attention", "finite_lse", "masked_attention",
           "nan_where_nothing_attended", "unfused_pieces", "zero_padding"]


def fused_cpu(q: torch.Tensor) -> bool:
    on_cpu = q.device.type == "cpu" and tuning_for(q.device).gather_fused_kernel
    return on_cpu and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _causal_mask(n: int, m: int, device) -> torch.Tensor:
    return torch.ones(n, m, dtype=torch.bool, device=device).tril()


def dense_attention(q, k, v, causal: bool, scale: float):
    """``q: [N, 1, L, D]``, ``k, v: [N, 1, M, D]`` -> (out ``[N, 1, L, Dv]``, lse ``[N, 1, L]`` fp32).

    A row whose logits are all -inf (non-finite keys) attends nothing: out 0, lse -inf, so that it
    merges as nothing (:func:`nan_where_nothing_attended` makes a row that attends nothing at all NaN).
    """
    if fused_cpu(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return _recompute_rows_of_zero_lse(out, lse, q, k, v, causal, scale)
    pieces = unfused_pieces(q.shape[0], q.shape[-2] * k.shape[-2], q.device)
    if len(pieces) == 1:
        return _unfused_attention(q, k, v, causal, scale)
    out = v.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    for first, end in pieces:
        out[first:end], lse[first:end] = _unfused_attention(q[first:end], k[first:end], v[first:end], causal, scale)
    return out, lse


def unfused_pieces(n: int, scores_per_item: int, device) -> list[tuple[int, int]]:
    """``[(first, end), ...]``: the n items of an unfused batch in consecutive pieces whose fp32 scores
    (``scores_per_item`` each) stay within ``Tuning.gather_unfused_scores`` (one item at least): memory
    linear in the rows, not in the pieces' product."""
    size = max(1, tuning_for(device).gather_unfused_scores // max(1, scores_per_item))
    return [(first, min(first + size, n)) for first in range(0, n, size)] or [(0, 0)]


def _unfused_attention(q, k, v, causal: bool, scale: float):
    """:func:`dense_attention` as plain operations, all of the batch at once."""
    logits = (q @ k.transpose(-1, -2)).float() * scale
    if causal:
        logits = logits.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return (torch.exp(logits - finite_lse(lse)[..., None]).to(v.dtype) @ v), lse


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row or part that attends nothing) as 0: ``exp(x - lse)`` is then 0 for x = -inf,
    where ``exp(-inf - -inf)`` would be NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _recompute_rows_of_zero_lse(out, lse, q, k, v, causal: bool, scale: float):
    """The CPU kernel's ``(out [N, 1, L, Dv], lse [N, 1, L])`` with the rows of lse 0 (rare) recomputed: the
    kernel gives out 0 and lse 0 to a row whose logits are all -inf, as to a fully masked row, and to one
    whose only logit is NaN or +inf. Recomputed, such a row has lse -inf (out 0), or NaN."""
    n, _, row = (lse == 0).nonzero(as_tuple=True)
    if len(n):
        logits = (k[n, 0].float() @ q[n, 0, row].float()[..., None])[..., 0] * scale  # [R, M]
        if causal:
            logits = logits.masked_fill(torch.arange(k.shape[2], device=q.device) > row[:, None], float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)
        row_out = (torch.exp(logits - finite_lse(row_lse)[:, None])[:, None] @ v[n, 0].float())[:, 0]
        where = (n, torch.zeros_like(n), row)
        out, lse = out.index_put(where, row_out.to(out.dtype)), lse.index_put(where, row_lse)
    return out, lse


def nan_where_nothing_attended(out: torch.Tensor, lse: torch.Tensor) -> None:
    """NaN, in place, in the rows of ``out: [N, Dv]`` whose merged ``lse: [N]`` is -inf: every logit of the
    row is -inf, and a softmax over them is NaN (a host read on CPU only, where it is no device sync)."""
    nothing = lse == float("-inf")
    if out.device.type != "cpu" or bool(nothing.any()):
        out.masked_fill_(nothing[:, None], float("nan"))


def dense_attention_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of :func:`dense_attention` given the *merged* ``out`` and ``lse`` of its queries."""
    if fused_cpu(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    pieces = unfused_pieces(q.shape[0], q.shape[-2] * k.shape[-2], q.device)
    if len(pieces) == 1:
        return _unfused_backward(grad_out, q, k, v, out, lse, causal, scale)
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)]
    for first, end in pieces:
        part = (x[first:end] for x in (grad_out, q, k, v, out, lse))
        for grad, piece in zip(grads, _unfused_backward(*part, causal, scale), strict=True):
            grad[first:end] = piece
    return tuple(grads)


def _unfused_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """:func:`dense_attention_backward` as plain operations, all of the batch at once."""
    logits = (q @ k.transpose(-1, -2)).float() * scale
    if causal:
        logits = logits.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    probs = torch.exp(logits - lse[..., None])
    grad_probs = grad_out.float() @ v.float().transpose(-1, -2)
    delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
    grad_logits = probs * (grad_probs - delta) * scale
    dq = grad_logits @ k.float()
    dk = grad_logits.transpose(-1, -2) @ q.float()
    dv = probs.transpose(-1, -2) @ grad_out.float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def masked_attention(q, keys, values, allowed, scale):
    """``allowed: [B, 1 or H, S_new, T]`` bool -> ``[B, H, S_new, Dv]`` via SDPA.

    SDPA adds the mask to ``q . k``: a NaN or inf in a key no row attends would still reach
    every row (NaN - inf). Keys holding one run through the plain softmax instead, whose
    masked logits are replaced, not added to (one check of the keys; a host read).
    """
    if not bool(torch.isfinite(keys).all()):
        return _plain_masked_attention(q, keys, values, allowed, scale)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale,
                                          enable_gqa=q.shape[1] != keys.shape[1])


def _plain_masked_attention(q, keys, values, allowed, scale):
    """:func:`masked_attention` as ``softmax(masked q k^T * scale) v`` in fp32."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (x.float().repeat_interleave(group, dim=1) for x in (keys, values))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q.float() @ keys.transpose(-1, -2)) * scale
    return (logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ values).to(q.dtype)


def zero_padding(keys, values, start: torch.Tensor):
    """Keys and values with the positions before ``start: [B]`` set to 0.

    SDPA adds the mask to ``q . k`` and multiplies probabilities by ``v``: a NaN or inf in a
    masked-out padding key or value would still reach every row (NaN - inf, 0 * inf).
    """
    real = (torch.arange(keys.shape[2], device=keys.device)[None, :] >= start[:, None])[:, None, :, None]
    return keys.masked_fill(~real, 0), values.masked_fill(~real, 0)


def dense_causal_attention(q, keys, values, start: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """Full causal attention of ``q: [B, H, S_new, D]`` aligned to the end of ``keys, values: [B, H_kv, T, D]``.

    ``start: [B]`` first real position of each row, or ``None`` for no padding. Real
    queries attend every real key up to themselves; padding queries attend only themselves.
    """
    B, H, S_new, D = q.shape
    H_kv, T = keys.shape[1], keys.shape[2]
    if start is not None:
        keys, values = zero_padding(keys, values, start)
    if S_new == 1:  # one query per head: the heads of a KV group become the query rows of one call
        allowed = None if start is None else cache_causal_mask(start, T, 1, q.device)[:, None]  # [B, 1, 1, T]
        out = F.scaled_dot_product_attention(q.reshape(B, H_kv, H // H_kv, D), keys, values,
                                             attn_mask=allowed, scale=scale)
        return out.reshape(B, H, 1, -1)
    if start is None and S_new == T:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale,
                                              enable_gqa=H != H_kv)
    start = torch.zeros(B, dtype=torch.long, device=q.device) if start is None else start
    return masked_attention(q, keys, values, cache_causal_mask(start, T, S_new, q.device)[:, None], scale)
