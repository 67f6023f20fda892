"""The canary's verdict: promote it to production, roll it back, or wait for more episodes.

The loop compares the episodes the canary answered with those production answered over the same period (since the
canary's deployment), each scored by the grader stack (and, when configured, by a feedback kind such as
``resolved``). Any canary episode that fails the safety grader rolls it back at once. Otherwise, once the canary has
``min_episodes`` scored episodes, it is promoted unless its KPI mean is more than ``max_drop`` below production's,
in which case it is rolled back.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class CanaryPolicy(BaseModel):
    share: float = Field(0.1, gt=0, le=1)  # of production's episodes answered by the canary
    min_episodes: int = Field(20, ge=1)  # scored canary episodes before a promotion
    kpi: str | None = None  # a feedback kind (its values' mean per episode); None: the stack's reward
    max_drop: float = Field(0.05, ge=0)  # how far below production's KPI mean the canary's may be


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
    canary_kpi: float | None
    production_kpi: float | None
    unsafe: list[str]  # canary episodes that failed the safety grader


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def verdict(canary: list[Scored], production: list[Scored], policy: CanaryPolicy) -> CanaryVerdict:
    c = [e.kpi for e in canary if e.kpi is not None]
    p = [e.kpi for e in production if e.kpi is not None]
    unsafe = [e.episode_id for e in canary if not e.safe]
    base = {"canary_episodes": len(c), "production_episodes": len(p), "canary_kpi": _mean(c),
            "production_kpi": _mean(p), "unsafe": unsafe}  # fmt: skip
    if unsafe:
        return CanaryVerdict(
            action="rollback", reason=f"{len(unsafe)} canary episode(s) failed the safety grader", **base
        )
    if len(c) < policy.min_episodes:
        return CanaryVerdict(action="wait", reason=f"{len(c)} of {policy.min_episodes} canary episodes scored", **base)
    kpi = policy.kpi or "reward"
    if p and _mean(c) < _mean(p) - policy.max_drop:
        return CanaryVerdict(
            action="rollback",
            reason=f"canary {kpi} {_mean(c):.3f} is more than {policy.max_drop:g} below production's {_mean(p):.3f}",
            **base,
        )
    against = f"production's {_mean(p):.3f}" if p else "no production episodes to compare"
    return CanaryVerdict(
        action="promote", reason=f"canary {kpi} {_mean(c):.3f} over {len(c)} episodes ({against})", **base
    )
