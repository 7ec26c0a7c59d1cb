"""Input validation shared by the public API (one place for every check).

Every check raises ``ValueError`` or ``TypeError`` with the offending parameter's
name, so bad input never turns into a silently wrong attention output.
"""

from __future__ import annotations

import numbers

import torch

__all__ = [
    "check_bool",
    "check_cache",
    "check_cache_update",
    "check_choice",
    "check_cu_seqlens",
    "check_decode_args",
    "check_document_ids",
    "check_gate_inputs",
    "check_granularity",
    "check_layout",
    "check_positive_int",
    "check_qk",
    "check_qkv",
    "check_scale",
    "check_start",
    "check_tensor",
    "check_means_gate",
    "check_sums_within",
    "softmax_scale",
]


def check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_granularity(granularity, chunk_size: int, name: str = "granularity") -> str | int:
    """``"token"`` or a positive int ``g`` that divides ``chunk_size``."""
    if granularity == "token":
        return granularity
    if isinstance(granularity, str):
        raise ValueError(f"{name} must be 'token' or a positive int, got {granularity!r}")
    g = check_positive_int(granularity, name)
    if chunk_size % g != 0:
        raise ValueError(
            f"{name}={g} must divide chunk_size={chunk_size}: a tile of queries shares "
            "one selection, so it must not straddle a chunk boundary"
        )
    return g


def check_scale(scale) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def softmax_scale(scale, q: torch.Tensor) -> float:
    """The checked ``scale``, by default ``D ** -0.5`` for ``q: [..., D]``."""
    scale = check_scale(scale)
    return q.shape[-1] ** -0.5 if scale is None else scale


def check_tensor(x, name: str, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def check_qk(q, k) -> None:
    """``q: [B, H, S, D]``, ``k: [B, H_kv, S, D]`` with ``H % H_kv == 0``."""
    check_tensor(q, "q", 4)
    check_tensor(k, "k", 4)
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}")
    B, H, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        # [B, S, H, D] inputs (a model's layout before its transpose) agree on dim 1, the sequence, not on dim 2
        transposed = k.shape[0] == B and k.shape[1] == H and k.shape[3] == D
        hint = ("; q and k look like [B, S, H, D]: pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)"
                if transposed else "")
        raise ValueError(
            f"k must be [B, H_kv, S, D] = [{B}, H_kv, {S}, {D}] to match q, got {tuple(k.shape)}{hint}"
        )
    if S < 1:
        raise ValueError("q must hold at least one position (S >= 1)")
    if H % k.shape[1] != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k heads ({k.shape[1]}) (H % H_kv == 0)")


def check_qkv(q, k, v) -> None:
    check_qk(q, k)
    check_tensor(v, "v", 4)
    if v.device != q.device:
        raise ValueError(f"v is on {v.device} but q is on {q.device}")
    if v.dtype != q.dtype:
        raise TypeError(f"v has dtype {v.dtype} but q has {q.dtype}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, H_kv, S, Dv] like k {tuple(k.shape[:3])}, got {tuple(v.shape)}")


def check_gate_inputs(q, k, document_ids) -> None:
    """The tensors the gate reads (its settings are a checked :class:`flexmoba.spec.MobaSpec`)."""
    check_qk(q, k)
    check_document_ids(document_ids, q)


def check_layout(layout, batch: int, seq_len: int, chunk_size: int, document_ids) -> None:
    """A prebuilt chunk layout must describe these rows, this chunk size and these documents."""
    if tuple(layout.doc_start.shape) != (batch, seq_len) or layout.chunk_size != chunk_size:
        raise ValueError(f"layout is for [B, S] = {list(layout.doc_start.shape)} with chunk_size={layout.chunk_size}, "
                         f"but the call has [{batch}, {seq_len}] and chunk_size={chunk_size}")
    if layout.has_documents != (document_ids is not None):
        raise ValueError("layout was built " + ("with" if layout.has_documents else "without")
                         + " document_ids, but the call passes " + ("none" if document_ids is None else "some"))


def check_document_ids(document_ids, q) -> None:
    """``document_ids: [B, S]`` integer tensor on q's device (or None)."""
    if document_ids is None:
        return
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(f"document_ids must be a torch.Tensor, got {type(document_ids).__name__}")
    if document_ids.is_floating_point() or document_ids.dtype == torch.bool or document_ids.is_complex():
        raise TypeError(f"document_ids must be an integer tensor, got {document_ids.dtype}")
    B, _, S, _ = q.shape
    if tuple(document_ids.shape) != (B, S):
        raise ValueError(f"document_ids must be [B, S] = [{B}, {S}], got {tuple(document_ids.shape)}")
    if document_ids.device != q.device:
        raise ValueError(f"document_ids is on {document_ids.device} but q is on {q.device}")


def check_cu_seqlens(cu_seqlens, total_tokens: int, device: torch.device) -> None:
    """flash-attn layout: int tensor ``[n_docs + 1]``, 0, strictly increasing, ending at T."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    bounds = cu_seqlens.tolist()  # one small host read; flash-attn's varlen API does the same
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {bounds}")
    if bounds[-1] != total_tokens:
        raise ValueError(f"cu_seqlens must end at the number of tokens {total_tokens}, got {bounds[-1]}")


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_choice(value, name: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_start(start, batch: int, device) -> torch.Tensor:
    """``start: [B]`` non-negative ints, the first real position of each row (None: no padding) -> long tensor."""
    if start is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    if not isinstance(start, torch.Tensor) or start.is_floating_point() or start.dtype == torch.bool:
        raise TypeError(f"start must be an integer tensor [B], got {getattr(start, 'dtype', type(start).__name__)}")
    if tuple(start.shape) != (batch,):
        raise ValueError(f"start must be [B] = [{batch}], got {tuple(start.shape)}")
    if bool((start < 0).any()):
        raise ValueError("start must be >= 0 (it counts the left padding of each row)")
    return start.to(device=device, dtype=torch.long)


def check_cache_update(k_new, v_new, cached_keys) -> None:
    """``k_new: [B, H_kv, S_new, D]``, ``v_new: [B, H_kv, S_new, Dv]``, shaped like ``cached_keys`` (or None)."""
    check_tensor(k_new, "k_new", 4)
    check_tensor(v_new, "v_new", 4)
    if k_new.shape[:3] != v_new.shape[:3]:
        raise ValueError(f"v_new must be [B, H_kv, S_new, Dv] like k_new {tuple(k_new.shape[:3])}, "
                         f"got {tuple(v_new.shape)}")
    if cached_keys is not None and (k_new.shape[:2] != cached_keys.shape[:2] or k_new.shape[3] != cached_keys.shape[3]):
        raise ValueError(f"k_new {tuple(k_new.shape)} does not match the cached keys {tuple(cached_keys.shape)}")


def check_cache(cache, cache_type: type) -> None:
    """A ``cache_type`` instance holding at least one position (queries attend after ``update``)."""
    if not isinstance(cache, cache_type):
        raise TypeError(f"cache must be a {cache_type.__name__}, got {type(cache).__name__}")
    if cache.length == 0:
        raise ValueError("the cache is empty; call cache.update(k_new, v_new) before attending")


def check_decode_args(q, keys, values) -> None:
    """``q: [B, H, S_new, D]`` at the end of ``keys, values: [B, H_kv, T, D]`` (``S_new <= T``)."""
    check_tensor(q, "q", 4)
    check_tensor(keys, "keys", 4)
    S_new, T = q.shape[2], keys.shape[2]
    if S_new > T:
        raise ValueError(f"q has {S_new} positions but the cache holds only {T} keys (queries sit at its end)")
    # The q/k/v checks want equal lengths: check q against the last S_new cached positions.
    check_qkv(q, keys[:, :, T - S_new:], values[:, :, T - S_new:])


def check_sums_within(sums_length: int, n_keys: int) -> None:
    """Running chunk sums may lag behind the ``n_keys`` keys they are used with, never run ahead."""
    if sums_length > n_keys:
        raise ValueError(f"chunk sums hold {sums_length} keys but keys hold only {n_keys}; "
                         "the sums belong to another cache")


def check_means_gate(q, means, own) -> None:
    """``q: [B, H, S, D]`` against ``means: [B, H_kv, N, D]`` fp32 (``H % H_kv == 0``), ``own: [B, S]`` ints."""
    check_tensor(q, "q", 4)
    check_tensor(means, "means", 4)
    B, H, S, D = q.shape
    if means.dtype != torch.float32:
        raise TypeError(f"means must be float32 (rounded through the key dtype, then fp32), got {means.dtype}")
    if means.device != q.device:
        raise ValueError(f"means is on {means.device} but q is on {q.device}")
    if means.shape[0] != B or means.shape[3] != D or means.shape[2] < 1 or H % means.shape[1]:
        raise ValueError(f"means must be [B, H_kv, N, D] = [{B}, H_kv, N >= 1, {D}] with {H} % H_kv == 0 "
                         f"to match q, got {tuple(means.shape)}")
    if not isinstance(own, torch.Tensor) or own.is_floating_point() or own.dtype == torch.bool:
        raise TypeError(f"own must be an integer tensor [B, S], got {getattr(own, 'dtype', type(own).__name__)}")
    if tuple(own.shape) != (B, S) or own.device != q.device:
        raise ValueError(f"own must be [B, S] = [{B}, {S}] on {q.device}, got {tuple(own.shape)} on {own.device}")


def check_local_queries(q, k, v, query_start: int) -> None:
    """``q: [B, H, S, D]`` at ``[query_start, query_start + S)`` of ``k, v: [B, H_kv, T, D]`` (v None: not checked)."""
    check_tensor(q, "q", 4)
    check_tensor(k, "k", 4)
    if isinstance(query_start, bool) or not isinstance(query_start, int) or query_start < 0:
        raise ValueError(f"query_start must be an int >= 0, got {query_start!r}")
    T = k.shape[2]
    if query_start + q.shape[2] > T:
        raise ValueError(f"queries [{query_start}, {query_start + q.shape[2]}) reach past the {T} keys of k")
    local = slice(query_start, query_start + q.shape[2])
    check_qk(q, k[:, :, local])
    if v is not None:
        check_qkv(q, k[:, :, local], v[:, :, local])
        if v.shape[2] != T:
            raise ValueError(f"v must have the {T} positions of k, got {tuple(v.shape)}")


def check_own_chunk(own, own_chunk, means) -> None:
    """``own_chunk``: a host int in ``[0, N)`` of ``means: [B, H_kv, N, D]``, given instead of ``own``."""
    if own is not None:
        raise ValueError("give own or own_chunk, not both")
    if isinstance(own_chunk, bool) or not isinstance(own_chunk, int) or not 0 <= own_chunk < means.shape[2]:
        raise ValueError(f"own_chunk must be an int in [0, {means.shape[2]}), got {own_chunk!r}")
