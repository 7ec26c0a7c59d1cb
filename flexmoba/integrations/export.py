"""flexmoba's :class:`~flexmoba.model.GPT` as a Hugging Face ``LlamaForCausalLM``, logits unchanged.

    from flexmoba.integrations.export import to_llama
    to_llama(gpt).save_pretrained("out/hf")  # config.json (with config.moba) + weights

    from flexmoba.integrations.transformers import register
    register()  # reads config.moba
    model = AutoModelForCausalLM.from_pretrained("out/hf", attn_implementation="flexmoba")

The GPT is a Llama, exactly (fp32):

- RoPE: both rotate the halves ``(x[:D/2], x[D/2:])`` of each head (Llama's ``rotate_half``)
  with ``base ** (-2i / D)``, so q/k projection rows keep their order;
- RMSNorm: ``rms_norm_eps`` is the config's ``norm_eps``; without one, ``nn.RMSNorm`` uses the
  input dtype's machine epsilon, written as ``finfo(float32).eps`` (Llama always normalizes in
  fp32: bf16 runs differ by that rounding, not by the mapping);
- SwiGLU ``w_down(silu(w_gate x) * w_up x)`` is Llama's MLP; no biases anywhere;
- GQA: ``num_key_value_heads = n_kv_heads``; in both, query head ``h`` reads key/value
  head ``h // (H / H_kv)``; attention scale ``head_dim ** -0.5`` in both;
- tied or untied embeddings: ``tie_word_embeddings``.

The attention kinds go to ``config.moba``: MoBA layers first, then
``full_attention_last_n_layers`` full ones (a phase switch to full attention exports every
layer full). Token ids are the GPT's (bytes, for the byte-level models flexmoba trains): no
tokenizer is written and there are no BOS/EOS ids.
"""

from __future__ import annotations

import torch

from flexmoba.model import GPT, ModelConfig

__all__ = ["LAYER_WEIGHTS", "MODEL_WEIGHTS", "llama_config", "llama_state_dict", "moba_settings", "to_llama"]

LAYER_WEIGHTS = {  # GPT block parameter -> Llama decoder layer parameter
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
MODEL_WEIGHTS = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"}


def moba_settings(config: ModelConfig, layer_attention: list[str]) -> dict:
    """``config.moba`` for layers of the kinds ``layer_attention`` (MoBA first, then full)."""
    n_full = len(layer_attention) - layer_attention.index("full") if "full" in layer_attention else 0
    if layer_attention != ["moba"] * (len(layer_attention) - n_full) + ["full"] * n_full:
        raise ValueError(f"only MoBA layers followed by full ones can be exported, got {layer_attention}")
    settings = {"chunk_size": config.moba.chunk_size, "top_k": config.moba.top_k,
                "full_attention_last_n_layers": n_full}
    if config.moba.granularity != "token":
        settings["granularity"] = config.moba.granularity
    return settings


def llama_config(config: ModelConfig, layer_attention: list[str], max_position_embeddings: int):
    """The ``LlamaConfig`` of a GPT with ``config`` whose layers attend as ``layer_attention``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.mlp_hidden,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=config.norm_eps or torch.finfo(torch.float32).eps,
        rope_theta=config.rope_base, tie_word_embeddings=config.tie_embeddings, attention_bias=False,
        mlp_bias=False, attention_dropout=0.0, initializer_range=config.init_std,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        moba=moba_settings(config, layer_attention),
    )


def llama_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The GPT's weights under ``LlamaForCausalLM``'s names (the same tensors, not copies)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("blocks."):
            _, index, weight = name.split(".", 2)
            state[f"model.layers.{index}.{LAYER_WEIGHTS[weight]}"] = tensor
        else:
            state[MODEL_WEIGHTS[name]] = tensor
    return state


# ModelConfig fields a Llama cannot hold, at the value a Llama has.
LLAMA_DEFAULTS = {"layer_types": None, "sliding_window": None, "rope_base_local": None, "qk_norm": False,
                  "sandwich_norms": False, "mlp_activation": "silu", "embedding_scale": None, "query_scale": None,
                  "norm_offset": 0.0}


def llama_problem(config: ModelConfig) -> str | None:
    """The first setting of ``config`` a ``LlamaForCausalLM`` would compute otherwise, named, or None."""
    for name, value in LLAMA_DEFAULTS.items():
        actual = getattr(config, name)
        if name == "layer_types" and actual is not None and set(actual) == {"global"}:
            continue
        if actual != value:
            return f"ModelConfig.{name}={actual!r}: a Llama has none (it would compute other logits)"
    return None


def to_llama(model: GPT, max_position_embeddings: int | None = None):
    """A ``LlamaForCausalLM`` (eval mode, on CPU, GPT's dtype) computing ``model``'s logits;
    ``ValueError`` naming the setting when the GPT is not a Llama (e.g. Gemma 3's fields).

    ``max_position_embeddings`` is informational for RoPE as both models compute it; set
    it to the training length or beyond.
    """
    from transformers import LlamaForCausalLM

    problem = llama_problem(model.config)
    if problem:
        raise ValueError(f"only Llama-architecture models can be exported: {problem}")

    positions = max_position_embeddings or model.config.max_seq_len or 4096
    config = llama_config(model.config, model.layer_attention(), positions)
    llama = LlamaForCausalLM(config).to(next(model.parameters()).dtype)
    llama.load_state_dict({name: t.detach().cpu() for name, t in llama_state_dict(model).items()})
    return llama.eval()
