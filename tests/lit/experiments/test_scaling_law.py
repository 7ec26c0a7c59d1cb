"""The power-law fitter recovers known laws and reports honest uncertainty."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lit.experiments.scaling_law import PFLOP_S_DAY, crossover, fit_power_law, pflops_days


@given(a=st.floats(0.5, 5.0), b=st.floats(-0.3, -0.01), seed=st.integers(0, 1000))
def test_recovers_known_law_from_noisy_points(a, b, seed):
    gen = torch.Generator().manual_seed(seed)
    compute = torch.logspace(-4, 1, 12, dtype=torch.float64)
    noise = torch.exp(0.01 * torch.randn(12, generator=gen, dtype=torch.float64))
    law = fit_power_law(compute, a * compute**b * noise)
    assert abs(law.b - b) < 0.01
    assert abs(math.log(law.a) - math.log(a)) < 0.05
    assert 0 < law.b_stderr < 0.01


def test_exact_points_give_exact_law_and_paper_formula():
    compute = [1e-3, 1e-2, 1e-1, 1.0]
    law = fit_power_law(compute, [1.546 * c**-0.108 for c in compute])
    assert law.a == pytest.approx(1.546, rel=1e-9) and law.b == pytest.approx(-0.108, rel=1e-9)
    assert law.formula() == "1.546·C^-0.108"
    assert float(law(10.0)) == pytest.approx(1.546 * 10**-0.108)


def test_bootstrap_interval_contains_truth():
    gen = torch.Generator().manual_seed(3)
    compute = torch.logspace(-3, 0, 10, dtype=torch.float64)
    loss = 2.0 * compute**-0.07 * torch.exp(0.005 * torch.randn(10, generator=gen, dtype=torch.float64))
    law = fit_power_law(compute, loss, bootstrap=200)
    lo, hi = law.b_interval
    assert lo <= -0.07 <= hi and lo < law.b < hi
    assert law.a_interval[0] <= 2.0 <= law.a_interval[1]


def test_crossover_of_two_laws():
    moba = fit_power_law([1e-3, 1.0], [1.546 * c**-0.108 for c in (1e-3, 1.0)])
    full = fit_power_law([1e-3, 1.0], [1.464 * c**-0.097 for c in (1e-3, 1.0)])
    c_star = crossover(moba, full)
    assert float(moba(c_star)) == pytest.approx(float(full(c_star)), rel=1e-9)
    assert crossover(moba, moba) is None


def test_pflops_days():
    assert pflops_days(PFLOP_S_DAY) == 1.0
    assert pflops_days(8.64e19) == pytest.approx(1.0)


@pytest.mark.parametrize("compute, loss, words", [
    ([1.0], [1.0], "at least 2 points"),
    ([1.0, 2.0], [1.0], "same length"),
    ([1.0, -2.0], [1.0, 1.0], "positive"),
    ([1.0, 2.0], [1.0, float("nan")], "finite"),
    ([2.0, 2.0], [1.0, 3.0], "distinct"),
])
def test_bad_points(compute, loss, words):
    with pytest.raises(ValueError, match=words):
        fit_power_law(compute, loss)


def test_t_interval_uses_n_minus_2_degrees_of_freedom():
    # Four points with known residuals: the line through them and its standard error by hand.
    log_c = [0.0, 1.0, 2.0, 3.0]
    log_l = [0.0, -0.1 + 0.01, -0.2 - 0.01, -0.3]
    law = fit_power_law([math.exp(x) for x in log_c], [math.exp(y) for y in log_l])
    n, mean_x = 4, 1.5
    b = sum((x - mean_x) * y for x, y in zip(log_c, log_l, strict=True)) / sum((x - mean_x) ** 2 for x in log_c)
    intercept = sum(log_l) / n - b * mean_x
    rss = sum((y - intercept - b * x) ** 2 for x, y in zip(log_c, log_l, strict=True))
    se_b = math.sqrt(rss / (n - 2) / sum((x - mean_x) ** 2 for x in log_c))
    low, high = law.b_t_interval()
    assert law.b == pytest.approx(b) and law.b_stderr == pytest.approx(se_b)
    assert (low, high) == pytest.approx((b - 4.303 * se_b, b + 4.303 * se_b))  # t(0.975, 2 dof)


def test_two_points_fit_exactly_and_claim_no_uncertainty():
    law = fit_power_law([1e-3, 1e-2], [3.0, 2.9], bootstrap=100)
    assert math.isnan(law.b_stderr) and law.b_t_interval() is None
    assert law.a_interval is None and law.b_interval is None

