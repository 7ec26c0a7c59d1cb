"""Throughput and MFU through Lightning's ``ThroughputMonitor``, fed with the model's FLOP counts.

The module reports ``flops_per_batch`` (see :class:`lit.training.module.LitLM`): the FLOPs one batch
costs on one device by ``ModelConfig.flops_per_token`` (6N plus the attention pairs really
computed, forward and backward when training, forward only in evaluation). Lightning turns
that into FLOP/s and, on GPUs it knows the peak of, MFU.

Logged under ``throughput/<stage>/`` rather than ``train/``: ``train/`` holds what a resumed
run must reproduce exactly; a clock does not. Keys (Lightning's), for example:

- ``throughput/train/device/items_per_sec``: tokens per second per device,
- ``throughput/train/device/flops_per_sec`` and ``throughput/train/device/mfu``,
- ``throughput/train/time``, ``.../batches``, ``.../samples``, ``.../lengths`` (tokens) so far.

Rates are rolling averages over the last ``window_size`` batches and appear once that many
batches have run.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ThroughputMonitor

PREFIX = "throughput"


def sequences_in(batch) -> int:
    return batch[0].shape[0]


def tokens_in(batch) -> int:
    return batch[0].numel()


class ModelFlopsThroughput(ThroughputMonitor):
    """``ThroughputMonitor`` counting sequences and tokens of ``(inputs, targets)`` batches,
    logging under ``throughput/<stage>/``.

    Args:
        window_size: batches in the rolling average (at least 2).
    """

    def __init__(self, window_size: int = 10):
        super().__init__(batch_size_fn=sequences_in, length_fn=tokens_in, window_size=max(2, window_size))

    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        if not trainer._logger_connector.should_update_logs:
            return
        stage = trainer.state.stage
        metrics = self._throughputs[stage].compute()
        named = {f"{PREFIX}/{stage.value}/{key}": value for key, value in metrics.items()}
        trainer._logger_connector.log_metrics(named, step=iter_num)
