"""Power-law fits of loss against compute, as in the MoBA paper's scaling figures.

    L(C) = a · C^b        (C in PFLOP/s-days, b < 0 when loss falls with compute)

is fitted by least squares in log-log space, ``log L = log a + b log C``, which is how
such laws are usually read off a log-log plot. Uncertainty comes from the fit's
covariance (standard errors of log a and b) and, optionally, a bootstrap over points.

torch is imported by the functions that compute with it, so that a command's ``--help`` (which imports
this module for :func:`pflops_days`) does not wait for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lit.training.statistics import t_975

if TYPE_CHECKING:
    import torch

PFLOP_S_DAY = 1e15 * 24 * 3600  # FLOPs in one PFLOP/s-day
def pflops_days(flops: float) -> float:
    return flops / PFLOP_S_DAY


@dataclass(frozen=True)
class PowerLaw:
    """``L = a · C^b`` with standard errors and, when bootstrapped, 95% intervals.

    Two points fit exactly: no error estimate (standard errors NaN, no intervals).
    """

    a: float
    b: float
    a_stderr: float  # of a, by the delta method on log a
    b_stderr: float
    n_points: int
    a_interval: tuple[float, float] | None = None
    b_interval: tuple[float, float] | None = None

    def __call__(self, compute):
        import torch

        return self.a * torch.as_tensor(compute, dtype=torch.float64) ** self.b

    def b_t_interval(self) -> tuple[float, float] | None:
        """95% interval of ``b`` from its standard error, t with ``n_points - 2`` degrees of freedom."""
        if self.n_points < 3:
            return None
        half = t_975(self.n_points - 2) * self.b_stderr
        return self.b - half, self.b + half

    def formula(self) -> str:
        """The paper's Table 3 form, e.g. ``1.546·C^-0.108``."""
        return f"{self.a:.3f}·C^{self.b:.3f}"


def _least_squares(log_c: torch.Tensor, log_l: torch.Tensor) -> tuple[float, float, float, float]:
    """(log a, b, se(log a), se(b)) of the line ``log_l = log a + b · log_c``."""
    import torch

    X = torch.stack([torch.ones_like(log_c), log_c], dim=1)
    coef = torch.linalg.lstsq(X, log_l[:, None]).solution[:, 0]
    n = len(log_c)
    if n <= 2:
        return float(coef[0]), float(coef[1]), float("nan"), float("nan")
    residual = log_l - X @ coef
    sigma2 = float(residual @ residual) / (n - 2)
    cov = sigma2 * torch.linalg.inv(X.T @ X)
    return float(coef[0]), float(coef[1]), math.sqrt(float(cov[0, 0])), math.sqrt(float(cov[1, 1]))


def fit_power_law(compute, loss, bootstrap: int = 0, seed: int = 0) -> PowerLaw:
    """Fit ``loss = a · compute^b`` to at least two points with positive values.

    Args:
        compute: training compute per point (any positive unit, e.g. PFLOP/s-days).
        loss: loss per point.
        bootstrap: resample the points this many times for 95% intervals of a and b.
    """
    import torch

    c = torch.as_tensor(compute, dtype=torch.float64).flatten()
    y = torch.as_tensor(loss, dtype=torch.float64).flatten()
    if c.numel() != y.numel():
        raise ValueError(f"compute and loss must have the same length, got {c.numel()} and {y.numel()}")
    if c.numel() < 2:
        raise ValueError(f"a power law needs at least 2 points, got {c.numel()}")
    if not (torch.isfinite(c).all() and torch.isfinite(y).all() and (c > 0).all() and (y > 0).all()):
        raise ValueError("compute and loss must be finite and positive to fit in log-log space")
    if torch.unique(c).numel() < 2:
        raise ValueError("compute must take at least 2 distinct values")
    log_c, log_l = c.log(), y.log()
    log_a, b, se_log_a, se_b = _least_squares(log_c, log_l)
    a = math.exp(log_a)
    a_interval = b_interval = None
    if bootstrap > 0 and c.numel() > 2:  # resampling two points only ever returns the same line
        a_interval, b_interval = _bootstrap_intervals(log_c, log_l, bootstrap, seed)
    return PowerLaw(a, b, a * se_log_a, se_b, c.numel(), a_interval, b_interval)


def _bootstrap_intervals(log_c, log_l, n_resamples: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    n = len(log_c)
    a_samples, b_samples = [], []
    for _ in range(n_resamples):
        idx = torch.randint(0, n, (n,), generator=gen)
        if torch.unique(log_c[idx]).numel() < 2:
            continue
        log_a, b, _, _ = _least_squares(log_c[idx], log_l[idx])
        a_samples.append(math.exp(log_a))
        b_samples.append(b)
    if not a_samples:
        return None, None

    def interval(samples):
        t = torch.tensor(samples, dtype=torch.float64)
        return float(t.quantile(0.025)), float(t.quantile(0.975))

    return interval(a_samples), interval(b_samples)


def crossover(first: PowerLaw, second: PowerLaw) -> float | None:
    """Compute where the two laws predict the same loss, or None if they never cross."""
    if math.isclose(first.b, second.b, rel_tol=0, abs_tol=1e-12):
        return None
    return math.exp((math.log(second.a) - math.log(first.a)) / (first.b - second.b))
