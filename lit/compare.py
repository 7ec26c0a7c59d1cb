"""Main job: train MoBA and full attention on the same budget and compare them.

    python -m lit.compare                      # default budget, a few minutes on 2 CPU cores
    python -m lit.compare --steps 2 --max-files 5 --seq-len 128 --out /tmp/cmp   # smoke run

Both runs share the data, seed, model size and optimizer; only the attention differs. The
model defaults to the default model (``flexmoba.model.ModelConfig()``); the schedule fits
the short budget (warmup: 10% of ``--steps``).
Writes one folder ``<out>/compare-<timestamp>/`` holding ``results.md`` (the table),
``results.json``, ``val_loss.png``, ``loss_by_position.png`` and the per-run CSV logs.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from flexmoba.model import ModelConfig
from lit.data import PythonSourceData
from lit.module import LitLM

VARIANTS = ("moba", "full")
DEFAULT_MODEL = ModelConfig()


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chunk-size", type=int, default=DEFAULT_MODEL.moba_chunk_size, help="MoBA chunk (block) size")
    p.add_argument("--top-k", type=int, default=DEFAULT_MODEL.moba_top_k,
                   help="MoBA chunks per query, own chunk included")
    p.add_argument("--n-layers", type=int, default=DEFAULT_MODEL.n_layers)
    p.add_argument("--d-model", type=int, default=DEFAULT_MODEL.d_model)
    p.add_argument("--n-heads", type=int, default=DEFAULT_MODEL.n_heads)
    p.add_argument("--n-kv-heads", type=int, default=DEFAULT_MODEL.n_kv_heads)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    p.add_argument("--position-window", type=int, default=None, help="default: seq_len / 4")
    p.add_argument("--trailing-window", type=int, default=None, help="default: seq_len / 4")
    p.add_argument("--val-every", type=int, default=None, help="validate every N steps (default: steps / 5)")
    p.add_argument("--val-batches", type=int, default=8, help="batches per intermediate validation")
    p.add_argument("--final-val-batches", type=int, default=32, help="batches in the final validation")
    p.add_argument("--max-files", type=int, default=None, help="slice the corpus (train files)")
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--corpus-dir", default=None, help="default: this Python's standard library")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default="runs", help="parent folder of the run folder")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--moba-backend", default=DEFAULT_MODEL.moba_backend, help="flexmoba.moba_attention backend")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "batch_size", "chunk_size", "top_k"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def model_config(args: argparse.Namespace, attention: str) -> ModelConfig:
    return ModelConfig(
        n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
        attention=attention, moba_chunk_size=args.chunk_size, moba_top_k=args.top_k,
        moba_backend=args.moba_backend,
    )


def train_one(args: argparse.Namespace, attention: str, run_dir: Path, data: PythonSourceData) -> dict:
    L.seed_everything(args.seed, verbose=False)
    config = model_config(args, attention)
    window = args.position_window or max(1, args.seq_len // 4)
    module = LitLM(
        config, seq_len=args.seq_len, lr=args.lr,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10),
        position_window=window, trailing_window=args.trailing_window or window,
    )
    recorder = RunRecorder()
    logger = CSVLogger(run_dir, name=attention, version="")
    val_every = args.val_every or max(1, args.steps // 5)
    trainer = L.Trainer(
        max_steps=args.steps, val_check_interval=min(val_every, args.steps), check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches, gradient_clip_val=1.0, log_every_n_steps=max(1, min(10, args.steps)),
        logger=logger, callbacks=[recorder], enable_checkpointing=False, enable_model_summary=False,
        default_root_dir=run_dir / attention, accelerator="cpu", devices=1, num_sanity_val_steps=0,
    )
    print(f"[compare] training {attention}: {args.steps} steps of {args.batch_size} x {args.seq_len} tokens")
    trainer.fit(module, datamodule=data)
    trainer.limit_val_batches = args.final_val_batches
    final = trainer.validate(module, datamodule=data, verbose=False)[0]
    logger.finalize("success")
    return {
        "attention": attention,
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
        "attention_flops_per_token": config.attention_flops_per_token(args.seq_len),
    }


def window_losses(result: dict) -> list[float]:
    final = result["final"]
    return [final.get(f"val/loss_pos_{start:06d}_{end:06d}", float("nan")) for start, end in result["windows"]]


def markdown_report(args: argparse.Namespace, results: list[dict], fingerprint: str | None) -> str:
    moba_config = model_config(args, "moba")
    lines = [
        "# MoBA vs full attention",
        "",
        f"Same budget for both: {args.steps} steps x {args.batch_size} sequences x {args.seq_len} bytes, "
        f"seed {args.seed}; corpus fingerprint `{fingerprint}`.",
        f"MoBA: chunk {args.chunk_size}, top-k {args.top_k} "
        f"(skips {moba_config.attention_sparsity(args.seq_len):.0%} of causal query-key pairs at this length).",
        "",
        "| attention | val loss | val ppl | trailing loss | params (non-emb) | train time (s) | tokens/s "
        "| 6N FLOPs/token | attention FLOPs/token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f = r["final"]
        lines.append(
            f"| {r['attention']} | {f.get('val/loss', float('nan')):.4f} | {f.get('val/ppl', float('nan')):.2f} "
            f"| {f.get('val/loss_trailing', float('nan')):.4f} | {r['params_non_embedding']:,} "
            f"| {r['train_seconds']:.2f} | {r['tokens_per_second']:,.0f} | {r['dense_flops_per_token']:.3g} "
            f"| {r['attention_flops_per_token']:.3g} |"
        )
    windows = results[0]["windows"]
    lines += ["", "Validation loss by target position window:", "",
              "| attention | " + " | ".join(f"{s}-{e}" for s, e in windows) + " |",
              "|---|" + "---|" * len(windows)]
    for r in results:
        lines.append(f"| {r['attention']} | " + " | ".join(f"{x:.4f}" for x in window_losses(r)) + " |")
    lines += ["", f"Final validation: {args.final_val_batches} batches; the curve in val_loss.png uses the first "
              f"{args.val_batches}. Trailing loss = the last window of positions. Train time counts training "
              "batches only (no validation).", ""]
    return "\n".join(lines)


def plot(results: list[dict], run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        steps, losses = zip(*r["val_history"], strict=True) if r["val_history"] else ((), ())
        ax.plot(steps, losses, marker="o", label=r["attention"])
    ax.set(xlabel="step", ylabel="validation loss (nats/byte)", title="Validation loss during training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "val_loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        centers = [(s + e) / 2 for s, e in r["windows"]]
        ax.plot(centers, window_losses(r), marker="o", label=r["attention"])
    ax.set(xlabel="target position (window center)", ylabel="validation loss (nats/byte)",
           title="Loss by position")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss_by_position.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    run_dir = Path(args.out) / f"compare-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=False)
    data = PythonSourceData(
        corpus_dir=args.corpus_dir, seq_len=args.seq_len, batch_size=args.batch_size,
        max_files=args.max_files, max_bytes=args.max_bytes, cache_dir=args.cache_dir, seed=args.seed,
    )
    data.prepare_data()
    results = [train_one(args, attention, run_dir, data) for attention in VARIANTS]
    (run_dir / "results.json").write_text(json.dumps(
        {"args": vars(args), "fingerprint": data.fingerprint, "results": results}, indent=2))
    report = markdown_report(args, results, data.fingerprint)
    (run_dir / "results.md").write_text(report)
    plot(results, run_dir)
    print(report)
    print(f"[compare] results in {run_dir}")
    return run_dir


if __name__ == "__main__":
    main()
