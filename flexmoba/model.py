"""A small decoder-only language model with MoBA or full attention per layer.

nanoGPT-style and deliberately plain: RoPE, RMSNorm, SwiGLU, no biases, optional GQA,
tied or untied embeddings. Shapes: B batch, S sequence, H query heads, H_kv key/value
heads, D head dim, C model width, V vocabulary.

Each layer attends with ``"moba"`` (:func:`flexmoba.moba_attention`) or ``"full"``
(causal SDPA). ``full_attention_last_n_layers`` makes the last layers full, the paper's
layer-wise hybrid; :meth:`GPT.set_attention_override` switches every layer at runtime,
the paper's training-phase hybrid (MoBA first, full attention at the end).

Other architectures are configuration of the same model, not other models (litgpt's way):
Gemma 3 is ``layer_types`` with ``"sliding"`` layers (:func:`flexmoba.sliding_window_attention`,
their own ``rope_base_local``; MoBA and the override act on the ``"global"`` layers only),
``qk_norm``, ``sandwich_norms``, ``mlp_activation="gelu_tanh"`` (GeGLU), ``embedding_scale``,
``query_scale`` and ``norm_offset``. The defaults build the Llama-style model above, module
for module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from flexmoba.attention import moba_attention
from flexmoba.context_parallel import ContextParallel, context_parallel_attention, context_parallel_full_attention
from flexmoba.decode import dense_decode_attention, moba_decode_attention
from flexmoba.kv_cache import MoBAKVCache
from flexmoba.layout import ChunkLayout, chunk_layout
from flexmoba.pair_counts import keys_attended_full, keys_attended_moba
from flexmoba.sliding_window import context_parallel_sliding_window_attention as context_parallel_sliding_attention
from flexmoba.sliding_window import keys_attended_sliding, sliding_window_attention
from flexmoba.spec import MobaSpec

__all__ = ["ATTENTION_KINDS", "GPT", "LAYER_TYPES", "MLP_ACTIVATIONS", "ModelConfig", "capture_attention_inputs",
           "sample_next_token"]

ATTENTION_KINDS = ("moba", "full")  # what a global layer attends with
LAYER_TYPES = ("global", "sliding")  # a sliding layer always attends its window, whatever the attention
MLP_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU (Llama)
    "gelu_tanh": partial(F.gelu, approximate="tanh"),  # GeGLU (Gemma; transformers' gelu_pytorch_tanh)
}
TRAINING_MULTIPLIER = 3  # forward + backward (~2x forward)


@dataclass
class ModelConfig:
    """Architecture of :class:`GPT`; the defaults are the project's default model (what
    ``configs/moba.yaml``, ``lit.experiments.compare`` and ``benchmarks.train_step`` train).

    Attributes:
        vocab_size: tokens in the vocabulary (256 for raw bytes).
        n_layers: transformer blocks.
        d_model: residual stream width C.
        n_heads: query heads H; must divide ``d_model``.
        n_kv_heads: key/value heads H_kv (GQA); ``None`` means ``n_heads`` (no grouping).
        mlp_hidden: SwiGLU hidden width; ``None`` means 8/3 * d_model rounded up to 32.
        tie_embeddings: share the token embedding with the output projection.
        rope_base: RoPE frequency base.
        head_dim: width D of each attention head; ``None`` means ``d_model / n_heads`` (a
            pretrained model may set another, e.g. Gemma's 256).
        norm_eps: RMSNorm's epsilon; ``None`` means the input dtype's machine epsilon
            (flexmoba's own models); a pretrained model sets its own (Llama's ``rms_norm_eps``).
        max_seq_len: the longest sequence the model was trained for (a pretrained model's
            context, e.g. 8192); ``None``: no limit. The command line refuses a longer ``seq_len``.
        attention: ``"moba"`` or ``"full"`` for every layer not forced full below.
        moba: MoBA's chunk size, top-k, granularity and backend (:class:`flexmoba.MobaSpec`;
            ``"auto"`` picks the backend per device, sequence length and grad mode).
        full_attention_last_n_layers: the last N layers use full attention (layer hybrid); a
            sliding layer among them keeps its window.
        init_std: std of the normal init of linear and embedding weights.
        layer_types: per layer, ``"global"`` (attends with ``attention``: MoBA or full) or
            ``"sliding"`` (sliding-window causal attention over ``sliding_window`` keys, its own
            included); ``None`` means every layer global.
        sliding_window: keys a sliding layer attends (Gemma 3: 512); needed when a layer slides.
        rope_base_local: the RoPE base of sliding layers (Gemma 3: 1e4 against the global 1e6);
            ``None`` means ``rope_base``.
        qk_norm: an RMSNorm over each head's queries and keys before RoPE (``attn.q_norm``, ``attn.k_norm``).
        sandwich_norms: an RMSNorm on the output of attention and of the MLP too, before each
            residual add (``attn_post_norm``, ``mlp_post_norm``), as Gemma.
        mlp_activation: the gated MLP's activation, ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
        embedding_scale: the token embeddings are multiplied by it, in the embedding's dtype
            (Gemma: sqrt(d_model)); ``None``: not scaled.
        query_scale: the attention softmax scale; ``None`` means ``head_dim ** -0.5`` (Gemma:
            ``query_pre_attn_scalar ** -0.5``).
        norm_offset: RMSNorm multiplies by ``norm_offset + weight``, computed in fp32 (Gemma: 1, its
            weights centered on 0); 0 is ``nn.RMSNorm``, in the input's dtype.
    """

    vocab_size: int = 256
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = 2
    mlp_hidden: int | None = None
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    head_dim: int | None = None
    norm_eps: float | None = None
    max_seq_len: int | None = None
    attention: str = "moba"
    moba: MobaSpec = field(default_factory=lambda: MobaSpec(chunk_size=128, top_k=3))
    full_attention_last_n_layers: int = 0
    init_std: float = 0.02
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_base_local: float | None = None
    qk_norm: bool = False
    sandwich_norms: bool = False
    mlp_activation: str = "silu"
    embedding_scale: float | None = None
    query_scale: float | None = None
    norm_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.mlp_hidden is None:
            self.mlp_hidden = 32 * math.ceil(8 * self.d_model / 3 / 32)
        if self.head_dim is None and isinstance(self.n_heads, int) and self.n_heads > 0:
            if self.d_model % self.n_heads:
                raise ValueError(f"ModelConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                                 "(or give head_dim)")
            self.head_dim = self.d_model // self.n_heads
        if isinstance(self.moba, dict):  # as saved in a checkpoint
            self.moba = MobaSpec(**self.moba)
        if not isinstance(self.moba, MobaSpec):
            raise TypeError(f"ModelConfig.moba must be a MobaSpec, got {type(self.moba).__name__}")
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "mlp_hidden", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.max_seq_len is not None and (isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int)
                                             or self.max_seq_len <= 0):
            raise ValueError(f"ModelConfig.max_seq_len must be a positive int or None, got {self.max_seq_len!r}")
        if self.norm_eps is not None and not (isinstance(self.norm_eps, float) and self.norm_eps > 0):
            raise ValueError(f"ModelConfig.norm_eps must be a positive float or None, got {self.norm_eps!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"ModelConfig.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if not 0 <= self.full_attention_last_n_layers <= self.n_layers:
            raise ValueError(
                f"ModelConfig.full_attention_last_n_layers must be in [0, n_layers={self.n_layers}], "
                f"got {self.full_attention_last_n_layers}"
            )
        self._check_architecture()

    def _check_architecture(self) -> None:
        """The fields beyond the Llama-style default (Gemma's and the like)."""
        if self.layer_types is not None:
            if isinstance(self.layer_types, str) or len(self.layer_types) != self.n_layers or any(
                    kind not in LAYER_TYPES for kind in self.layer_types):
                raise ValueError(f"ModelConfig.layer_types must be None or n_layers={self.n_layers} of "
                                 f"{LAYER_TYPES}, got {self.layer_types!r}")
            self.layer_types = list(self.layer_types)
        if self.sliding_window is not None and not is_positive_int(self.sliding_window):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.sliding_window is None and "sliding" in (self.layer_types or []):
            raise ValueError("ModelConfig.sliding_window must be set: layer_types has sliding layers")
        for name in ("rope_base_local", "embedding_scale", "query_scale"):
            value = getattr(self, name)
            if value is not None and not (is_finite_number(value) and value > 0):
                raise ValueError(f"ModelConfig.{name} must be a positive number or None, got {value!r}")
        for name in ("qk_norm", "sandwich_norms"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"ModelConfig.mlp_activation must be one of {tuple(MLP_ACTIVATIONS)}, "
                             f"got {self.mlp_activation!r}")
        if not is_finite_number(self.norm_offset):
            raise ValueError(f"ModelConfig.norm_offset must be a finite number, got {self.norm_offset!r}")

    def types(self) -> list[str]:
        """``layer_types`` with its default: ``"global"`` or ``"sliding"`` per layer."""
        return self.layer_types or ["global"] * self.n_layers

    def layer_attention(self) -> list[str]:
        """The attention kind of each layer, first to last: ``"moba"``, ``"full"`` or ``"sliding"``."""
        n_full = self.full_attention_last_n_layers
        kinds = [self.attention] * (self.n_layers - n_full) + ["full"] * n_full
        return ["sliding" if layer == "sliding" else kind for layer, kind in zip(self.types(), kinds, strict=True)]

    def layer_rope_bases(self) -> list[float]:
        """The RoPE base of each layer (sliding layers may have their own)."""
        local = self.rope_base if self.rope_base_local is None else self.rope_base_local
        return [local if kind == "sliding" else self.rope_base for kind in self.types()]

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameter count from the formula (tests check it against the module).

        ``non_embedding=True`` drops the token embedding and an untied output
        projection, as Kaplan et al.'s N (their compute is ``6 * N`` per token).
        """
        C, D, V = self.d_model, self.head_dim, self.vocab_size
        attn = C * self.n_heads * D + 2 * C * self.n_kv_heads * D + self.n_heads * D * C
        attn += 2 * D if self.qk_norm else 0
        mlp = 3 * C * self.mlp_hidden
        norms = (4 if self.sandwich_norms else 2) * C
        total = self.n_layers * (attn + mlp + norms) + C  # + final norm
        if not non_embedding:
            total += V * C * (1 if self.tie_embeddings else 2)
        return total

    # FLOPs, two numbers kept apart on purpose: ``6 N`` per token, the paper's compute (Kaplan
    # et al.; blind to attention, so MoBA and full cost the same), and the attention FLOPs
    # really done over the (query, key) pairs each layer attends.

    def dense_flops_per_token(self, training: bool = True) -> int:
        """``6 N`` for training (``2 N`` forward), N = non-embedding parameters."""
        return (6 if training else 2) * self.num_parameters(non_embedding=True)

    def attention_flops_per_sequence(self, seq_len: int, layer_attention: list[str] | None = None,
                                     training: bool = True) -> int:
        """``QK^T`` and ``AV`` FLOPs of one sequence through all layers, ``4 H D`` per attended pair.

        ``layer_attention`` overrides the per-layer kinds (e.g. after a phase switch); training
        counts the backward as twice the forward.
        """
        pairs = {"full": keys_attended_full(seq_len),
                 "moba": keys_attended_moba(seq_len, self.moba.chunk_size, self.moba.top_k)}
        if self.sliding_window is not None:
            pairs["sliding"] = keys_attended_sliding(seq_len, self.sliding_window)
        attended = sum(pairs[kind] for kind in layer_attention or self.layer_attention())
        forward = 4 * self.n_heads * self.head_dim * attended
        return forward * (TRAINING_MULTIPLIER if training else 1)

    def attention_flops_per_token(self, seq_len: int, layer_attention: list[str] | None = None,
                                  training: bool = True) -> float:
        return self.attention_flops_per_sequence(seq_len, layer_attention, training) / seq_len

    def flops_per_token(self, seq_len: int, layer_attention: list[str] | None = None, training: bool = True) -> float:
        """``6 N`` plus the attention FLOPs really done, per token."""
        return self.dense_flops_per_token(training) + self.attention_flops_per_token(seq_len, layer_attention, training)

    def attention_sparsity(self, seq_len: int) -> float:
        """Share of causal (query, key) pairs MoBA skips at ``seq_len`` (0 when it equals full attention)."""
        return 1.0 - keys_attended_moba(seq_len, self.moba.chunk_size, self.moba.top_k) / keys_attended_full(seq_len)


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def rope_tables(seq_len: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[S, D/2]`` fp32, for rotary position embeddings.

    The frequencies are ``1 / base ** (2i / D)`` with Llama's rounding (``base ** (-2i / D)`` differs in
    the last bit, and at thousands of positions that moves logits of a pretrained model by 1e-4).
    """
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    angles = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., :D/2], x[..., D/2:])`` of ``x: [B, H, S, D]`` by position."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.to(x.dtype)


class OffsetRMSNorm(nn.RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (offset + weight)`` in fp32, then back to x's dtype.

    Its weights are centered on ``1 - offset`` (0 for Gemma's offset of 1), so they start as the identity.
    """

    def __init__(self, dim: int, eps: float | None, offset: float):
        self.offset = float(offset)  # before: nn.RMSNorm's __init__ calls reset_parameters
        super().__init__(dim, eps=eps)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (self.offset + self.weight.float())).type_as(x)


def rms_norm(dim: int, config: ModelConfig) -> nn.RMSNorm:
    """The model's RMSNorm over the last ``dim`` features (``nn.RMSNorm`` unless ``config.norm_offset``)."""
    if config.norm_offset:
        return OffsetRMSNorm(dim, config.norm_eps, config.norm_offset)
    return nn.RMSNorm(dim, eps=config.norm_eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, kind: str):
        super().__init__()
        self.config = config
        self.kind = kind
        self.override: str | None = None  # set by GPT.set_attention_override
        self.context_parallel: ContextParallel | None = None  # set by GPT.set_context_parallel
        C, D = config.d_model, config.head_dim
        self.wq = nn.Linear(C, config.n_heads * D, bias=False)
        self.wk = nn.Linear(C, config.n_kv_heads * D, bias=False)
        self.wv = nn.Linear(C, config.n_kv_heads * D, bias=False)
        self.wo = nn.Linear(config.n_heads * D, C, bias=False)
        self.q_norm = rms_norm(D, config) if config.qk_norm else None
        self.k_norm = rms_norm(D, config) if config.qk_norm else None

    @property
    def active_kind(self) -> str:
        """``"sliding"`` for a sliding layer (the override switches global layers only), else the override or kind."""
        return self.kind if self.kind == "sliding" else self.override or self.kind

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x: [B, S, C]`` -> q ``[B, H, S, D]``, k and v ``[B, H_kv, S, D]``, RoPE on q and k
        (after QK-norm, when the model has it)."""
        B, S, _ = x.shape
        cfg = self.config
        q = self.wq(x).view(B, S, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: ChunkLayout | None = None,
                cache: MoBAKVCache | None = None) -> torch.Tensor:
        """``x: [B, S, C]`` -> ``[B, S, C]``; with ``cache``, x holds the newest S positions.

        ``layout``: the chunk layout of these S positions, built once per model forward.
        """
        B, S, _ = x.shape
        cfg = self.config
        cp, kind, scale = self.context_parallel, self.active_kind, cfg.query_scale
        q, k, v = self.qkv(x, cos, sin)
        if cache is not None:
            y = self._attend_cached(q, k, v, cache)
        elif kind == "sliding" and cp is not None:
            y = context_parallel_sliding_attention(q, k, v, cp, cfg.sliding_window, scale=scale)
        elif kind == "sliding":
            y = sliding_window_attention(q, k, v, cfg.sliding_window, scale=scale)
        elif cp is not None and kind == "moba":
            y = context_parallel_attention(q, k, v, cp, cfg.moba, scale=scale)
        elif cp is not None:
            y = context_parallel_full_attention(q, k, v, cp, scale=scale)
        elif kind == "moba":
            y = moba_attention(q, k, v, cfg.moba, layout=layout, scale=scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=cfg.n_kv_heads != cfg.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, S, cfg.n_heads * cfg.head_dim))

    def _attend_cached(self, q, k, v, cache: MoBAKVCache) -> torch.Tensor:
        """Append k, v to the cache; attend the new queries over it (sliding window, MoBA decode or full causal)."""
        cfg = self.config
        cache.update(k, v)
        if self.active_kind == "sliding":
            if cache.start is not None:
                raise ValueError("a sliding-window layer does not decode left-padded caches (MoBAKVCache start)")
            return sliding_window_attention(q, cache.keys, cache.values, cfg.sliding_window, scale=cfg.query_scale,
                                            query_start=cache.length - q.shape[2])
        if self.active_kind == "moba":
            return moba_decode_attention(q, cache, cfg.moba, scale=cfg.query_scale)
        return dense_decode_attention(q, cache, scale=cfg.query_scale)


class GatedMLP(nn.Module):
    """``w_down(act(w_gate x) * w_up x)``: SwiGLU with SiLU, GeGLU with tanh-GELU (``config.mlp_activation``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(config.d_model, config.mlp_hidden, bias=False)
        self.w_up = nn.Linear(config.d_model, config.mlp_hidden, bias=False)
        self.w_down = nn.Linear(config.mlp_hidden, config.d_model, bias=False)
        self.activation = MLP_ACTIVATIONS[config.mlp_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(self.activation(self.w_gate(x)) * self.w_up(x))


SwiGLU = GatedMLP  # its name before GeGLU joined it


class Block(nn.Module):
    def __init__(self, config: ModelConfig, kind: str):
        super().__init__()
        self.attn_norm = rms_norm(config.d_model, config)
        self.attn = CausalSelfAttention(config, kind)
        self.mlp_norm = rms_norm(config.d_model, config)
        self.mlp = GatedMLP(config)
        self.attn_post_norm = rms_norm(config.d_model, config) if config.sandwich_norms else None
        self.mlp_post_norm = rms_norm(config.d_model, config) if config.sandwich_norms else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: ChunkLayout | None = None,
                cache: MoBAKVCache | None = None) -> torch.Tensor:
        h = self.attn(self.attn_norm(x), cos, sin, layout, cache)
        x = x + (h if self.attn_post_norm is None else self.attn_post_norm(h))
        h = self.mlp(self.mlp_norm(x))
        return x + (h if self.mlp_post_norm is None else self.mlp_post_norm(h))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.layer_attention())
        self.norm = rms_norm(config.d_model, config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual output projections by depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
                nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameters counted on the module (tied weights once); see ModelConfig.num_parameters."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def layer_attention(self) -> list[str]:
        """The attention kind each layer uses now (after any override)."""
        return [block.attn.active_kind for block in self.blocks]

    def set_attention_override(self, kind: str | None) -> None:
        """Make every layer use ``kind`` (``"full"`` or ``"moba"``); ``None`` restores the config."""
        if kind is not None and kind not in ATTENTION_KINDS:
            raise ValueError(f"attention override must be one of {ATTENTION_KINDS} or None, got {kind!r}")
        for block in self.blocks:
            block.attn.override = kind

    @property
    def attention_override(self) -> str | None:
        return self.blocks[0].attn.override

    @property
    def context_parallel(self) -> ContextParallel | None:
        return self.blocks[0].attn.context_parallel

    def set_context_parallel(self, cp: ContextParallel | None) -> None:
        """Split every sequence over ``cp``'s ranks (``None``: one process holds it all): ``forward``
        then takes this rank's slice of the tokens, ``[B, S / n]``, at its global positions."""
        for block in self.blocks:
            block.attn.context_parallel = cp if cp is not None and cp.size > 1 else None

    def forward(self, tokens: torch.Tensor, caches: list[MoBAKVCache] | None = None) -> torch.Tensor:
        """``tokens: [B, S]`` int -> logits ``[B, S, V]``.

        With ``caches`` (one :class:`MoBAKVCache` per layer) the tokens continue what the
        caches hold, and their keys and values are appended: incremental decoding.
        """
        return self.lm_head(self.hidden(tokens, caches))

    def hidden(self, tokens: torch.Tensor, caches: list[MoBAKVCache] | None = None) -> torch.Tensor:
        """``tokens: [B, S]`` int -> the last layer's normed states ``[B, S, C]``, what ``lm_head`` reads:
        logits of a few positions without the ``[B, S, V]`` of all (at 32K positions and a 262K vocabulary,
        34 GB in fp32)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tuple(tokens.shape)}")
        cfg = self.config
        B, S = tokens.shape
        cp = self.context_parallel
        if cp is not None and caches:
            raise ValueError("decoding with KV caches is not supported under context parallelism; "
                             "call set_context_parallel(None) on a model that holds whole sequences")
        past = caches[0].length if caches else 0
        if cp is not None:
            past, _ = cp.local_range(S * cp.size)  # this rank's first global position
        bases = cfg.layer_rope_bases()
        tables = {base: [table[past:] for table in rope_tables(past + S, cfg.head_dim, base, tokens.device)]
                  for base in dict.fromkeys(bases)}  # (cos, sin) per RoPE base
        layout = None if caches else chunk_layout(B, S, cfg.moba.chunk_size, tokens.device)  # shared by all layers
        x = self.tok_emb(tokens)
        if cfg.embedding_scale is not None:  # in the embedding's dtype, as Gemma (bf16 rounds sqrt(C))
            x = x * torch.tensor(cfg.embedding_scale, dtype=x.dtype, device=x.device)
        for i, (block, base) in enumerate(zip(self.blocks, bases, strict=True)):
            x = block(x, *tables[base], layout, caches[i] if caches else None)
        return self.norm(x)

    def new_caches(self, dense_decode: bool = False) -> list[MoBAKVCache]:
        """One empty cache per layer; ``dense_decode`` gives every query attending them full attention."""
        return [MoBAKVCache(self.config.moba.chunk_size, dense_decode=dense_decode) for _ in self.blocks]

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        dense_decode: bool = False,
    ) -> torch.Tensor:
        """Extend ``prompt: [B, S]`` by ``max_new_tokens``; greedy when ``temperature == 0``.

        With ``use_cache`` the prompt is prefilled once and each new token attends the KV
        caches (MoBA decode: it gathers only its selected chunks); ``dense_decode`` gives new
        tokens full attention, the paper's protocol. Tile granularity has no decode path, so
        it re-runs the whole sequence per token, as ``use_cache=False`` does.
        """
        new = list(self.generate_steps(prompt, max_new_tokens, temperature, top_k, generator, use_cache,
                                       dense_decode))
        return torch.cat([prompt, *new], dim=1)

    @torch.no_grad()
    def generate_steps(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        dense_decode: bool = False,
    ) -> Iterator[torch.Tensor]:
        """:meth:`generate`'s new tokens, each ``[B, 1]`` as soon as it is sampled (for streaming)."""
        use_cache = use_cache and self.config.moba.granularity == "token"
        caches = self.new_caches(dense_decode) if use_cache else None
        tokens = prompt  # with caches: the tokens not yet fed; without: the whole sequence
        for _ in range(max_new_tokens):
            logits = (self(tokens, caches) if use_cache else self(tokens))[:, -1]
            next_token = sample_next_token(logits, temperature, top_k, generator)
            tokens = next_token if use_cache else torch.cat([tokens, next_token], dim=1)
            yield next_token


@torch.no_grad()
def capture_attention_inputs(model: GPT, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(q [B, H, S, D], k [B, H_kv, S, D], v [B, H_kv, S, D])`` as attention sees them.

    One forward of ``tokens: [B, S]``; a pre-hook on each attention layer runs the layer's own
    :meth:`CausalSelfAttention.qkv` on the inputs it gets. For diagnostics and benchmarks.
    """
    captured = []

    def capture(attn: CausalSelfAttention, args) -> None:
        captured.append(attn.qkv(*args[:3]))  # (x, cos, sin)

    handles = [block.attn.register_forward_pre_hook(capture) for block in model.blocks]
    try:
        model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """``logits: [B, V]`` -> ``[B, 1]``: argmax when ``temperature == 0``, else a top-k-truncated sample."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        threshold = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
