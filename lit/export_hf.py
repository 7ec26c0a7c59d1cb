"""Export a flexmoba checkpoint as a Hugging Face ``LlamaForCausalLM`` directory.

    python -m lit.export_hf --ckpt runs/moba/checkpoints/last.ckpt --out out/hf-moba

writes ``config.json`` (the Llama architecture plus ``"moba": {"chunk_size", "top_k",
"full_attention_last_n_layers"}``), the weights (safetensors) and ``generation_config.json``.
Load it with MoBA, its logits equal to the flexmoba model's (fp32)::

    from transformers import AutoModelForCausalLM
    from flexmoba.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_pretrained("out/hf-moba", attn_implementation="flexmoba")

A full-attention export also runs on any stock implementation (``"sdpa"``, ``"eager"``,
``"flash_attention_2"``). Token ids are bytes; no tokenizer is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flexmoba.integrations.export import to_llama
from lit.checkpoint import load_model, read_checkpoint

DEFAULT_MAX_POSITIONS = 4096


def export_checkpoint(ckpt: str | Path, out: str | Path, max_position_embeddings: int | None = None) -> Path:
    """Write the ``LlamaForCausalLM`` of checkpoint ``ckpt`` to the folder ``out``; returns ``out``.

    ``max_position_embeddings`` defaults to the training ``seq_len`` the checkpoint records
    (or 4096): informational, RoPE runs at any length.
    """
    checkpoint = read_checkpoint(ckpt)
    seq_len = checkpoint.get("hyper_parameters", {}).get("seq_len")
    llama = to_llama(load_model(checkpoint), max_position_embeddings or seq_len or DEFAULT_MAX_POSITIONS)
    out = Path(out)
    llama.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a flexmoba checkpoint (e.g. runs/moba/checkpoints/last.ckpt)")
    parser.add_argument("--out", required=True, help="the folder to write the Hugging Face model to")
    parser.add_argument("--max-position-embeddings", type=int, default=None,
                        help="config.max_position_embeddings (default: the checkpoint's training seq_len)")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.ckpt, args.out, args.max_position_embeddings)
    print(f"wrote a LlamaForCausalLM to {out} (load with attn_implementation='flexmoba' after "
          "flexmoba.integrations.transformers.register())")
    return out


if __name__ == "__main__":
    main()
