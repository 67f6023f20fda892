"""Interval estimates shared by evaluation reports (``flywheel eval``, the calculator job) and the promotion gate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bootstrap_mean(values: Sequence[float] | np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean of ``values`` (resampled with replacement; a fixed seed makes
    a report reproducible)."""
    values = np.asarray(values, dtype=float)
    draws = np.random.default_rng(seed).choice(values, size=(resamples, len(values))).mean(axis=1)
    low, high = np.quantile(draws, [0.025, 0.975])
    return float(low), float(high)
