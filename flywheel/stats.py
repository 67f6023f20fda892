"""Interval estimates shared by evaluation reports (``flywheel eval``, the calculator job) and the promotion gate."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

Z95 = statistics.NormalDist().inv_cdf(0.975)  # the normal quantile of a two-sided 95% interval


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion (95% by default); (0, 0) for no trials."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_mean(values: Sequence[float] | np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean of ``values`` (resampled with replacement; a fixed seed makes
    a report reproducible)."""
    values = np.asarray(values, dtype=float)
    draws = np.random.default_rng(seed).choice(values, size=(resamples, len(values))).mean(axis=1)
    low, high = np.quantile(draws, [0.025, 0.975])
    return float(low), float(high)
