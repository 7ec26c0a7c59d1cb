"""Throughput and MFU from the model's FLOP counts, measured without a per-step device sync.

The module reports ``flops_per_batch`` (see :class:`lit.training.module.LitLM`): the FLOPs one batch
costs on one device by ``ModelConfig.flops_per_token`` (6N plus the attention pairs really
computed, forward and backward when training, forward only in evaluation).

Lightning's ``ThroughputMonitor`` waits for the GPU after every batch to read the clock. Here
each batch only adds host numbers (its sequences, tokens and FLOPs, known from shapes); the
device is waited for and the clock read only when a rate is logged: at training steps that
log (every ``log_every_n_steps``), at the start and end of each evaluation, and around each
validation inside ``fit`` (whose time is taken out of the training clock).

Logged under ``throughput/<stage>/`` rather than ``train/``: ``train/`` holds what a resumed
run must reproduce exactly; a clock does not. Keys (Lightning's), for example:

- ``throughput/train/device/items_per_sec``: tokens per second per device,
- ``throughput/train/device/flops_per_sec`` and ``throughput/train/device/mfu`` (on GPUs whose peak
  Lightning knows),
- ``throughput/train/time``, ``.../batches``, ``.../samples``, ``.../lengths`` (tokens) so far.

Rates are averaged over the last ``window_size - 1`` intervals between measurements (the
default, 2: since the previous log); the first training interval starts at the first batch
and so includes any compilation. Evaluation rates cover the whole evaluation.
"""

from __future__ import annotations

from time import perf_counter

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit.training import metric_names


def sequences_in(batch) -> int:
    return batch[0].shape[0]


def tokens_in(batch) -> int:
    return batch[0].numel()


def wait_for_device(trainer: L.Trainer) -> None:
    """Let the device finish its queued work, so that the clock measures it (CUDA only)."""
    device = trainer.strategy.root_device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelFlopsThroughput(ThroughputMonitor):
    """``ThroughputMonitor`` for ``(inputs, targets)`` batches that syncs only when it logs,
    logging under ``throughput/<stage>/``.

    Args:
        window_size: measurements in the rolling average (at least 2: the rates then cover
            the interval since the previous measurement).
    """

    def __init__(self, window_size: int = 2):
        super().__init__(batch_size_fn=sequences_in, length_fn=tokens_in, window_size=max(2, window_size))
        self._pending_flops: dict[RunningStage, float] = {}
        self._logged_batches: dict[RunningStage, int] = {}  # the counts of the stage's last log
        self._validation_began: float | None = None

    def _start(self, trainer: L.Trainer) -> None:
        """Reset the stage's counts, wait for the device, start its clock at a zero measurement."""
        stage = trainer.state.stage
        self._throughputs[stage].reset()
        self._lengths[stage] = self._samples[stage] = self._batches[stage] = 0
        self._pending_flops[stage] = 0.0
        self._logged_batches[stage] = 0
        wait_for_device(trainer)
        self._t0s[stage] = perf_counter()
        self._throughputs[stage].update(time=0.0, batches=0, samples=0, lengths=0, flops=0)

    @torch.inference_mode()
    def _update(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, iter_num: int) -> None:
        """Count one batch: host numbers only, no clock, no device sync."""
        stage = trainer.state.stage
        self._lengths[stage] += tokens_in(batch)
        self._samples[stage] += sequences_in(batch)
        self._batches[stage] += 1
        flops = getattr(pl_module, "flops_per_batch", None)
        if flops is not None:
            self._pending_flops[stage] += flops

    def _measure(self, trainer: L.Trainer, stage: RunningStage) -> None:
        """Wait for the device, read the clock and add the counts so far as one measurement."""
        wait_for_device(trainer)
        self._throughputs[stage].update(
            time=perf_counter() - self._t0s[stage], batches=self._batches[stage], samples=self._samples[stage],
            lengths=self._lengths[stage], flops=self._pending_flops[stage])
        self._pending_flops[stage] = 0.0

    def _log(self, trainer: L.Trainer, stage: RunningStage, iter_num: int | None = None) -> None:
        metrics = self._throughputs[stage].compute()
        named = {metric_names.throughput(stage.value, key): value for key, value in metrics.items()}
        trainer._logger_connector.log_metrics(named, step=iter_num)
        self._logged_batches[stage] = self._batches[stage]

    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        """At a training step that logs: measure and log."""
        if not trainer._logger_connector.should_update_logs:
            return
        stage = trainer.state.stage
        self._measure(trainer, stage)
        self._log(trainer, stage, iter_num)

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The steps after the last log step measured and logged too: the counters then hold every batch
        the fit trained on (a report reads its tokens from them), not those up to a log step."""
        stage = RunningStage.TRAINING
        if self._batches.get(stage, 0) > self._logged_batches.get(stage, 0):
            self._measure(trainer, stage)
            self._log(trainer, stage)

    @rank_zero_only
    def on_validation_start(self, trainer: L.Trainer, *_) -> None:
        if trainer.sanity_checking:
            return
        if trainer.state.fn == TrainerFn.FITTING:
            wait_for_device(trainer)
            self._validation_began = perf_counter()  # the training clock stops here
        self._start(trainer)

    @rank_zero_only
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *_,
                                **__) -> None:
        if not trainer.sanity_checking:
            self._update(trainer, pl_module, batch, 0)

    @rank_zero_only
    def on_validation_end(self, trainer: L.Trainer, *_) -> None:
        if trainer.sanity_checking:
            return
        self._end_evaluation(trainer, trainer._evaluation_loop.batch_progress.total.ready)
        if trainer.state.fn == TrainerFn.FITTING and self._validation_began is not None:
            self._t0s[RunningStage.TRAINING] += perf_counter() - self._validation_began
            self._validation_began = None

    @rank_zero_only
    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *_, **__) -> None:
        self._update(trainer, pl_module, batch, 0)

    @rank_zero_only
    def on_test_end(self, trainer: L.Trainer, *_) -> None:
        self._end_evaluation(trainer, trainer._evaluation_loop.batch_progress.total.ready)

    @rank_zero_only
    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *_,
                             **__) -> None:
        self._update(trainer, pl_module, batch, 0)

    @rank_zero_only
    def on_predict_end(self, trainer: L.Trainer, *_) -> None:
        self._end_evaluation(trainer, trainer.predict_loop.batch_progress.total.ready)

    def _end_evaluation(self, trainer: L.Trainer, iter_num: int) -> None:
        stage = trainer.state.stage
        if self._batches.get(stage):
            self._measure(trainer, stage)
            self._log(trainer, stage, iter_num)
