"""Loss by position window: the inclusion rule, by hand; loss on copied spans against their sources, by hand."""

import math

import numpy as np
import pytest
import torch

from lit.training.metrics import (
    IGNORE_INDEX,
    TokenMeanLoss,
    WindowedLoss,
    position_windows,
    repeat_span_losses,
    trailing_window,
)

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


def test_ignored_targets_inside_a_counted_window_are_skipped():
    # Interior ignored targets (as in retrieval data, where only answers are scored): the
    # sequence still reaches the window's end, so it counts, but only its real targets do.
    loss = torch.tensor([
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        [10.0, 20.0, 30.0, 40.0, 50.0, 60.0],
    ])
    targets = torch.tensor([
        [1, X, 1, X, X, 1],
        [X, X, 1, 1, 1, X],
    ])
    metric = WindowedLoss(position_windows(6, 3))
    metric.update(loss, targets)
    expected = torch.tensor([
        (1 + 3 + 30) / 3,  # [0, 3): both reach position 2; 2.0, 10.0 and 20.0 are ignored
        6 / 1,             # [3, 6): only sequence 0 reaches position 5, and only its 6.0 is real
    ], dtype=torch.float64)
    torch.testing.assert_close(metric.compute(), expected)
    torch.testing.assert_close(metric.token_count, torch.tensor([3.0, 1.0], dtype=torch.float64))


def test_random_masks_match_a_loop_over_sequences():
    """Any pattern of ignored targets, against the rule spelled out one sequence at a time."""
    gen = torch.Generator().manual_seed(0)
    loss = torch.rand(16, 20, generator=gen)
    targets = torch.randint(0, 5, (16, 20), generator=gen)
    targets[torch.rand(16, 20, generator=gen) < 0.3] = X
    targets[3:6, 12:] = X
    targets[7] = X
    windows = position_windows(20, 6) + trailing_window(20, 5)
    metric = WindowedLoss(windows)
    metric.update(loss[:9], targets[:9])
    metric.update(loss[9:], targets[9:])
    expected = []
    for start, end in windows:
        total, count = 0.0, 0
        for row_loss, row_targets in zip(loss.tolist(), targets.tolist(), strict=False):
            real = [t for t, target in enumerate(row_targets) if target != X]
            if not real or real[-1] < end - 1:
                continue  # the sequence does not reach this window's end
            for t in range(start, end):
                if row_targets[t] != X:
                    total, count = total + row_loss[t], count + 1
        expected.append(total / count)
    torch.testing.assert_close(metric.compute(), torch.tensor(expected, dtype=torch.float64))


def test_token_mean_loss_weights_every_token_equally_and_keeps_nan():
    """Batches with 1 and 3 valid targets: the mean is over the 4 tokens, not over the 2 batch means."""
    metric = TokenMeanLoss()
    metric.update(torch.tensor([[1.0, 5.0]]), torch.tensor([[3, IGNORE_INDEX]]))
    metric.update(torch.tensor([[2.0, 2.0, 2.0]]), torch.tensor([[1, 2, 3]]))
    assert metric.compute().item() == pytest.approx((1.0 + 2.0 * 3) / 4)
    metric.update(torch.tensor([[float("nan")]]), torch.tensor([[4]]))
    assert math.isnan(metric.compute().item())


# Two sequences of 10 targets (target t predicts byte t + 1); bins [0, 3), [3, 5), [5, inf).
# Sequence 0: a 3-byte copy at byte 6 of byte 2 (distance 4): copy targets 5-7, source targets 1-3.
# Sequence 1: a copy at byte 7 of byte 1 (distance 6): targets 6-7 and 0-1; a copy at byte 9 of byte 3
# (distance 6) whose second byte is padding: only its first byte scores, copy target 8, source target 2.
REPEAT_LOSS = torch.tensor([
    [0.0, 1.0, 2.0, 3.0, 9.0, 0.5, 0.25, 0.75, 9.0, 9.0],
    [4.0, 2.0, 1.0, 3.0, 0.0, 0.0, 0.1, 0.3, 0.6, 99.0],
])
REPEAT_TARGETS = torch.tensor([[1] * 10, [1] * 9 + [X]])
REPEATS = [np.array([[6, 3, 2]]), np.array([[7, 2, 1], [9, 2, 3]])]


def test_hand_computed_repeat_losses():
    result = repeat_span_losses(REPEAT_LOSS, REPEAT_TARGETS, REPEATS, edges=(3, 5)).means()
    assert result["copy"] == pytest.approx((0.5 + 0.25 + 0.75 + 0.1 + 0.3 + 0.6) / 6)
    assert result["source"] == pytest.approx((1 + 2 + 3 + 4 + 2 + 1) / 6)
    assert result["gap"] == pytest.approx(13 / 6 - 2.5 / 6)
    assert result["count"] == 6
    assert list(result["bins"]) == [(0, 3), (3, 5), (5, None)]
    empty, near, far = result["bins"].values()
    assert math.isnan(empty["copy"]) and math.isnan(empty["source"]) and empty["count"] == 0
    assert (near["copy"], near["source"], near["count"]) == pytest.approx((0.5, 2.0, 3))
    assert (far["copy"], far["source"], far["count"]) == pytest.approx((1.0 / 3, 7.0 / 3, 3))


def test_repeat_losses_skip_first_bytes_and_add_up_over_batches():
    skipped = repeat_span_losses(REPEAT_LOSS, REPEAT_TARGETS, REPEATS, edges=(3, 5), skip=1).means()
    assert (skipped["copy"], skipped["source"], skipped["count"]) == pytest.approx(((0.25 + 0.75 + 0.3) / 3,
                                                                                  (2 + 3 + 2) / 3, 3))
    first = repeat_span_losses(REPEAT_LOSS[:1], REPEAT_TARGETS[:1], REPEATS[:1], edges=(3, 5))
    second = repeat_span_losses(REPEAT_LOSS[1:], REPEAT_TARGETS[1:], REPEATS[1:], edges=(3, 5))
    whole = repeat_span_losses(REPEAT_LOSS, REPEAT_TARGETS, REPEATS, edges=(3, 5))
    assert (first + second).means()["copy"] == pytest.approx(whole.means()["copy"])
    assert (first + second).means()["bins"][(5, None)]["source"] == pytest.approx(7.0 / 3)
    with pytest.raises(ValueError, match="distance edges"):
        first + repeat_span_losses(REPEAT_LOSS, REPEAT_TARGETS, REPEATS)


def test_a_distance_on_a_bin_edge_opens_the_next_bin():
    loss, targets = torch.ones(1, 10), torch.ones(1, 10, dtype=torch.long)
    bins = repeat_span_losses(loss, targets, [np.array([[5, 2, 2]])], edges=(3, 5)).means()["bins"]
    assert [summary["count"] for summary in bins.values()] == [0, 2, 0]
