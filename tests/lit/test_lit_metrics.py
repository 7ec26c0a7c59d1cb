"""Loss by position window: the inclusion rule, by hand."""

import math

import pytest
import torch

from lit.metrics import IGNORE_INDEX, WindowedLoss, position_windows, trailing_window

X = IGNORE_INDEX


def test_window_boundaries():
    assert position_windows(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert trailing_window(10, 3) == [(7, 10)]
    with pytest.raises(ValueError, match="window"):
        position_windows(10, 0)
    with pytest.raises(ValueError, match="trailing window"):
        trailing_window(10, 11)


def test_hand_computed_windows():
    # Three sequences of 6 targets, windows of 2. Sequence 1 ends after 3 targets (padded),
    # sequence 2 after 5, so each window only averages the sequences that reach its end.
    loss = torch.tensor([
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        [10.0, 20.0, 30.0, 99.0, 99.0, 99.0],
        [0.5, 0.5, 0.5, 0.5, 0.5, 99.0],
    ])
    targets = torch.tensor([
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, X, X, X],
        [1, 1, 1, 1, 1, X],
    ])
    metric = WindowedLoss(position_windows(6, 2))
    metric.update(loss, targets)
    expected = torch.tensor([
        (1 + 2 + 10 + 20 + 0.5 + 0.5) / 6,  # [0, 2): all three reach position 1
        (3 + 4 + 0.5 + 0.5) / 4,            # [2, 4): sequence 1 stops at 3 targets, excluded
        (5 + 6) / 2,                        # [4, 6): only sequence 0 reaches position 5
    ], dtype=torch.float64)
    torch.testing.assert_close(metric.compute(), expected)


def test_window_nobody_reaches_is_nan_and_later_batches_accumulate():
    metric = WindowedLoss(position_windows(4, 2))
    metric.update(torch.ones(1, 4), torch.tensor([[1, 1, X, X]]))
    assert math.isnan(metric.compute()[1].item())
    metric.update(torch.full((1, 4), 3.0), torch.tensor([[1, 1, 1, 1]]))
    torch.testing.assert_close(metric.compute(), torch.tensor([2.0, 3.0], dtype=torch.float64))


def test_shards_sum_to_the_whole():
    """What DDP does: per-rank sums and counts, added. Same as one pass over all data."""
    torch.manual_seed(0)
    loss = torch.rand(8, 12)
    targets = torch.randint(0, 5, (8, 12))
    targets[2, 7:] = X
    targets[5, 3:] = X
    whole = WindowedLoss(position_windows(12, 5))
    whole.update(loss, targets)
    shards = [WindowedLoss(position_windows(12, 5)) for _ in range(2)]
    shards[0].update(loss[0::2], targets[0::2])
    shards[1].update(loss[1::2], targets[1::2])
    merged_sum = shards[0].loss_sum + shards[1].loss_sum
    merged_count = shards[0].token_count + shards[1].token_count
    torch.testing.assert_close(merged_sum / merged_count, whole.compute())
    assert whole._reductions["loss_sum"] is not None  # a dist_reduce_fx is set, so DDP syncs it


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="token_loss"):
        WindowedLoss(position_windows(4, 2)).update(torch.ones(2, 4), torch.ones(2, 3, dtype=torch.long))
