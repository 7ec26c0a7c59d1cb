"""Export a flexmoba checkpoint as a Hugging Face ``LlamaForCausalLM`` directory.

    flexmoba export-hf --ckpt runs/moba/checkpoints/last.ckpt --out out/hf-moba
    flexmoba export-hf --ckpt runs/moba/checkpoints/last.ckpt --out out/hf-moba --overwrite true   # replace it

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

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from flexmoba.checkpoint import load_model, read_checkpoint
from flexmoba.integrations.export import to_llama
from lit.cli import checks
from lit.cli.options import parse_dataclass

DEFAULT_MAX_POSITIONS = 4096
WeightDtype = Literal["float32", "bfloat16", "float16"]


def export_checkpoint(ckpt: str | Path | dict, out: str | Path, max_position_embeddings: int | None = None,
                      dtype: str = "float32") -> Path:
    """Write the ``LlamaForCausalLM`` of checkpoint ``ckpt`` (a path, or its dict) to the folder ``out``;
    returns ``out``.

    ``max_position_embeddings`` defaults to the training ``seq_len`` the checkpoint records
    (or 4096): informational, RoPE runs at any length. ``dtype``: of the written weights
    (the logits match the flexmoba model's in float32).
    """
    checkpoint = read_checkpoint(ckpt) if not isinstance(ckpt, dict) else ckpt
    seq_len = checkpoint.get("hyper_parameters", {}).get("seq_len")
    llama = to_llama(load_model(checkpoint), max_position_embeddings or seq_len or DEFAULT_MAX_POSITIONS)
    llama = llama.to(getattr(torch, dtype))
    out = Path(out)
    llama.save_pretrained(out)
    return out


@dataclass
class ExportJob:
    """What ``flexmoba export-hf`` writes.

    Args:
        ckpt: a flexmoba checkpoint (e.g. runs/moba/checkpoints/last.ckpt).
        out: the folder to write the Hugging Face model to.
        max_position_embeddings: config.max_position_embeddings (default: the checkpoint's training seq_len).
        dtype: of the written weights.
        overwrite: replace what ``out`` holds (without it, a folder that holds files is refused).
    """

    ckpt: str
    out: str
    max_position_embeddings: int | None = None
    dtype: WeightDtype = "float32"
    overwrite: bool = False


def main(argv: list[str] | None = None) -> Path:
    job = parse_dataclass(ExportJob, argv, prog="flexmoba export-hf", description=__doc__)
    checkpoint = checks.checkpoint_file("--ckpt", job.ckpt)
    checks.output_folder("--out", job.out, job.overwrite)
    out = export_checkpoint(checkpoint, job.out, job.max_position_embeddings, job.dtype)
    print(f"wrote a LlamaForCausalLM to {out} (load with attn_implementation='flexmoba' after "
          "flexmoba.integrations.transformers.register())")
    return out


if __name__ == "__main__":
    import sys

    from lit.cli.main import main as flexmoba

    flexmoba(["export-hf", *sys.argv[1:]])
