"""Tiny random Llama checkpoints on disk, for the import tests (transformers' own classes wrote them)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320


def tiny_llama_config(**overrides):
    """GQA (4 query heads over 2 KV heads), head_dim 12 while hidden / heads is 8, a non-default RoPE base
    and RMSNorm epsilon: every field the import maps, none at a value the GPT would assume."""
    from transformers import LlamaConfig

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=50_000.0, tie_word_embeddings=True, hidden_act="silu")
    return LlamaConfig(**{**fields, **overrides})


def word_tokenizer(size: int = VOCAB):
    """A word-level tokenizer of ``size`` tokens (``w0`` ... ``w{size-1}``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def save_tiny_llama(folder: Path, seed: int = 0, with_tokenizer: bool = True, config=None, **overrides) -> Path:
    """A random ``LlamaForCausalLM`` (weights drawn at std 0.2, so logits differ by token) in ``folder``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or tiny_llama_config(**overrides), dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2) if parameter.dim() > 1 else parameter.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    if with_tokenizer:
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=word_tokenizer()).save_pretrained(folder)
    return Path(folder)
