"""Run MoBA inside a Hugging Face Llama: a tiny random model, no downloads.

    python examples/hf_llama_moba.py

The MoBA settings live in the model's config (``config.moba``), so ``save_pretrained``
keeps them and :func:`register` needs no arguments. With a real checkpoint:
``AutoModelForCausalLM.from_pretrained(path, attn_implementation="flexmoba")`` after
:func:`register` (a flexmoba checkpoint becomes such a folder with
``flexmoba export-hf --ckpt ... --out ...``).
"""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from flexmoba.integrations.transformers import register

# Prompt of 64 tokens = 4 chunks of 16, each query sees 2 of them; the last layer is full.
MOBA = {"chunk_size": 16, "top_k": 2, "full_attention_last_n_layers": 1, "backend": "gather"}


def main() -> None:
    torch.manual_seed(0)
    register()  # attn_implementation="flexmoba", settings from each model's config.moba
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, moba=MOBA)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    prompt = torch.randint(0, config.vocab_size, (1, 64))

    with torch.no_grad():
        dense = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                               pad_token_id=0)
        model.set_attn_implementation("flexmoba")  # MoBA prefill and MoBA decoding from the KV cache
        moba = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)

    print(f"attention: {model.config._attn_implementation} with config.moba = {model.config.moba}")
    print("prompt tail:     ", prompt[0, -8:].tolist())
    print("sdpa generated:  ", dense[0, prompt.shape[1]:].tolist())
    print("flexmoba generated:", moba[0, prompt.shape[1]:].tolist())


if __name__ == "__main__":
    main()
