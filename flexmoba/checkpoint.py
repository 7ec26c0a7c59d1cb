"""The one loader of flexmoba checkpoints (generate, retrieval evaluation, benchmarks).

A checkpoint is what ``flexmoba fit`` writes: a Lightning checkpoint whose
``hyper_parameters["config"]`` holds the :class:`flexmoba.model.ModelConfig`'s fields as a
plain dict (so it loads with ``torch.load(weights_only=True)``: no pickled objects), whose
``state_dict`` keys start with ``model.`` and whose ``attention_override`` records a phase
switch. A plain ``{"config": ..., "state_dict": ...}`` dict works too. Loading needs torch
only, not Lightning.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import torch

from flexmoba.model import GPT, ModelConfig

__all__ = ["ARCHITECTURE_FIELDS", "architecture_mismatch", "checkpoint_config", "checkpoint_tokenizer", "load_model",
           "model_weights", "read_checkpoint"]

# What a model's function depends on besides its attention: weights trained under one of these do not
# carry over to another value.
ARCHITECTURE_FIELDS = ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "mlp_hidden", "tie_embeddings",
                       "head_dim", "rope_base", "norm_eps", "max_seq_len", "layer_types", "sliding_window",
                       "rope_base_local", "qk_norm", "sandwich_norms", "mlp_activation", "embedding_scale",
                       "query_scale", "norm_offset")


def read_checkpoint(path: str | Path) -> dict:
    """The checkpoint's dict, on CPU; tensors and plain data only (``weights_only=True``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # tensors read on use
    except pickle.UnpicklingError as error:
        raise ValueError(f"{path} holds pickled objects, which flexmoba does not load (weights_only=True); "
                         "a checkpoint written before the model config was stored as a dict? Re-save it "
                         "from a trusted Python session with the config converted by dataclasses.asdict") from error


def checkpoint_config(checkpoint: dict) -> ModelConfig:
    """The model config a checkpoint was trained with."""
    config = checkpoint.get("hyper_parameters", {}).get("config", checkpoint.get("config"))
    if config is None:
        raise ValueError("checkpoint holds no model config (expected hyper_parameters['config'] or 'config')")
    if isinstance(config, ModelConfig):
        return config
    if not isinstance(config, dict):
        config = vars(config)
    fields = {k: v for k, v in config.get("init_args", config).items() if not k.startswith("_")}  # or YAML-style
    return ModelConfig(**spec_fields_nested(fields))


def spec_fields_nested(fields: dict) -> dict:
    """Model config fields with the flat ``moba_chunk_size``/``moba_top_k``/``moba_granularity``/
    ``moba_backend`` that checkpoints written before :class:`flexmoba.MobaSpec` hold, as one ``moba``."""
    flat = {k.removeprefix("moba_"): fields.pop(k) for k in list(fields) if k.startswith("moba_")}
    if flat:
        fields["moba"] = {**flat, **fields.get("moba", {})}
    return fields


def model_weights(checkpoint: dict) -> dict:
    """The GPT's state dict in a checkpoint (a Lightning one's ``model.`` prefix dropped)."""
    state = checkpoint.get("state_dict", checkpoint)
    model_state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return model_state or state


def checkpoint_tokenizer(checkpoint: dict) -> str | None:
    """The tokenizer (its JSON text) a checkpoint carries (a token-level data module's, or an import's), or None."""
    for value in checkpoint.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer_json"), str):
            return value["tokenizer_json"]
    return None


def architecture_mismatch(saved: ModelConfig, config: ModelConfig) -> str | None:
    """The architecture fields on which ``config`` differs from ``saved``, as ``name saved != given``, or None."""
    def same(a, b) -> bool:
        return a == b or (isinstance(a, float) and isinstance(b, float) and abs(a - b) <= 1e-6 * abs(a))

    differ = [f"{name} {getattr(saved, name)} != {getattr(config, name)}" for name in ARCHITECTURE_FIELDS
              if not same(getattr(saved, name), getattr(config, name))]
    return ", ".join(differ) or None


def load_model(checkpoint: str | Path | dict, device: str | torch.device = "cpu", **overrides) -> GPT:
    """The checkpoint's :class:`GPT` on ``device``, in eval mode, with its attention override.

    Args:
        checkpoint: a path, or a dict from :func:`read_checkpoint`.
        overrides: :class:`ModelConfig` fields to change before the model is built; ``moba``
            as a dict of the :class:`flexmoba.MobaSpec` fields to change, e.g.
            ``moba={"top_k": 4}`` to evaluate with another top-k (the weights do not depend on it).
    """
    if not isinstance(checkpoint, dict):
        checkpoint = read_checkpoint(checkpoint)
    config = checkpoint_config(checkpoint)
    if isinstance(overrides.get("moba"), dict):
        overrides["moba"] = dataclasses.replace(config.moba, **overrides["moba"])
    config = dataclasses.replace(config, **overrides)
    model = GPT(config)
    model.load_state_dict(model_weights(checkpoint))
    model.set_attention_override(checkpoint.get("attention_override"))
    return model.eval().to(device)
