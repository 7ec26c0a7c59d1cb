"""``flexmoba predict`` output: one JSON line per sequence, written as batches finish."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch.callbacks import BasePredictionWriter


class JsonlPredictionWriter(BasePredictionWriter):
    """Appends each predicted sequence to ``<output_dir>/predictions-rank<R>.jsonl``:
    ``{"batch": i, "row": j, "loss": nats per byte, "continuation": text, "continuation_bytes": [...]}``.

    Args:
        output_dir: the folder; default ``<trainer.default_root_dir>/predictions``.
    """

    def __init__(self, output_dir: str | None = None):
        super().__init__(write_interval="batch")
        self.output_dir = output_dir
        self.path: Path | None = None

    def on_predict_start(self, trainer, pl_module) -> None:
        folder = Path(self.output_dir or Path(trainer.default_root_dir) / "predictions")
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"predictions-rank{trainer.global_rank}.jsonl"
        self.path.write_text("")
        if trainer.is_global_zero:
            print(f"[predict] writing predictions to {folder}")

    def write_on_batch_end(self, trainer, pl_module, prediction: dict[str, torch.Tensor], batch_indices,
                           batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        losses = prediction["loss"].float().tolist()
        continuations = prediction["continuation"].tolist()
        with self.path.open("a") as f:
            for row, (loss, tokens) in enumerate(zip(losses, continuations, strict=True)):
                record = {"batch": batch_idx, "row": row, "loss": loss,
                          "continuation": bytes(tokens).decode("utf-8", errors="replace"),
                          "continuation_bytes": tokens}
                f.write(json.dumps(record) + "\n")
