"""MoBA as a Hugging Face transformers attention implementation.

    from flexmoba.integrations.transformers import register
    register("flexmoba", chunk_size=512, top_k=3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flexmoba")
    # or, on a loaded model: model.set_attn_implementation("flexmoba")

Any model whose attention modules call ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral,
Qwen2/3, Gemma, ... in transformers >= 4.48) then runs MoBA in every causal layer:

- prefill and training (``q_len == kv_len``): :func:`flexmoba.moba_attention` on the
  chosen backend, K/V in their own (possibly fewer, GQA) heads, the module's ``scaling``;
- decoding and chunked prefill with a cache (``q_len < kv_len``, queries at the end of
  the keys): :func:`flexmoba.decode.decode_attention`, or full causal attention for
  every cached step with ``dense_decode=True`` (the paper's protocol: MoBA prefill, full
  attention for generated tokens).

Chunk means for decoding. HF's cache holds only K and V, so each attention module keeps
running per-chunk key sums beside it (``module._flexmoba_chunk_sums``): one new key costs
O(D) instead of re-pooling all cached keys, which would cost as much as dense attention
and erase the gain. Once the context outgrows ``chunk_size * top_k`` (below that, decoding
is dense attention), fp32 models also keep a chunk-transposed copy of the keys there, so
a step reads its selected keys without gathering them (see :mod:`flexmoba.decode`); it
costs one more copy of each layer's keys in memory. The sums are rebuilt from the cached keys (O(T), once) whenever they
cannot be trusted: first decode step, new cache, cache cropped or reordered (the sums
remember their length and the last key they absorbed and compare them with the cache).
That check is O(1), so it cannot see every edit: if the cache is rewritten in place at
constant length and the last key stays equal (beam search where two beams end on the same
token: the first layer's keys depend on token and position only), the first layer's sums
go stale. ``register(..., chunk_means="recompute")`` re-pools the means from the cached
keys every step instead (one read of the cached keys per layer: half of what dense
attention reads) and is exact whatever happens to the cache.

Padding. A row may be left padded (batched generation) or right padded (batched
training/scoring): the padding mask becomes ``start`` (the first real position), chunks
count from there, and real tokens never attend or gate on padding. Padding inside a row
(e.g. decoding after right padding), packed sequences, sliding windows and other custom
masks raise a ``ValueError``.
"""

from __future__ import annotations

import torch

from flexmoba import validation
from flexmoba.attention import moba_attention
from flexmoba.decode import decode_attention, dense_causal_attention
from flexmoba.kv_cache import ChunkKeySums

MIN_TRANSFORMERS = "4.48"  # first release with transformers.AttentionInterface
_SUMS_ATTR = "_flexmoba_chunk_sums"


def check_transformers_version(version: str | None = None) -> None:
    """Raise ``ImportError`` unless transformers >= :data:`MIN_TRANSFORMERS` is importable."""
    if version is None:
        try:
            import transformers
        except ImportError as error:
            raise ImportError("flexmoba's transformers integration needs transformers: "
                              "pip install 'flexmoba[hf]'") from error
        version = transformers.__version__
    from packaging.version import Version

    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"flexmoba's transformers integration needs transformers>={MIN_TRANSFORMERS} "
            f"(AttentionInterface), found transformers {version}"
        )


def register(
    name: str = "flexmoba",
    *,
    chunk_size: int,
    top_k: int,
    dense_decode: bool = False,
    backend: str = "auto",
    chunk_means: str = "running",
) -> str:
    """Register MoBA under ``attn_implementation=name``; returns ``name``.

    Args:
        name: the ``attn_implementation`` string; register several names for several
            settings.
        chunk_size: MoBA block size in tokens.
        top_k: chunks per query, its own chunk included.
        dense_decode: full causal attention whenever the model runs with cached keys
            (``q_len < kv_len``), MoBA for prefill only.
        backend: :func:`flexmoba.moba_attention` backend for prefill/training
            (``"auto"``, ``"flex"``, ``"sdpa"``, ``"gather"``).
        chunk_means: ``"running"`` (O(D) per new key, kept beside the cache and checked
            against it) or ``"recompute"`` (re-pooled from the cached keys every step,
            O(T * D), always exact: use it when the cache is edited in place at constant
            length, e.g. beam search, see the module docstring).
    """
    check_transformers_version()
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    attention = make_attention_function(chunk_size=chunk_size, top_k=top_k, dense_decode=dense_decode,
                                        backend=backend, chunk_means=chunk_means)
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    try:  # transformers >= 4.53 builds masks through this interface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older: the model passes a 4D float mask, which we read back
        return name
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(**kwargs) -> torch.Tensor | None:
    """Mask builder for the registered name: just the 2D ``[B, kv_len]`` padding mask.

    MoBA computes causality and its chunk selection itself, so a plain causal mask is
    passed on as the padding mask alone (no O(S^2) tensor). Anything else (sliding window,
    packed sequences, bidirectional, ...) is built in full as SDPA would get it, and the
    attention function refuses it unless it is causal plus padding.
    """
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

    if kwargs.get("mask_function") is not causal_mask_function:
        sdpa_mask = AttentionMaskInterface._global_mapping["sdpa"]
        return sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})
    attention_mask = kwargs.get("attention_mask")
    kv_length, kv_offset = kwargs.get("kv_length"), kwargs.get("kv_offset") or 0
    q_length, q_offset = kwargs.get("q_length"), kwargs.get("q_offset")
    if None not in (q_length, q_offset, kv_length) and int(q_offset) + q_length != kv_offset + kv_length:
        raise ValueError(
            f"flexmoba: the queries (positions {int(q_offset)}..{int(q_offset) + q_length - 1}) do not end where the "
            f"keys do ({kv_offset + kv_length}); a static or sliding-window cache? Use a DynamicCache"
        )
    if attention_mask is None or kv_length is None:
        return attention_mask
    return attention_mask[:, kv_offset: kv_offset + kv_length]


def make_attention_function(*, chunk_size: int, top_k: int, dense_decode: bool = False, backend: str = "auto",
                            chunk_means: str = "running"):
    """The function transformers calls as ``attention_interface(module, q, k, v, mask, ...)``."""
    chunk_size = validation.check_positive_int(chunk_size, "chunk_size")
    top_k = validation.check_positive_int(top_k, "top_k")
    backend = validation.check_backend(backend)
    validation.check_bool(dense_decode, "dense_decode")
    if chunk_means not in ("running", "recompute"):
        raise ValueError(f"chunk_means must be 'running' or 'recompute', got {chunk_means!r}")

    def flexmoba_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                   is_causal=None, **kwargs):
        """``query: [B, H, q_len, D]``, ``key, value: [B, H_kv, kv_len, D]`` -> (``[B, q_len, H, D]``, None)."""
        check_supported(module, dropout, is_causal, kwargs)
        q_len, kv_len = query.shape[2], key.shape[2]
        if q_len > kv_len:
            raise ValueError(f"flexmoba: {q_len} queries but only {kv_len} keys; "
                             "queries must sit at the last key positions")
        key_real = key_padding(attention_mask, query.shape[0], q_len, kv_len, query.device)
        start = padding_start(key_real, query.shape[0], query.device)
        if q_len == kv_len:
            out = moba_attention(query, key, value, chunk_size=chunk_size, top_k=top_k, backend=backend,
                                 scale=scaling, document_ids=padding_document_ids(key_real))
        elif dense_decode:
            out = dense_causal_attention(query, key, value, start if bool(start.any()) else None, scaling)
        else:
            sums = running_chunk_sums(module, key, kv_len - q_len, start, chunk_size,
                                      trust=chunk_means == "running")
            out = decode_attention(query, key, value, sums, top_k=top_k, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return flexmoba_attention_forward


def check_supported(module, dropout, is_causal, kwargs) -> None:
    name = type(module).__name__
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise ValueError(f"flexmoba: {name} is not causal (is_causal=False); MoBA is causal self-attention only")
    if dropout:
        raise ValueError(f"flexmoba: attention dropout is not supported (got dropout={dropout} in {name}); "
                         "set config.attention_dropout = 0.0")
    for option in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(option) is not None:
            raise ValueError(f"flexmoba: {name} asks for {option}={kwargs[option]!r}, which MoBA does not support")


def key_padding(attention_mask, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """``[B, kv_len]`` bool, True at real keys, from whatever mask the model passed (None: no padding).

    A 2D mask is the padding mask itself. A 4D mask ``[B, 1 or H, q_len, kv_len]`` (bool,
    True = attend, or float, 0 = attend) must be causal plus padding: its last query row
    (the last position, which sees every earlier key) is the padding mask, and every real
    query row must be that row cut at the query.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"flexmoba: attention_mask must be a tensor or None, got {type(attention_mask).__name__} "
                        "(a flex BlockMask means the mask was built for attn_implementation='flex_attention')")
    mask = attention_mask.to(device)
    if mask.dim() == 2:  # 1 / True = real token
        if mask.shape[0] != batch or mask.shape[1] < kv_len:
            raise ValueError(f"flexmoba: 2D attention_mask must be [B, >= kv_len] = [{batch}, {kv_len}], "
                             f"got {tuple(mask.shape)}")
        return mask[:, -kv_len:] != 0
    allowed = mask == 0 if mask.is_floating_point() else mask != 0  # float masks are additive
    if allowed.dim() != 4 or allowed.shape[0] != batch or tuple(allowed.shape[2:]) != (q_len, kv_len):
        raise ValueError(f"flexmoba: attention_mask must be [B, kv_len] or [B, 1, q_len, kv_len] = "
                         f"[{batch}, 1, {q_len}, {kv_len}], got {tuple(attention_mask.shape)}")
    allowed = allowed[:, 0]
    key_real = allowed[:, -1]  # [B, kv_len]
    q_pos = kv_len - q_len + torch.arange(q_len, device=device)
    causal = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
    # Rows from the first real token on must be causal plus padding; left-padding rows attend
    # nothing (or, after transformers' SDPA fix-up, everything). A packed sequence fails here.
    after_start = (q_pos[None, :] >= padding_start(key_real, batch, device)[:, None])[..., None]  # [B, q_len, 1]
    all_or_nothing = ~allowed.any(-1, keepdim=True) | allowed.all(-1, keepdim=True)
    causal_padding = allowed == (key_real[:, None, :] & causal)
    if not bool(torch.where(after_start, causal_padding, all_or_nothing).all()):
        raise ValueError("flexmoba: the attention mask is not causal plus padding (sliding window, packed "
                         "sequences or a custom mask?); MoBA supports only causal attention with padding")
    return key_real


def padding_start(key_real: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    """``[B]`` first real position of each row; the real positions must be one run per row."""
    if key_real is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    run_starts = key_real.clone()
    run_starts[:, 1:] &= ~key_real[:, :-1]
    if bool((run_starts.sum(dim=1) > 1).any()):
        raise ValueError("flexmoba: padding inside a sequence is not supported; pad on the left or the right "
                         "(and decode only after left padding)")
    return key_real.long().argmax(dim=1)  # rows with no real token: 0


def padding_document_ids(key_real: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, S]`` ids putting left padding, the real tokens and right padding in three documents."""
    if key_real is None or bool(key_real.all()):
        return None
    changes = torch.zeros_like(key_real, dtype=torch.long)
    changes[:, 1:] = (key_real[:, 1:] != key_real[:, :-1]).long()
    return changes.cumsum(dim=1)


def running_chunk_sums(module, key: torch.Tensor, past_len: int, start: torch.Tensor, chunk_size: int,
                       trust: bool = True) -> ChunkKeySums:
    """The module's chunk key sums, brought up to all ``kv_len`` keys of ``key: [B, H_kv, kv_len, D]``.

    With ``trust=False`` they are rebuilt from the cached keys every call.
    """
    sums = getattr(module, _SUMS_ATTR, None)
    if not (trust and sums_match_cache(sums, key, past_len, start, chunk_size)):
        # Rebuilt every call, the transposed key blocks would cost a copy of the keys per step.
        sums = ChunkKeySums.from_keys(key[:, :, :past_len], chunk_size, start, keep_blocks=trust)
    sums.update(key[:, :, past_len:])
    setattr(module, _SUMS_ATTR, sums)
    return sums


def sums_match_cache(sums, key, past_len, start, chunk_size) -> bool:
    """Whether ``sums`` hold exactly the first ``past_len`` keys of ``key`` (length and last key agree)."""
    return (
        isinstance(sums, ChunkKeySums)
        and sums.chunk_size == chunk_size
        and sums.length == past_len > 0
        and sums.sums.shape[:2] == key.shape[:2]
        and sums.sums.device == key.device
        and sums.key_dtype == key.dtype
        and torch.equal(sums.start, start)
        and torch.equal(sums.last_key, key[:, :, past_len - 1])
    )
