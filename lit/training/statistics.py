"""The statistics every experiment reports: means with sample standard deviations and 95% Student's t
intervals (intervals from resampling stay with the quantity they resample)."""

from __future__ import annotations

import math

__all__ = ["T_975", "mean_interval", "mean_std", "t_975"]

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t_975(dof: int) -> float:
    """Student's t 0.975 quantile; past the table, the Cornish-Fisher expansion (within 0.01)."""
    if dof < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {dof}")
    z = 1.959964
    return T_975.get(dof, z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2))


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``None`` for a single value)."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))  # NaN-safe, unlike stdev


def mean_interval(values: list[float]) -> dict:
    """Mean and 95% t interval (None with fewer than two values)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "n": n}
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_975(n - 1) * std / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}
