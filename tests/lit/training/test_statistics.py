"""The statistics the experiments report: Student's t quantiles, means with standard deviations and t intervals."""

from __future__ import annotations

import math
import statistics

import pytest

from lit.training.statistics import mean_interval, mean_std, t_975


def test_t_quantile_past_the_table():
    assert t_975(10) == 2.228
    assert t_975(30) == pytest.approx(2.042, abs=0.002) and t_975(1000) == pytest.approx(1.962, abs=0.001)
    with pytest.raises(ValueError, match="degree of freedom"):
        t_975(0)


def test_the_interval_is_students_t():
    values = [1.0, 1.5, 0.7, 1.2]
    entry = mean_interval(values)
    half = 3.182 * statistics.stdev(values) / math.sqrt(4)  # t(0.975, 3 dof)
    mean = statistics.mean(values)
    assert (entry["low"], entry["high"]) == pytest.approx((mean - half, mean + half), abs=1e-3)


def test_mean_std_is_the_sample_standard_deviation_and_none_for_one_value():
    assert mean_std([2.0]) == (2.0, None)
    mean, std = mean_std([1.0, 2.0, 4.0])
    assert mean == pytest.approx(7 / 3) and std == pytest.approx(statistics.stdev([1.0, 2.0, 4.0]))
