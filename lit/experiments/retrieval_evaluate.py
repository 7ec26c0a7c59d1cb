"""``flexmoba retrieval evaluate``: the needle-retrieval grid of a checkpoint (:mod:`lit.experiments.retrieval`).

    flexmoba retrieval evaluate --ckpt runs/retrieval-moba/checkpoints/last.ckpt --out out/retrieval/moba

The command's options and its main, apart from the task: this module imports neither torch nor Lightning
(``--help`` is immediate); :mod:`lit.experiments.retrieval` is imported once the job runs.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from lit.training import checks
from lit.training.errors import UsageError
from lit.training.options import parse_dataclass


def task_description() -> str:
    """The task's description for ``--help``: :mod:`lit.experiments.retrieval`'s docstring, read from its
    source (importing it would import torch and Lightning)."""
    source = Path(importlib.util.find_spec("lit.experiments.retrieval").origin).read_text(encoding="utf-8")
    return ast.get_docstring(ast.parse(source), clean=False) or ""


def given(**values) -> dict:
    """The keyword arguments that are not None."""
    return {k: v for k, v in values.items() if v is not None}


@dataclass
class EvaluateJob:
    """What ``flexmoba retrieval evaluate`` measures.

    Args:
        ckpt: a retrieval run's checkpoint.
        out: output folder (retrieval.md, retrieval.png, retrieval.json).
        title: figure title (default: the layers' attention and routing).
        lengths: override the grid's sequence lengths.
        depths: override the grid's needle depths (0 = start, 1 = end).
        samples: samples per cell.
        attention: override every layer's attention (e.g. evaluate a MoBA-trained model fully).
        moba_chunk_size: evaluate with another MoBA chunk size.
        moba_top_k: evaluate with another MoBA top-k.
        device: auto (CUDA when there is a GPU), cpu, cuda, ...
        overwrite: replace what ``out`` holds (without it, a folder that holds files is refused).
    """

    ckpt: str
    out: str
    title: str | None = None
    lengths: list[int] | None = None
    depths: list[float] | None = None
    samples: int | None = None
    attention: Literal["moba", "full"] | None = None
    moba_chunk_size: int | None = None
    moba_top_k: int | None = None
    device: str = "auto"
    overwrite: bool = False


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        argv = ["evaluate", "--help"]  # the only subcommand
    if not argv or argv[0] != "evaluate":
        raise UsageError("retrieval", "the subcommand is evaluate: flexmoba retrieval evaluate --ckpt PATH --out DIR")
    job = parse_dataclass(EvaluateJob, argv[1:], prog="flexmoba retrieval evaluate", description=task_description())
    from lit.experiments.retrieval import evaluate_retrieval, load_run, markdown_table, write_report

    checkpoint = checks.checkpoint_file("--ckpt", job.ckpt)
    checks.output_folder("--out", job.out, job.overwrite)
    device = checks.device("--device", job.device)
    model, data = load_run(
        checkpoint,
        given(moba=given(chunk_size=job.moba_chunk_size, top_k=job.moba_top_k) or None),
        given(eval_lengths=job.lengths, eval_depths=job.depths, eval_samples=job.samples),
    )
    model.to(device)
    if job.attention:
        model.set_attention_override(job.attention)
    cfg, kinds = model.config, model.layer_attention()
    routing = "" if "moba" not in kinds else f", chunk {cfg.moba.chunk_size} top-{cfg.moba.top_k}"
    title = job.title or f"layers {'/'.join(kinds)}{routing}"
    rows = evaluate_retrieval(model, data)
    out = write_report(rows, job.out, title)
    print(markdown_table(rows, title))
    print(f"wrote {out}/retrieval.md, retrieval.png, retrieval.json; task {asdict(data.task)}")
