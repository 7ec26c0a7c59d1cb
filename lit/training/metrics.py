"""Loss by position window, as a torchmetrics Metric (sums and counts, so it syncs under DDP)."""

from __future__ import annotations

import torch
from torchmetrics import Metric

IGNORE_INDEX = -100


def position_windows(seq_len: int, window: int) -> list[tuple[int, int]]:
    """``[start, end)`` target positions: ``[0, w), [w, 2w), ...``, the last one cut at ``seq_len``."""
    if window <= 0:
        raise ValueError(f"window must be a positive int, got {window!r}")
    return [(start, min(start + window, seq_len)) for start in range(0, seq_len, window)]


def trailing_window(seq_len: int, window: int) -> list[tuple[int, int]]:
    """The last ``window`` target positions, ``[seq_len - window, seq_len)``."""
    if not 0 < window <= seq_len:
        raise ValueError(f"trailing window must be in [1, seq_len={seq_len}], got {window!r}")
    return [(seq_len - window, seq_len)]


class TokenMeanLoss(Metric):
    """Mean loss over every valid target token, summed in float64; a NaN loss is reported as
    NaN, never dropped (torchmetrics' ``MeanMetric(nan_strategy="disable")`` would also drop
    the weights). States ``loss_sum`` and ``token_count`` (``dist_reduce_fx="sum"``)."""

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(self, ignore_index: int = IGNORE_INDEX, **kwargs):
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("loss_sum", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("token_count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, token_loss: torch.Tensor, targets: torch.Tensor) -> None:
        """``token_loss: [B, S]`` per-target loss; ``targets: [B, S]`` with ``ignore_index`` for padding."""
        valid = targets != self.ignore_index
        self.loss_sum += token_loss.detach().double()[valid].sum()
        self.token_count += valid.sum()

    def compute(self) -> torch.Tensor:
        return (self.loss_sum / self.token_count).float()


class WindowedLoss(Metric):
    """Mean token loss inside fixed target-position windows.

    A sequence counts toward a window only if it reaches the window's end, i.e. its last
    valid target (``target != ignore_index``) sits at position ``>= end - 1``. So a short or
    padded sequence never drags early-position losses into a late window, and each window
    averages the same kind of context. Inside a counted window, ignored targets are skipped.

    States are per-window ``loss_sum`` and ``token_count`` (``dist_reduce_fx="sum"``).
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(self, windows: list[tuple[int, int]], ignore_index: int = IGNORE_INDEX, **kwargs):
        super().__init__(**kwargs)
        if not windows:
            raise ValueError("windows must not be empty")
        for start, end in windows:
            if not 0 <= start < end:
                raise ValueError(f"each window must be [start, end) with 0 <= start < end, got {(start, end)}")
        self.windows = [tuple(w) for w in windows]
        self.ignore_index = ignore_index
        n = len(self.windows)
        self.add_state("loss_sum", default=torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("token_count", default=torch.zeros(n, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, token_loss: torch.Tensor, targets: torch.Tensor) -> None:
        """``token_loss: [B, S]`` per-target loss; ``targets: [B, S]`` with ``ignore_index`` for padding."""
        if token_loss.shape != targets.shape or token_loss.dim() != 2:
            raise ValueError(
                f"token_loss and targets must both be [B, S], got {tuple(token_loss.shape)} and {tuple(targets.shape)}"
            )
        S = targets.shape[1]
        valid = targets != self.ignore_index  # [B, S]
        positions = torch.arange(S, device=targets.device)
        reach = torch.where(valid, positions + 1, 0).amax(dim=1)  # [B]: 1 + last valid position
        loss = torch.where(valid, token_loss.detach().double(), 0.0)
        for i, (start, end) in enumerate(self.windows):
            if end > S:
                continue  # no sequence here reaches this window
            counted = reach >= end  # [B]
            in_window = valid[counted, start:end]
            self.loss_sum[i] += loss[counted, start:end].sum()
            self.token_count[i] += in_window.sum()

    def compute(self) -> torch.Tensor:
        """``[n_windows]`` mean loss; NaN for a window no sequence reached, and NaN where a loss was NaN."""
        return self.loss_sum / self.token_count

    def reached(self) -> torch.Tensor:
        """``[n_windows]`` bool: windows some sequence reached (on any process), so a NaN there is a real one."""
        with self.sync_context():
            return self.token_count > 0
