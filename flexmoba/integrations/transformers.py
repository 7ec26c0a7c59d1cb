"""MoBA as a Hugging Face transformers attention implementation.

    from flexmoba.integrations.transformers import register
    register()  # attn_implementation="flexmoba", settings read from each model's config
    config.moba = {"chunk_size": 512, "top_k": 3, "full_attention_last_n_layers": 3}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flexmoba")
    # or: AutoModelForCausalLM.from_pretrained(path, attn_implementation="flexmoba")
    # or, on a loaded model: model.set_attn_implementation("flexmoba")

    from flexmoba.integrations.transformers import from_pretrained
    model = from_pretrained(path)  # registers "flexmoba" first if nothing has (AutoModelForCausalLM)

Register before loading. transformers checks ``attn_implementation`` against its own table
before any flexmoba code runs, so ``attn_implementation="flexmoba"`` before :func:`register`
fails with transformers' generic ``ValueError`` (``Specified `attn_implementation="flexmoba"`
is not supported. The only possible arguments are ...``), which cannot name ``register()``
unless flexmoba changed transformers at import; it does not (importing flexmoba changes no
global state). Call :func:`register` first, or load through :func:`from_pretrained` /
:func:`from_config`, which register ``"flexmoba"`` when nothing has and, for another name
that is not registered, raise a ``ValueError`` saying to call ``register(name)``.

Any model whose attention modules call ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral,
Qwen2/3, Gemma, ... in transformers >= 4.48) then runs MoBA in every causal layer:

- prefill and training (``q_len == kv_len``): :func:`flexmoba.moba_attention` on the
  chosen backend, K/V in their own (possibly fewer, GQA) heads, the module's ``scaling``;
- decoding and chunked prefill with a cache (``q_len < kv_len``, queries at the end of
  the keys): the decode dispatch of :func:`flexmoba.moba_decode_attention` with the
  model's settings (its backend included), or full causal attention for
  every cached step with ``dense_decode=True`` (the paper's protocol: MoBA prefill, full
  attention for generated tokens).

Settings. The keys of :class:`MobaSettings` (``chunk_size``, ``top_k``,
``full_attention_last_n_layers``, ``granularity``, ``dense_decode``, ``backend``,
``chunk_means``) come from the model's ``config.moba`` dict, read on every call through
the attention module's ``config``, so they travel with ``save_pretrained`` /
``from_pretrained``; keys the model's config leaves out fall back to what :func:`register`
was given. ``full_attention_last_n_layers=N`` gives the last N layers (by the module's
``layer_idx``) full causal attention, the paper's layer hybrid.

Chunk means for decoding. HF's cache holds only K and V, so each attention module keeps
running per-chunk key sums beside it (``module._flexmoba_chunk_sums``): one new key costs
O(D) instead of re-pooling all cached keys, which would cost as much as dense attention
and erase the gain. Once the context outgrows ``chunk_size * top_k`` (below that, decoding
is dense attention), fp32 models also keep a chunk-transposed copy of the keys there, so
a step reads its selected keys without gathering them (see :mod:`flexmoba.backends.gather.decode`); it
costs one more copy of each layer's keys in memory. The sums are rebuilt from the cached keys (O(T), once) whenever they
cannot be trusted: first decode step, new cache, cache cropped or reordered (the sums
remember their length and the last key they absorbed and compare them with the cache).
That check is O(1), so it cannot see every edit: if the cache is rewritten in place at
constant length and the last key stays equal (beam search where two beams end on the same
token: the first layer's keys depend on token and position only), the first layer's sums
go stale. ``chunk_means="recompute"`` re-pools the means from the cached keys every step
instead (one read of the cached keys per layer: half of what dense attention reads) and is
exact whatever happens to the cache.

Padding and packing. A row may be left padded (batched generation) or right padded
(batched training/scoring): the padding mask becomes ``start`` (the first real position),
chunks count from there, and real tokens never attend or gate on padding. Packed sequences
(several documents in one row, ``position_ids`` restarting at each, as HF's
``DataCollatorWithFlattening`` produces) run as separate documents through
``document_ids``: chunks restart at each document and nothing attends across them, as if
each document ran alone. Padding inside a row (e.g. decoding after right padding),
sliding windows and other custom masks raise a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from flexmoba import validation
from flexmoba.attention import moba_attention
from flexmoba.decode import attend_cached_keys, dense_causal_attention
from flexmoba.kv_cache import ChunkKeySums
from flexmoba.layout import ChunkLayout, chunk_layout
from flexmoba.spec import MobaSpec

__all__ = ["CONFIG_KEY", "MIN_TRANSFORMERS", "MobaSettings", "from_config", "from_pretrained", "is_registered",
           "register"]

MIN_TRANSFORMERS = "4.48"  # first release with transformers.AttentionInterface
CONFIG_KEY = "moba"  # the model config's attribute holding its MoBA settings
_SUMS_ATTR = "_flexmoba_chunk_sums"
_ANALYSIS_ATTR = "_flexmoba_mask_analysis"


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


@dataclasses.dataclass(frozen=True)
class MobaSettings:
    """MoBA settings of one model: the keys ``config.moba`` may hold.

    Attributes:
        chunk_size: MoBA block size in tokens (required, here or in :func:`register`).
        top_k: chunks per query, its own chunk included (required likewise).
        full_attention_last_n_layers: the last N layers (``module.layer_idx >=
            num_hidden_layers - N``) use full causal attention, prefill and decoding.
        granularity: ``"token"`` (the paper) or an int tile size dividing ``chunk_size``;
            tiles have no decode path, so they decode only with ``dense_decode``.
        dense_decode: full causal attention whenever the model runs with cached keys
            (``q_len < kv_len``), MoBA for prefill only.
        backend: the backend for prefill/training (``"auto"``, ``"flex"``, ``"sdpa"``,
            ``"gather"``) and for cached decoding, where ``"flex"`` is refused (it does not
            decode: use ``"auto"``, or ``dense_decode``).
        chunk_means: ``"running"`` (O(D) per new key, kept beside the cache and checked
            against it) or ``"recompute"`` (re-pooled from the cached keys every step,
            O(T * D), always exact: use it when the cache is edited in place at constant
            length, e.g. beam search, see the module docstring).
    """

    chunk_size: int | None = None
    top_k: int | None = None
    full_attention_last_n_layers: int = 0
    granularity: str | int = "token"
    dense_decode: bool = False
    backend: str = "auto"
    chunk_means: str = "running"

    def __post_init__(self) -> None:
        for name in ("chunk_size", "top_k"):
            if getattr(self, name) is not None:
                validation.check_positive_int(getattr(self, name), name)
        n_full = self.full_attention_last_n_layers
        if not isinstance(n_full, int) or isinstance(n_full, bool) or n_full < 0:
            raise ValueError(f"full_attention_last_n_layers must be an int >= 0, got {n_full!r}")
        validation.check_bool(self.dense_decode, "dense_decode")
        if self.chunk_means not in ("running", "recompute"):
            raise ValueError(f"chunk_means must be 'running' or 'recompute', got {self.chunk_means!r}")
        if self.chunk_size is not None and self.top_k is not None:
            _ = self.spec  # complete: MobaSpec checks the MoBA fields now

    @functools.cached_property
    def spec(self) -> MobaSpec:
        """The MoBA fields as one :class:`flexmoba.MobaSpec` (complete settings only)."""
        return MobaSpec(self.chunk_size, self.top_k, self.granularity, self.backend)


def register(name: str = "flexmoba", **defaults) -> str:
    """Register MoBA under ``attn_implementation=name``; returns ``name``.

    Args:
        name: the ``attn_implementation`` string; register several names for several
            default settings.
        defaults: :class:`MobaSettings` fields used where a model's ``config.moba`` leaves
            them out (a model without ``config.moba`` runs on these alone). Without
            ``chunk_size`` and ``top_k`` here, every model must carry them in its config.
    """
    check_transformers_version()
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    attention = make_attention_function(**defaults)
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    try:  # transformers >= 4.53 builds masks through this interface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older: the model passes a 4D float mask, which we read back
        return name
    AttentionMaskInterface.register(name, padding_mask)
    return name


def is_registered(name: str = "flexmoba") -> bool:
    """Whether ``attn_implementation=name`` is registered with transformers (by :func:`register` or otherwise)."""
    check_transformers_version()
    from transformers import AttentionInterface

    return name in AttentionInterface()  # the registry every model reads (class-wide)


def unregistered_error(name: str) -> ValueError:
    return ValueError(f"flexmoba: attn_implementation={name!r} is not registered with transformers; call "
                      f"flexmoba.integrations.transformers.register({name!r}, ...) before loading the model")


def ensure_registered(name: str) -> None:
    """``"flexmoba"`` registered with no defaults (settings from each model's ``config.moba``) if nothing
    registered it; any other name must be registered already (its defaults are the caller's choice)."""
    if is_registered(name):
        return
    if name != "flexmoba":
        raise unregistered_error(name)
    register(name)


def from_pretrained(pretrained, *args, attn_implementation: str = "flexmoba", auto_class=None, **kwargs):
    """``auto_class.from_pretrained(pretrained, *args, attn_implementation=..., **kwargs)`` (default class:
    ``AutoModelForCausalLM``) with MoBA registered first: ``"flexmoba"`` is registered if nothing has (its
    settings from the model's ``config.moba``, as :func:`flexmoba.integrations.export` writes them); another
    name that is not registered is a ``ValueError`` saying to call :func:`register` with it."""
    ensure_registered(attn_implementation)
    if auto_class is None:
        from transformers import AutoModelForCausalLM as auto_class
    return auto_class.from_pretrained(pretrained, *args, attn_implementation=attn_implementation, **kwargs)


def from_config(config, *args, attn_implementation: str = "flexmoba", auto_class=None, **kwargs):
    """``auto_class.from_config(config, ...)`` with MoBA registered first, as :func:`from_pretrained`."""
    ensure_registered(attn_implementation)
    if auto_class is None:
        from transformers import AutoModelForCausalLM as auto_class
    return auto_class.from_config(config, *args, attn_implementation=attn_implementation, **kwargs)


def settings_of(config, defaults: MobaSettings) -> MobaSettings:
    """``defaults`` overridden by ``config.moba`` (a dict of :class:`MobaSettings` fields), complete."""
    model_settings = getattr(config, CONFIG_KEY, None)
    if model_settings is None:
        settings = defaults
    elif isinstance(model_settings, dict):
        settings = merged_settings(defaults, tuple(sorted(model_settings.items())))
    else:
        raise TypeError(f"flexmoba: config.{CONFIG_KEY} must be a dict, got {type(model_settings).__name__}")
    if settings.chunk_size is None or settings.top_k is None:
        raise ValueError(f"flexmoba: no chunk_size/top_k for this model: set config.{CONFIG_KEY} = "
                         "{'chunk_size': ..., 'top_k': ...} or pass them to register()")
    return settings


@functools.lru_cache(maxsize=64)
def merged_settings(defaults: MobaSettings, items: tuple) -> MobaSettings:
    """``defaults`` with the ``(key, value)`` pairs of a ``config.moba`` dict; cached, read on every call."""
    known = {field.name for field in dataclasses.fields(MobaSettings)}
    unknown = sorted(key for key, _ in items if key not in known)
    if unknown:
        raise ValueError(f"flexmoba: unknown key(s) {unknown} in config.{CONFIG_KEY}; known: {sorted(known)}")
    try:
        return dataclasses.replace(defaults, **dict(items))
    except (TypeError, ValueError) as error:
        raise type(error)(f"flexmoba: config.{CONFIG_KEY}: {error}") from error


def is_full_attention_layer(module, settings: MobaSettings) -> bool:
    """Whether ``module`` is one of the last ``settings.full_attention_last_n_layers`` layers."""
    n_full = settings.full_attention_last_n_layers
    if n_full == 0:
        return False
    layer_idx = getattr(module, "layer_idx", None)
    n_layers = getattr(getattr(module, "config", None), "num_hidden_layers", None)
    if layer_idx is None or n_layers is None:
        raise ValueError(f"flexmoba: full_attention_last_n_layers={n_full} needs the attention module's layer_idx "
                         f"and config.num_hidden_layers; {type(module).__name__} lacks them")
    return layer_idx >= n_layers - n_full


def padding_mask(**kwargs) -> torch.Tensor | None:
    """Mask builder for the registered name: just the 2D ``[B, kv_len]`` padding mask.

    MoBA computes causality and its chunk selection itself, so a plain causal mask is
    passed on as the padding mask alone (no O(S^2) tensor). Anything else (sliding window,
    packed sequences, bidirectional, ...) is built in full as SDPA would get it, and the
    attention function refuses it unless it is causal plus padding, or causal within packed
    documents (which then run as documents: the O(S^2) mask is only read).
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


def make_attention_function(**defaults):
    """The function transformers calls as ``attention_interface(module, q, k, v, mask, ...)``.

    ``defaults``: :class:`MobaSettings` fields, overridden per model by ``module.config.moba``.
    """
    defaults = MobaSettings(**defaults)

    def flexmoba_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                   is_causal=None, **kwargs):
        """``query: [B, H, q_len, D]``, ``key, value: [B, H_kv, kv_len, D]`` -> (``[B, q_len, H, D]``, None)."""
        check_supported(module, dropout, is_causal, kwargs)
        settings = settings_of(getattr(module, "config", None), defaults)
        full = is_full_attention_layer(module, settings)
        q_len, kv_len = query.shape[2], key.shape[2]
        if q_len > kv_len:
            raise ValueError(f"flexmoba: {q_len} queries but only {kv_len} keys; "
                             "queries must sit at the last key positions")
        if q_len == kv_len:
            position_ids = kwargs.get("position_ids")
            documents = forward_document_ids(attention_mask, position_ids, query.shape[0], q_len, query.device)
            if full:
                out = full_causal_attention(query, key, value, documents, scaling)
            else:
                layout = forward_layout(attention_mask, position_ids, documents, query.shape[0], q_len,
                                        settings.chunk_size, query.device)
                out = moba_attention(query, key, value, settings.spec, scale=scaling, document_ids=documents,
                                     layout=layout)
        else:
            out = cached_attention(module, query, key, value, attention_mask, settings, full, scaling)
        return out.transpose(1, 2).contiguous(), None

    return flexmoba_attention_forward


def full_causal_attention(query, key, value, documents: torch.Tensor | None, scaling) -> torch.Tensor:
    """``query: [B, H, S, D]`` attends every earlier key of its own document (``documents: [B, S]`` or None)."""
    gqa = query.shape[1] != key.shape[1]
    if documents is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    positions = torch.arange(query.shape[2], device=query.device)
    allowed = (documents[:, :, None] == documents[:, None, :]) & (positions[None, :] <= positions[:, None])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None], scale=scaling,
                                          enable_gqa=gqa)


def cached_attention(module, query, key, value, attention_mask, settings: MobaSettings, full: bool, scaling):
    """Queries at the end of cached keys: MoBA decode, or full causal attention -> ``[B, H, q_len, D]``."""
    q_len, kv_len = query.shape[2], key.shape[2]
    start, dense_start = once_per_forward(attention_mask, ("cached", query.shape[0], q_len, kv_len, query.device),
                                          lambda: cached_key_padding(attention_mask, query.shape[0], q_len, kv_len,
                                                                     query.device))
    if full or settings.dense_decode:
        return dense_causal_attention(query, key, value, dense_start, scaling)
    if settings.granularity != "token":
        raise ValueError(f"flexmoba: granularity={settings.granularity!r} has no decode path; decode with "
                         f"config.{CONFIG_KEY}['dense_decode'] = True or re-run the whole sequence without a cache")
    sums = running_chunk_sums(module, key, kv_len - q_len, start, settings.chunk_size,
                              trust=settings.chunk_means == "running")
    return attend_cached_keys(query, key, value, sums, settings.spec, scale=scaling)


def once_per_forward(holder, key: tuple, analyse):
    """``analyse()``, remembered on ``holder`` (the mask, or the position ids, that every layer of one
    model forward receives) under ``key``: the padding and document analysis reads the mask on the
    host, so it runs once per forward, not once per layer. A tensor edited in place since is
    analysed again (its version counter moved); no tensor (None): analysed every call.
    """
    if not isinstance(holder, torch.Tensor):
        return analyse()
    try:
        version = holder._version
    except RuntimeError:  # inference tensors keep no version counter; they are not edited outside inference
        version = None
    memo = holder.__dict__.setdefault(_ANALYSIS_ATTR, {})
    remembered = memo.get(key)
    if remembered is None or remembered[0] != version:
        remembered = memo[key] = (version, analyse())
    return remembered[1]


def forward_document_ids(attention_mask, position_ids, batch: int, seq_len: int, device) -> torch.Tensor | None:
    """:func:`prefill_document_ids`, once per model forward."""
    holder = attention_mask if attention_mask is not None else position_ids
    return once_per_forward(holder, ("prefill", batch, seq_len, device),
                            lambda: prefill_document_ids(attention_mask, position_ids, batch, seq_len, device))


def forward_layout(attention_mask, position_ids, documents: torch.Tensor | None, batch: int, seq_len: int,
                   chunk_size: int, device) -> ChunkLayout:
    """The chunk layout of a prefill's ``documents: [B, S]`` (or None), once per model forward, as
    :class:`flexmoba.model.GPT` builds it: with documents, building it reads the chunk count on the host."""
    holder = attention_mask if attention_mask is not None else position_ids
    return once_per_forward(holder, ("layout", batch, seq_len, chunk_size, device),
                            lambda: chunk_layout(batch, seq_len, chunk_size, device, documents))


def cached_key_padding(attention_mask, batch: int, q_len: int, kv_len: int, device):
    """``(start [B], start or None where no row is padded)`` of queries at the end of cached keys."""
    key_real = key_padding(attention_mask, batch, q_len, kv_len, device)
    start = padding_start(key_real, batch, device)
    return start, start if key_real is not None and bool(start.any()) else None


def prefill_document_ids(attention_mask, position_ids, batch: int, seq_len: int, device) -> torch.Tensor | None:
    """``[B, S]`` document of every token when a row holds more than one, else None.

    Padding runs count as documents. Packed documents are read from a 4D mask (how
    transformers >= 4.53 passes packing) or, with no mask at all, from ``position_ids``
    restarting per document (as flash attention reads them).
    """
    if attention_mask is None:
        return packed_document_ids(position_ids, batch)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        documents = mask_document_ids(attention_mask.to(device))
        if documents is not None:
            return documents
    key_real = key_padding(attention_mask, batch, seq_len, seq_len, device)
    padding_start(key_real, batch, device)  # one run of real tokens per row
    return padding_document_ids(key_real)


def packed_document_ids(position_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``position_ids: [B or 1, S]`` -> ``[B, S]`` document ids, a new one wherever a position does not
    follow the previous one by 1; None if every row is one document."""
    if position_ids is None:
        return None
    position_ids = position_ids.expand(batch, -1)
    steps = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    documents = (steps != 1).cumsum(dim=-1)
    return documents if bool(documents[:, -1].any()) else None


def mask_document_ids(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The ``[B, S]`` documents of a 4D ``[B, 1 or H, S, S]`` mask that is causal within each document
    (block-diagonal causal: packed sequences); None if the mask is anything else or one document per row."""
    allowed = (attention_mask == 0 if attention_mask.is_floating_point() else attention_mask != 0)[:, 0]
    if allowed.shape[-1] != allowed.shape[-2]:
        return None
    positions = torch.arange(allowed.shape[-1], device=allowed.device)
    first_key = allowed.to(torch.uint8).argmax(dim=-1)  # [B, S]; a row attending nothing gives 0
    documents = (first_key == positions).cumsum(dim=-1)
    if not bool(documents[:, -1].gt(1).any()):
        return None
    causal = positions[None, :] <= positions[:, None]
    same_document = documents[:, :, None] == documents[:, None, :]
    return documents if torch.equal(allowed, same_document & causal) else None


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
    # nothing (or, after transformers' SDPA fix-up, everything).
    after_start = (q_pos[None, :] >= padding_start(key_real, batch, device)[:, None])[..., None]  # [B, q_len, 1]
    all_or_nothing = ~allowed.any(-1, keepdim=True) | allowed.all(-1, keepdim=True)
    causal_padding = allowed == (key_real[:, None, :] & causal)
    if not bool(torch.where(after_start, causal_padding, all_or_nothing).all()):
        raise ValueError("flexmoba: the attention mask is not causal plus padding (sliding window or a custom "
                         "mask?); MoBA supports causal attention with padding, or within packed documents")
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
