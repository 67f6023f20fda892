"""The canary's verdict: promote it to production, roll it back, or wait for more episodes.

The loop compares the episodes the canary answered with those production answered over the same period (since the
canary's deployment), each scored by the grader stack (and, when configured, by a feedback kind such as
``resolved``). Any canary episode that fails the safety grader rolls it back at once. Otherwise the canary must show
that it is not worse than production by more than ``max_drop`` (non-inferiority), on an interval, not a point
estimate: the difference of the two arms' KPI means (canary - production) with an unpaired percentile bootstrap
interval. It is decided only at a few numbers of scored canary episodes (``looks.schedule``: ``min_episodes``,
doubling, up to ``max_episodes``), each on the first that many canary episodes, at an equal share of ``alpha``:

- the interval's low end above ``-max_drop``: promoted;
- its high end below 0 (clearly worse than production), or still undecided at ``max_episodes``: rolled back;
- otherwise it waits for the next number.

Production needs ``min_production_episodes`` scored episodes too: without a production KPI a canary is never
promoted. So a canary that is worse than production by ``max_drop`` or more is promoted with probability at most
``alpha`` (up to the bootstrap's approximation: ``bench/gate_error.py`` measures it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from flywheel.loop.looks import non_inferior, reached, schedule
from flywheel.stats import bootstrap_difference, expanded_level

RESAMPLES = 4000


class CanaryPolicy(BaseModel):
    share: float = Field(0.1, gt=0, le=1)  # of production's episodes answered by the canary
    min_episodes: int = Field(50, ge=1)  # scored canary episodes before its first verdict
    min_production_episodes: int = Field(50, ge=1)  # scored production episodes in the same period
    max_episodes: int = Field(800, ge=1)  # scored canary episodes by which it is promoted or rolled back
    kpi: str | None = None  # a feedback kind (its values' mean per episode); None: the stack's reward
    max_drop: float = Field(0.05, ge=0)  # non-inferiority margin: how far below production's KPI mean it may be
    alpha: float = Field(0.05, gt=0, lt=0.5)  # chance of promoting a canary max_drop worse, over all its looks

    @model_validator(mode="after")
    def _ordered(self) -> CanaryPolicy:
        if self.max_episodes < self.min_episodes:
            raise ValueError(f"max_episodes ({self.max_episodes}) is below min_episodes ({self.min_episodes})")
        return self

    @property
    def looks(self) -> list[int]:
        return schedule(self.min_episodes, self.max_episodes)


class Scored(BaseModel):
    """One episode of an arm as the verdict sees it."""

    episode_id: str
    kpi: float | None  # None: no value yet (no feedback of that kind)
    safe: bool


class CanaryVerdict(BaseModel):
    action: Literal["wait", "promote", "rollback"]
    reason: str
    canary_episodes: int  # scored
    production_episodes: int
    canary_kpi: float | None  # means over the episodes the verdict used (all scored ones while it waits)
    production_kpi: float | None
    unsafe: list[str]  # canary episodes that failed the safety grader
    # canary - production: mean, and the bootstrap interval at the look's level in each tail (low, high)
    difference: tuple[float, float, float] | None = None
    look: int | None = None  # canary episodes the verdict was decided on (a point of the policy's schedule)
    level: float | None = None  # one-sided, of this look


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def verdict(canary: list[Scored], production: list[Scored], policy: CanaryPolicy, seed: int = 0) -> CanaryVerdict:
    """Decide on the episodes in the order given (oldest first): a look uses the first episodes of each arm."""
    c = [e.kpi for e in canary if e.kpi is not None]
    p = [e.kpi for e in production if e.kpi is not None]
    unsafe = [e.episode_id for e in canary if not e.safe]
    base = {"canary_episodes": len(c), "production_episodes": len(p), "canary_kpi": _mean(c),
            "production_kpi": _mean(p), "unsafe": unsafe}  # fmt: skip
    if unsafe:
        return CanaryVerdict(
            action="rollback", reason=f"{len(unsafe)} canary episode(s) failed the safety grader", **base
        )
    points = policy.looks
    n = reached(points, len(c))
    if n is None or len(p) < policy.min_production_episodes:
        return CanaryVerdict(
            action="wait",
            reason=f"{len(c)} of {policy.min_episodes} canary and {len(p)} of {policy.min_production_episodes} "
            "production episodes scored",
            **base,
        )
    # production's episodes of the same period: as many as the share gives it while the canary had n (all, if fewer)
    m = max(policy.min_production_episodes, round(n * (1 - policy.share) / policy.share)) if policy.share < 1 else n
    c, p = c[:n], p[:m]
    level = policy.alpha / len(points)
    low, high = bootstrap_difference(c, p, RESAMPLES, seed, alpha=expanded_level(level, min(len(c), len(p))))
    mean_c, mean_p = sum(c) / len(c), sum(p) / len(p)
    kpi = policy.kpi or "reward"
    said = (
        f"canary - production {kpi} {mean_c - mean_p:+.3f} [{low:+.3f}, {high:+.3f}] (canary {mean_c:.3f} over {n}, "
        f"production {mean_p:.3f} over {len(p)}; look {points.index(n) + 1} of {len(points)}, one-sided level "
        f"{level:.3g})"
    )
    base |= {"canary_kpi": mean_c, "production_kpi": mean_p, "difference": (mean_c - mean_p, low, high),
             "look": n, "level": level}  # fmt: skip
    passed, why = non_inferior(points, n, low, high, policy.max_drop)
    action = "wait" if passed is None else "promote" if passed else "rollback"
    return CanaryVerdict(action=action, reason=f"{said}: {why}", **base)
