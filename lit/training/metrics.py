"""Loss by position window, as a torchmetrics Metric (sums and counts, so it syncs under DDP); loss on
copied spans of the long-range corpus against their first occurrences."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchmetrics import Metric

from lit.training.metric_names import bin_label  # noqa: F401  (here too: the reports import it from here)

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


class EvalCounts(Metric):
    """What an evaluation read: batches, sequences and scored target tokens (``target != ignore_index``),
    counted as it runs and summed over processes (``dist_reduce_fx="sum"``), so a report says what ran,
    not the configured limit. ``compute()`` is ``float64 [3]`` in that order."""

    full_state_update = False
    is_differentiable = False

    def __init__(self, ignore_index: int = IGNORE_INDEX, **kwargs):
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        for name in ("batches", "sequences", "tokens"):
            self.add_state(name, default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, targets: torch.Tensor) -> None:
        """``targets: [B, S]``, one batch of whole sequences."""
        self.batches += 1
        self.sequences += targets.shape[0]
        self.tokens += (targets != self.ignore_index).sum()

    def compute(self) -> torch.Tensor:
        return torch.stack([self.batches, self.sequences, self.tokens])


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


DISTANCE_EDGES = (4096, 8192, 16384)  # repeat-loss bins: [0, 4K), [4K, 8K), [8K, 16K), [16K, inf) bytes


@dataclass
class RepeatSpanLosses:
    """Loss sums and counts over copied spans and over the same spans' first occurrences (their
    sources), in all and per distance bin; ``+`` adds batches, :meth:`means` gives the report."""

    edges: tuple[int, ...]
    copy_sum: np.ndarray  # [n_bins]
    copy_count: np.ndarray
    source_sum: np.ndarray
    source_count: np.ndarray

    def __add__(self, other: RepeatSpanLosses) -> RepeatSpanLosses:
        if self.edges != other.edges:
            raise ValueError(f"cannot add repeat losses of distance edges {self.edges} and {other.edges}")
        return RepeatSpanLosses(self.edges, self.copy_sum + other.copy_sum, self.copy_count + other.copy_count,
                                self.source_sum + other.source_sum, self.source_count + other.source_count)

    def bins(self) -> list[tuple[int, int | None]]:
        """``[low, high)`` distances of each bin; the last has no upper end (None)."""
        bounds = (0, *self.edges)
        return [(low, bounds[i + 1] if i + 1 < len(bounds) else None) for i, low in enumerate(bounds)]

    def means(self) -> dict:
        """``{"copy", "source", "gap"}`` over every bin (gap = source - copy: what copying saves), and
        ``"bins"``: the same per ``(low, high)`` bin with its scored positions ``"count"``; NaN where empty."""
        def mean(total, count):
            return float(total / count) if count else float("nan")

        def summary(index):
            copy = mean(self.copy_sum[index].sum(), self.copy_count[index].sum())
            source = mean(self.source_sum[index].sum(), self.source_count[index].sum())
            return {"copy": copy, "source": source, "gap": source - copy, "count": int(self.copy_count[index].sum())}

        overall = summary(slice(None))
        return {**overall, "bins": {bounds: summary(i) for i, bounds in enumerate(self.bins())}}


def repeat_span_losses(token_loss: torch.Tensor, targets: torch.Tensor, repeats: Sequence[np.ndarray],
                       edges: Sequence[int] = DISTANCE_EDGES, skip: int = 0,
                       ignore_index: int = IGNORE_INDEX) -> RepeatSpanLosses:
    """Loss on each sequence's copied spans and on their sources, binned by distance (copy start - source start).

    ``token_loss, targets: [B, S]``, where target ``t`` predicts byte ``t + 1`` of the sequence;
    ``repeats[b]``: ``[r, 3]`` (start, length, source start) of sequence ``b``'s copies, relative to
    its first byte (:meth:`lit.training.long_range.LongRangeData.repeats_of`). Byte ``k`` of a span is
    scored for ``skip <= k < length`` where both the copy's and the source's byte ``k`` are valid
    targets, so both sides average the same bytes of the same spans. ``skip`` leaves out each span's
    first bytes, which a model cannot know are copied before it has seen them.
    """
    edges = tuple(int(e) for e in edges)
    n_bins = len(edges) + 1
    sums = {name: np.zeros(n_bins) for name in ("copy_sum", "copy_count", "source_sum", "source_count")}
    loss = token_loss.detach().double().cpu().numpy()
    valid = (targets != ignore_index).cpu().numpy()
    for b, spans in enumerate(repeats):
        for copy_t, source_t, distance in scored_span_targets(spans, valid[b], skip):
            k = distance_bin(edges, distance)
            sums["copy_sum"][k] += loss[b, copy_t].sum()
            sums["source_sum"][k] += loss[b, source_t].sum()
            sums["copy_count"][k] += len(copy_t)
            sums["source_count"][k] += len(source_t)
    return RepeatSpanLosses(edges, **sums)


def distance_bin(edges: Sequence[int], distance: int) -> int:
    """Index of the bin ``[0, e_0), [e_0, e_1), ..., [e_last, inf)`` holding ``distance``."""
    return int(np.searchsorted(edges, distance, side="right"))


def scored_span_targets(spans: np.ndarray, valid: np.ndarray, skip: int):
    """Per copied span of one sequence: ``(copy targets [n], source targets [n], distance)``.

    ``spans: [r, 3]`` (start, length, source start) relative to the sequence's first byte;
    ``valid: [S]`` bool, the targets that count. Byte ``k`` of a span (``skip <= k < length``) is
    target ``start - 1 + k`` of the copy and ``source - 1 + k`` of the source; a byte is kept
    where both targets lie in the sequence and are valid. Distance = start - source.
    """
    S = len(valid)
    for start, length, source in np.asarray(spans, dtype=np.int64).reshape(-1, 3):
        offsets = np.arange(skip, length)
        copy_t, source_t = start - 1 + offsets, source - 1 + offsets
        inside = (copy_t >= 0) & (copy_t < S) & (source_t >= 0) & (source_t < S)
        copy_t, source_t = copy_t[inside], source_t[inside]
        scored = valid[copy_t] & valid[source_t]
        yield copy_t[scored], source_t[scored], int(start - source)
