"""Run MoBA inside a Hugging Face Llama: a tiny random model, no downloads.

    python examples/hf_llama_moba.py

With a real checkpoint, swap the config for ``AutoModelForCausalLM.from_pretrained(path,
attn_implementation="flexmoba")`` after :func:`register`.
"""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from flexmoba.integrations.transformers import register

CHUNK_SIZE, TOP_K = 16, 2  # prompt of 64 tokens = 4 chunks, each query sees 2 of them


def main() -> None:
    torch.manual_seed(0)
    register("flexmoba", chunk_size=CHUNK_SIZE, top_k=TOP_K, backend="gather")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    prompt = torch.randint(0, config.vocab_size, (1, 64))

    with torch.no_grad():
        dense = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                               pad_token_id=0)
        model.set_attn_implementation("flexmoba")  # MoBA prefill and MoBA decoding from the KV cache
        moba = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)

    print(f"attention: {model.config._attn_implementation} (chunk_size={CHUNK_SIZE}, top_k={TOP_K})")
    print("prompt tail:     ", prompt[0, -8:].tolist())
    print("sdpa generated:  ", dense[0, prompt.shape[1]:].tolist())
    print("flexmoba generated:", moba[0, prompt.shape[1]:].tolist())


if __name__ == "__main__":
    main()
