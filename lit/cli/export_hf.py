"""Export a flexmoba checkpoint as a Hugging Face ``LlamaForCausalLM`` directory.

    flexmoba export-hf --ckpt runs/moba/checkpoints/last.ckpt --out out/hf-moba
    flexmoba export-hf --ckpt runs/moba/checkpoints/last.ckpt --out out/hf-moba --overwrite true   # replace it

writes ``config.json`` (the Llama architecture plus ``"moba": {"chunk_size", "top_k",
"full_attention_last_n_layers"}``), the weights (safetensors) and ``generation_config.json``.
Load it with MoBA, its logits equal to the flexmoba model's (fp32)::

    from transformers import AutoModelForCausalLM
    from flexmoba.integrations.transformers import register
    register()  # first: transformers refuses attn_implementation="flexmoba" before it
    model = AutoModelForCausalLM.from_pretrained("out/hf-moba", attn_implementation="flexmoba")
    # or, registering it when nothing has: flexmoba.integrations.transformers.from_pretrained("out/hf-moba")

A full-attention export also runs on any stock implementation (``"sdpa"``, ``"eager"``,
``"flash_attention_2"``). A model trained on tokens (``lit.training.tokenizer.TokenFilesData``)
gets its tokenizer beside the weights (``tokenizer.json``, ``tokenizer_config.json``: load it with
``AutoTokenizer.from_pretrained(out)``), or the one ``--tokenizer`` names; a byte-level model's
token ids are bytes, and no tokenizer is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lit.cli.errors import fail
from lit.training import checks
from lit.training.errors import UsageError
from lit.training.options import parse_dataclass

DEFAULT_MAX_POSITIONS = 4096
WeightDtype = Literal["float32", "bfloat16", "float16"]


class TokenizerMismatch(ValueError):
    """The tokenizer to write cannot go with the checkpoint's model."""


def read_tokenizer(path: str | Path) -> str:
    if not Path(path).is_file():
        raise TokenizerMismatch(f"{path} is not a tokenizer.json file")
    return Path(path).read_text()


def write_tokenizer(tokenizer_json: str, vocab_size: int, out: Path) -> None:
    """Save the tokenizer for ``transformers`` in ``out``; TokenizerMismatch if its ids exceed the model's."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as error:  # tokenizers raises a bare Exception for text it cannot parse
        raise TokenizerMismatch(f"not a Hugging Face tokenizers file: {' '.join(str(error).split())}") from None
    if tokenizer.get_vocab_size() > vocab_size:
        raise TokenizerMismatch(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's "
                                f"vocab_size={vocab_size}")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(out)


def export_checkpoint(ckpt: str | Path | dict, out: str | Path, max_position_embeddings: int | None = None,
                      dtype: str = "float32", tokenizer: str | Path | None = None) -> Path:
    """Write the ``LlamaForCausalLM`` of checkpoint ``ckpt`` (a path, or its dict) to the folder ``out``;
    returns ``out``.

    ``max_position_embeddings`` defaults to the model's context (``max_seq_len``), else the training
    ``seq_len`` the checkpoint records (or 4096): informational, RoPE runs at any length. ``dtype``: of the
    written weights
    (the logits match the flexmoba model's in float32). ``tokenizer``: a ``tokenizer.json`` to write
    instead of the checkpoint's own (TokenizerMismatch if its ids exceed the model's vocabulary).
    """
    import torch  # here, not at the top: ``flexmoba export-hf --help`` does not wait for it

    from flexmoba.checkpoint import checkpoint_tokenizer, load_model, read_checkpoint
    from flexmoba.integrations.export import llama_problem, to_llama

    checkpoint = read_checkpoint(ckpt) if not isinstance(ckpt, dict) else ckpt
    seq_len = checkpoint.get("hyper_parameters", {}).get("seq_len")
    model = load_model(checkpoint)
    problem = llama_problem(model.config)
    if problem:
        raise UsageError("--ckpt", f"it holds a model export-hf cannot write as a Llama: {problem}",
                         "export Llama-architecture checkpoints only")
    tokenizer_json = read_tokenizer(tokenizer) if tokenizer is not None else checkpoint_tokenizer(checkpoint)
    out = Path(out)
    if tokenizer_json is not None:
        write_tokenizer(tokenizer_json, model.config.vocab_size, out)
    llama = to_llama(model, max_position_embeddings or model.config.max_seq_len or seq_len or DEFAULT_MAX_POSITIONS)
    llama.to(getattr(torch, dtype)).save_pretrained(out)
    return out


@dataclass
class ExportJob:
    """What ``flexmoba export-hf`` writes.

    Args:
        ckpt: a flexmoba checkpoint (e.g. runs/moba/checkpoints/last.ckpt).
        out: the folder to write the Hugging Face model to.
        max_position_embeddings: config.max_position_embeddings (default: the checkpoint's training seq_len).
        dtype: of the written weights.
        tokenizer: a tokenizer.json to write beside the weights (default: the checkpoint's, if it has one).
        overwrite: replace what ``out`` holds (without it, a folder that holds files is refused).
    """

    ckpt: str
    out: str
    max_position_embeddings: int | None = None
    dtype: WeightDtype = "float32"
    tokenizer: str | None = None
    overwrite: bool = False


def main(argv: list[str] | None = None) -> Path:
    job = parse_dataclass(ExportJob, argv, prog="flexmoba export-hf", description=__doc__)
    checkpoint = checks.checkpoint_file("--ckpt", job.ckpt)
    checks.output_folder("--out", job.out, job.overwrite)
    try:
        out = export_checkpoint(checkpoint, job.out, job.max_position_embeddings, job.dtype, job.tokenizer)
    except TokenizerMismatch as error:
        fail(f"{'--tokenizer' if job.tokenizer else '--ckpt'}: {error}")
    print(f"wrote a LlamaForCausalLM to {out} (load it with flexmoba.integrations.transformers.from_pretrained"
          f"({str(out)!r}), or with attn_implementation='flexmoba' after "
          "flexmoba.integrations.transformers.register())")
    return out


if __name__ == "__main__":
    import sys

    from lit.cli.main import main as flexmoba

    flexmoba(["export-hf", *sys.argv[1:]])
