"""What a run shows while it trains: a progress bar counting steps, one line for the model, one at the end."""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar
from lightning.pytorch.utilities import rank_zero_only

from lit.training import metric_names


@rank_zero_only
def say(message: str) -> None:
    """One ``flexmoba: ...`` line on stderr from rank 0, shown even when Python warnings are silenced."""
    sys.stderr.write(f"flexmoba: {message}\n")


class StepProgressBar(RichProgressBar):
    """The training bar counts optimizer steps up to ``max_steps`` across epochs and resumes.

    Lightning's counts the epoch's batches and names the epoch out of ``max_epochs - 1``, which
    reads ``Epoch 0/-2`` when ``max_steps`` ends the fit (and ``20/10`` after a resume).
    """

    def counts_steps(self) -> bool:
        return self.trainer.max_steps is not None and self.trainer.max_steps > 0

    @property
    def total_train_batches(self):
        return self.trainer.max_steps if self.counts_steps() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return "step" if self.counts_steps() else super()._get_train_description(current_epoch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        shown = trainer.global_step - 1 if self.counts_steps() else batch_idx  # the bar shows index + 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, shown)


class ModelLine(ModelSummary):
    """The model in one line (Lightning's table adds a FLOPs column that reads 0: it does not measure them)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = sum(p.numel() for p in pl_module.parameters())
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        config = getattr(pl_module, "config", None)
        shape = f" ({config.n_layers} layers, d_model {config.d_model}, {config.attention})" if config else ""
        say(f"model: {total:,} parameters, {trainable:,} trainable{shape}")


def with_own_display(trainer: L.Trainer) -> L.Trainer:
    """Lightning's default progress bar and model summary replaced by the two above (a user's own stay)."""
    for i, callback in enumerate(trainer.callbacks):
        if type(callback) is RichProgressBar:
            trainer.callbacks[i] = StepProgressBar()
        elif type(callback) in (ModelSummary, RichModelSummary):
            trainer.callbacks[i] = ModelLine()
    return trainer


STAGE_OF = {"fit": "val", "validate": "val", "test": "test"}


def run_summary(trainer: L.Trainer, subcommand: str, loaded: str | None) -> str:
    """The line a run ends with: the checkpoint it started from, its loss, the checkpoint it saved (a fit) and
    where its logs are."""
    done = f"{subcommand} done" + (f" at step {trainer.global_step}" if subcommand == "fit" else "")
    parts = [done + (f" (from {loaded})" if loaded else "")]
    stage = STAGE_OF.get(subcommand)
    if stage:
        key = metric_names.loss(stage)
        loss = trainer.callback_metrics.get(key)
        batches = getattr(trainer, f"num_{stage}_batches", None) or [0]
        count = sum(batches)
        parts.append(f"{key} {float(loss):.4f} ({count:g} batch{'es' * (count != 1)})" if loss is not None
                     else "no validation ran")
    callback = trainer.checkpoint_callback
    if subcommand == "fit":
        checkpoint = callback.last_model_path or callback.best_model_path if callback is not None else ""
        parts.append(f"checkpoint {checkpoint or 'none saved'}")
    logs = [logger.log_dir for logger in trainer.loggers if getattr(logger, "log_dir", None)]
    parts.append(f"logs {', '.join(logs) or 'none'}")
    return "; ".join(parts)
