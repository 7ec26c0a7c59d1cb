"""Import a pretrained Llama-family model as a flexmoba checkpoint, with its tokenizer.

    flexmoba import-hf --source smollm2 --out runs/pretrained/smollm2           # the packaged SmolLM2-135M
    flexmoba import-hf --source path/to/hf-folder --out runs/pretrained/mine    # a transformers folder
    flexmoba import-hf --source path/to/model.gguf --out runs/pretrained/mine   # a llama.cpp file

writes ``model.ckpt`` (a flexmoba checkpoint: the GPT's config and weights, fp32, and the tokenizer)
and ``tokenizer.json`` (for ``lit.training.tokenizer.TokenFilesData``). The weights then train
(``--model.init_from <out>/model.ckpt``, see ``configs/pretrained/``), evaluate
(``flexmoba context-eval``), export (``flexmoba export-hf``) and decode (``flexmoba generate``) like
any flexmoba checkpoint. A checkpoint the GPT cannot represent exactly is refused, naming the setting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

from lit.training import checks
from lit.training.errors import UsageError
from lit.training.options import parse_dataclass

CHECKPOINT_NAME = "model.ckpt"
TOKENIZER_NAME = "tokenizer.json"


def imported_checkpoint(pretrained) -> dict:
    """The flexmoba checkpoint of a :class:`flexmoba.integrations.pretrained.Pretrained` (plain data and
    tensors: it loads with ``torch.load(weights_only=True)``)."""
    config = pretrained.model.config
    return {
        "hyper_parameters": {"config": dataclasses.asdict(config), "seq_len": config.max_seq_len},
        "state_dict": {f"model.{name}": tensor for name, tensor in pretrained.model.state_dict().items()},
        "tokenizer": {"tokenizer_json": pretrained.tokenizer_json},
        "imported_from": pretrained.source,
    }


def write_import(pretrained, out: Path) -> Path:
    """``model.ckpt`` and ``tokenizer.json`` (when the source has one) in ``out``; returns the checkpoint."""
    import torch  # here, not at the top: ``flexmoba import-hf --help`` does not wait for it

    out.mkdir(parents=True, exist_ok=True)
    if pretrained.tokenizer_json is not None:
        (out / TOKENIZER_NAME).write_text(pretrained.tokenizer_json)
    path = out / CHECKPOINT_NAME
    torch.save(imported_checkpoint(pretrained), path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # a checkpoint is there whole or not at all
    return path


@dataclass
class ImportJob:
    """What ``flexmoba import-hf`` imports.

    Args:
        source: a packaged short name (smollm2), a .gguf file, or a transformers model folder.
        out: the folder to write model.ckpt and tokenizer.json to.
        overwrite: replace what ``out`` holds (without it, a folder that holds files is refused).
    """

    source: str
    out: str
    overwrite: bool = False


def main(argv: list[str] | None = None) -> Path:
    job = parse_dataclass(ImportJob, argv, prog="flexmoba import-hf", description=__doc__)
    if Path(job.source).is_file() and Path(job.source).suffix != ".gguf":
        raise UsageError("--source", f"{job.source} is a file, not a .gguf", "give a .gguf file, a transformers "
                         "model folder or a packaged name (smollm2)")
    out = checks.output_folder("--out", job.out, job.overwrite)
    from transformers.utils import logging as transformers_logging

    from flexmoba.integrations.pretrained import PretrainedError, load_pretrained

    transformers_logging.set_verbosity_error()  # this process prints one line: the result, or the error
    transformers_logging.disable_progress_bar()

    try:
        with no_gguf_progress_bar():
            pretrained = load_pretrained(job.source)
    except PretrainedError as error:
        raise UsageError("--source", str(error)) from None
    except (ValueError, OSError, KeyError) as error:  # transformers' refusal of a file or folder it cannot read
        said = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError("--source", f"{job.source} is not a model transformers reads ({said})",
                         "give a Llama-family .gguf or transformers folder, or a packaged name (smollm2)") from None
    path = write_import(pretrained, out)
    config = pretrained.model.config
    tokenizer = f"; tokenizer {out / TOKENIZER_NAME}" if pretrained.tokenizer_json else "; no tokenizer in the source"
    print(f"flexmoba: import-hf done: {pretrained.model.num_parameters(False):,} parameters, context "
          f"{config.max_seq_len:,}, vocabulary {config.vocab_size:,}; checkpoint {path}{tokenizer}")
    return path


@contextlib.contextmanager
def no_gguf_progress_bar():
    """transformers' GGUF reader draws a tqdm bar of its own, which its logging switch leaves on (a
    redirected log fills with it); off while this is entered."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_reader
    except ImportError:  # a transformers without GGUF support: nothing to quiet
        gguf_reader = None
    bar = getattr(gguf_reader, "tqdm", None)
    if bar is not None:
        gguf_reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_reader.tqdm = bar

if __name__ == "__main__":
    from lit.cli.main import main as flexmoba

    flexmoba(["import-hf", *sys.argv[1:]])
