"""Main job: train MoBA and full attention on the same budget and compare them.

    flexmoba compare                               # default budget, a few minutes on 2 CPU cores
    flexmoba compare --seeds 3                     # three seeds per attention kind: mean ± std
    flexmoba compare --steps 2 --max_files 5 --seq_len 128 --out /tmp/cmp   # smoke run
    flexmoba compare --model.moba_top_k 2 --model.d_model 256                # any ModelConfig field

Both kinds share the data, seeds, model size and optimizer; only ``model.attention`` differs.
The model defaults to the default model (``flexmoba.model.ModelConfig()``); the schedule fits
the short budget (warmup: a tenth of ``--steps``). On a CUDA machine the runs use the GPU with
``bf16-mixed`` precision (``--accelerator``/``--precision`` override). Writes one folder
``<out>/compare-<timestamp>/`` holding ``results.md`` (the table, mean ± std over seeds),
``results.json``, ``val_loss.png``, ``loss_by_position.png`` and per run
``<attention>/seed<N>/`` its CSV and TensorBoard logs and ``final.ckpt``.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from flexmoba.model import ModelConfig
from lit.cli.options import fail, parse_dataclass
from lit.training.data import ByteFilesData, CorpusError
from lit.training.module import LitLM

VARIANTS = ("moba", "full")


@dataclass
class CompareJob:
    """What ``flexmoba compare`` trains.

    Args:
        model: the model of both kinds (``attention`` is set per kind).
        steps: optimizer steps per run.
        seq_len: bytes per training sequence.
        batch_size: sequences per step.
        seeds: seeds per attention kind (``seed``, ``seed + 1``, ...); with 2 or more the table
            reports mean ± sample std.
        seed: the first seed.
        lr: AdamW peak learning rate.
        warmup_steps: default a tenth of ``steps``.
        position_window: loss-by-position window; default ``seq_len / 4``.
        trailing_window: trailing-loss window; default ``position_window``.
        val_every: validate every N steps; default ``steps / 5``.
        val_batches: batches per intermediate validation.
        final_val_batches: batches in the final validation.
        root: corpus folder (every file matching ``patterns`` is a document; bytes are tokens);
            default this Python's standard library.
        patterns: globs of the files to read, e.g. ``["*.txt", "*.md"]``; default ``["*.py"]``.
        max_files: use only this many training files.
        max_bytes: use only this many bytes.
        cache_dir: tokenized-corpus cache folder.
        out: parent folder of the run folder.
        accelerator: Lightning accelerator (``auto``: CUDA when there is one).
        precision: Lightning precision; default ``bf16-mixed`` on CUDA, ``32-true`` elsewhere.
        threads: torch CPU threads (default: torch's choice).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 100
    seq_len: int = 1024
    batch_size: int = 8
    seeds: int = 1
    seed: int = 1337
    lr: float = 3e-3
    warmup_steps: int | None = None
    position_window: int | None = None
    trailing_window: int | None = None
    val_every: int | None = None
    val_batches: int = 8
    final_val_batches: int = 32
    root: str | None = None
    patterns: list[str] | None = None
    max_files: int | None = None
    max_bytes: int | None = None
    cache_dir: str | None = None
    out: str = "runs"
    accelerator: str = "auto"
    precision: str | None = None
    threads: int | None = None

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch_size", "seeds", "val_batches", "final_val_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name} must be a positive int, got {value!r}")

    @property
    def window(self) -> int:
        return self.position_window or max(1, self.seq_len // 4)

    def seed_list(self) -> list[int]:
        return [self.seed + i for i in range(self.seeds)]

    def model_config(self, attention: str) -> ModelConfig:
        return replace(self.model, attention=attention)

    def trainer_precision(self) -> str:
        if self.precision is not None:
            return self.precision
        on_cuda = self.accelerator in ("auto", "cuda", "gpu") and torch.cuda.is_available()
        return "bf16-mixed" if on_cuda else "32-true"


class RunRecorder(L.Callback):
    """Wall time in training batches only (validation excluded), tokens trained on, and the
    validation loss at each validation during fit (same batches every time).
    """

    def __init__(self):
        self.seconds = 0.0
        self.tokens = 0
        self.val_history: list[tuple[int, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seconds += time.perf_counter() - self._start
        self.tokens += batch[0].numel() * trainer.world_size

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "fit" and not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self.val_history.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


def progress_bar() -> list[L.Callback]:
    try:
        from lightning.pytorch.callbacks import RichProgressBar

        return [RichProgressBar()]
    except (ImportError, ModuleNotFoundError):  # rich is optional
        return []


def train_one(job: CompareJob, attention: str, seed: int, run_dir: Path, data: ByteFilesData) -> dict:
    """One fit + final validation; its logs and ``final.ckpt`` go to ``run_dir``."""
    L.seed_everything(seed, verbose=False)
    config = job.model_config(attention)
    module = LitLM(
        config, seq_len=job.seq_len, lr=job.lr,
        warmup_steps=job.warmup_steps if job.warmup_steps is not None else max(1, job.steps // 10),
        position_window=job.window, trailing_window=job.trailing_window or job.window,
    )
    recorder = RunRecorder()
    loggers = [CSVLogger(run_dir, name="csv", version=""), TensorBoardLogger(run_dir, name="tb", version="")]
    val_every = job.val_every or max(1, job.steps // 5)
    trainer = L.Trainer(
        max_steps=job.steps, val_check_interval=min(val_every, job.steps), check_val_every_n_epoch=None,
        limit_val_batches=job.val_batches, gradient_clip_val=1.0, log_every_n_steps=max(1, min(10, job.steps)),
        logger=loggers, callbacks=[recorder, *progress_bar()], enable_checkpointing=False,
        enable_model_summary=False, default_root_dir=run_dir, accelerator=job.accelerator, devices=1,
        precision=job.trainer_precision(), num_sanity_val_steps=0,
    )
    print(f"[compare] training {attention} (seed {seed}) on {trainer.strategy.root_device}: "
          f"{job.steps} steps of {job.batch_size} x {job.seq_len} tokens -> {run_dir}")
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(run_dir / "final.ckpt")
    trainer.limit_val_batches = job.final_val_batches
    final = trainer.validate(module, datamodule=data, verbose=False)[0]
    for logger in loggers:
        logger.finalize("success")
    return {
        "attention": attention,
        "seed": seed,
        "config": asdict(config),
        "final": {k: float(v) for k, v in final.items()},
        "val_history": recorder.val_history,
        "windows": module.windows,
        "params_non_embedding": module.model.num_parameters(non_embedding=True),
        "params_total": module.model.num_parameters(non_embedding=False),
        "train_seconds": recorder.seconds,
        "train_tokens": recorder.tokens,
        "tokens_per_second": recorder.tokens / max(recorder.seconds, 1e-9),
        "dense_flops_per_token": config.dense_flops_per_token(),
        "attention_flops_per_token": config.attention_flops_per_token(job.seq_len),
        "checkpoint": str(run_dir / "final.ckpt"),
    }


def window_losses(result: dict) -> list[float]:
    final = result["final"]
    return [final.get(f"val/loss_pos_{start:06d}_{end:06d}", float("nan")) for start, end in result["windows"]]


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``None`` for a single value)."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))  # NaN-safe, unlike stdev


def fmt(values: list[float], spec: str) -> str:
    mean, std = mean_std(values)
    return f"{mean:{spec}}" if std is None else f"{mean:{spec}} ± {std:{spec}}"


def by_attention(results: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for r in results:
        grouped.setdefault(r["attention"], []).append(r)
    return grouped


def markdown_report(job: CompareJob, results: list[dict], fingerprint: str | None) -> str:
    moba = job.model_config("moba")
    seeds = job.seed_list()
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]} (mean ± sample std)"
    lines = [
        "# MoBA vs full attention",
        "",
        f"Same budget for both: {job.steps} steps x {job.batch_size} sequences x {job.seq_len} bytes, "
        f"{seed_text}; corpus fingerprint `{fingerprint}`.",
        f"MoBA: chunk {moba.moba_chunk_size}, top-k {moba.moba_top_k} "
        f"(skips {moba.attention_sparsity(job.seq_len):.0%} of causal query-key pairs at this length).",
        "",
        "| attention | val loss | val bpb | val ppl | trailing loss | params (non-emb) | train time (s) | tokens/s "
        "| 6N FLOPs/token | attention FLOPs/token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for attention, runs in by_attention(results).items():
        def final(key, runs=runs):
            return [r["final"].get(key, float("nan")) for r in runs]
        first = runs[0]
        lines.append(
            f"| {attention} | {fmt(final('val/loss'), '.4f')} | {fmt(final('val/bpb'), '.4f')} "
            f"| {fmt(final('val/ppl'), '.2f')} | {fmt(final('val/loss_trailing'), '.4f')} "
            f"| {first['params_non_embedding']:,} | {fmt([r['train_seconds'] for r in runs], '.2f')} "
            f"| {fmt([r['tokens_per_second'] for r in runs], ',.0f')} | {first['dense_flops_per_token']:.3g} "
            f"| {first['attention_flops_per_token']:.3g} |"
        )
    windows = results[0]["windows"]
    lines += ["", "Validation loss by target position window:", "",
              "| attention | " + " | ".join(f"{s}-{e}" for s, e in windows) + " |",
              "|---|" + "---|" * len(windows)]
    for attention, runs in by_attention(results).items():
        per_window = zip(*(window_losses(r) for r in runs), strict=True)
        lines.append(f"| {attention} | " + " | ".join(fmt(list(w), ".4f") for w in per_window) + " |")
    lines += ["", f"Final validation: {job.final_val_batches} batches; the curve in val_loss.png uses the first "
              f"{job.val_batches}. Trailing loss = the last window of positions; bpb = bits per byte. "
              "Train time counts training batches only (no validation).", ""]
    return "\n".join(lines)


def plot_mean_and_std(results: list[dict], x_of, losses_of, labels: dict, path: Path) -> None:
    """One line per attention kind: the seed mean of ``losses_of(run)`` at ``x_of(run)``, seed std as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for attention, runs in by_attention(results).items():
        stats = [mean_std(list(values)) for values in zip(*(losses_of(r) for r in runs), strict=True)]
        ax.errorbar(x_of(runs[0]), [m for m, _ in stats], yerr=[s or 0.0 for _, s in stats], marker="o", capsize=3,
                    label=attention)
    ax.set(ylabel="validation loss (nats/byte)", **labels)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(results: list[dict], run_dir: Path) -> None:
    plot_mean_and_std(results, lambda r: [s for s, _ in r["val_history"]], lambda r: [v for _, v in r["val_history"]],
                      {"xlabel": "step", "title": "Validation loss during training"}, run_dir / "val_loss.png")
    plot_mean_and_std(results, lambda r: [(s + e) / 2 for s, e in r["windows"]], window_losses,
                      {"xlabel": "target position (window center)", "title": "Loss by position"},
                      run_dir / "loss_by_position.png")


def run(job: CompareJob) -> Path:
    """Train every (attention, seed) pair of ``job`` and write the report; return its folder."""
    if job.threads:
        torch.set_num_threads(job.threads)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    data = ByteFilesData(
        root=job.root, patterns=job.patterns, seq_len=job.seq_len, batch_size=job.batch_size,
        max_files=job.max_files, max_bytes=job.max_bytes, cache_dir=job.cache_dir, seed=job.seed,
    )
    try:
        data.check_files()
    except CorpusError as error:
        fail("flexmoba compare", f"--{error.option}: {error}")
    run_dir = Path(job.out) / f"compare-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=False)
    print(f"[compare] results go to {run_dir}")
    data.prepare_data()
    results = [train_one(job, attention, seed, run_dir / attention / f"seed{seed}", data)
               for attention in VARIANTS for seed in job.seed_list()]
    (run_dir / "results.json").write_text(json.dumps(
        {"job": asdict(job), "fingerprint": data.fingerprint, "results": results}, indent=2))
    report = markdown_report(job, results, data.fingerprint)
    (run_dir / "results.md").write_text(report)
    plot(results, run_dir)
    print(report)
    print(f"[compare] results in {run_dir}")
    return run_dir


def main(argv: list[str] | None = None) -> Path:
    return run(parse_dataclass(CompareJob, argv, prog="flexmoba compare", description=__doc__))


if __name__ == "__main__":
    main()
