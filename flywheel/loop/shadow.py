"""The shadow stage's verdict: a candidate that passed the gate answers a share of live requests beside production
(``MODEL@shadow``: the gateway mirrors the calls after the user's answer and records them in linked shadow
episodes, ``gateway/traffic.py``), its answers never returned; then it goes to canary, or is stopped.

The loop pairs each shadow episode with its production original (the same inputs: the original is finished and
the shadow answered its last call, the same messages) and scores both answers with the grader stack. Any shadow
answer that fails the safety grader stops it at once. Otherwise it must show, on an interval, that it is not worse
than production by more than ``max_drop``: the mean of the paired differences (shadow - production) with a percentile
bootstrap interval, decided only at a few numbers of pairs (``looks.schedule``: ``min_pairs``, doubling, up to
``max_pairs``), each on the first that many pairs (oldest first), at an equal share of ``alpha``. The interval's low
end above ``-max_drop``: it goes to canary; its high end below 0 (clearly worse), or still undecided at ``max_pairs``:
stopped; otherwise it waits. The verdict carries its evidence: the pairs, both means, the interval and the look.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from flywheel.loop.looks import non_inferior, reached, schedule
from flywheel.stats import mean_interval

RESAMPLES = 4000
MAX_LISTED = 200  # episode ids an audit event lists


class ShadowPolicy(BaseModel):
    share: float = Field(0.1, gt=0, le=1)  # of production's episodes whose calls are mirrored to the shadow
    min_pairs: int = Field(50, ge=1)  # shadow episodes scored against their originals before its first verdict
    max_pairs: int = Field(800, ge=1)  # pairs by which it goes to canary or is stopped
    max_drop: float = Field(0.05, ge=0)  # non-inferiority margin: how far below production's its paired mean may be
    alpha: float = Field(0.05, gt=0, lt=0.5)  # chance of passing a shadow max_drop worse, over all its looks

    @model_validator(mode="after")
    def _ordered(self) -> ShadowPolicy:
        if self.max_pairs < self.min_pairs:
            raise ValueError(f"max_pairs ({self.max_pairs}) is below min_pairs ({self.min_pairs})")
        return self

    @property
    def looks(self) -> list[int]:
        return schedule(self.min_pairs, self.max_pairs)


class Pair(BaseModel):
    """A shadow episode and its production original, answered on the same inputs, scored by one stack."""

    shadow: str
    production: str
    shadow_reward: float
    production_reward: float
    safe: bool  # the shadow's answer passed the safety grader
    created_at: datetime | None = None  # the shadow episode's: pairs are looked at oldest first


class ShadowVerdict(BaseModel):
    action: Literal["wait", "canary", "stop"]
    reason: str
    pairs: int
    shadow_reward: float | None  # means over the pairs
    production_reward: float | None
    # shadow - production: mean, and the bootstrap interval at the look's level in each tail (low, high)
    difference: tuple[float, float, float] | None
    unsafe: list[str]  # shadow episodes that failed the safety grader
    episodes: list[str]  # the pairs' shadow episodes (the first MAX_LISTED)
    look: int | None = None  # pairs the verdict was decided on (a point of the policy's schedule)
    level: float | None = None  # one-sided, of this look


def verdict(pairs: list[Pair], policy: ShadowPolicy, seed: int = 0) -> ShadowVerdict:
    unsafe = [p.shadow for p in pairs if not p.safe]
    # oldest first (pairs without a time keep their order, after those with one): a look uses the first n
    pairs = sorted(pairs, key=lambda p: (p.created_at is None, p.created_at or datetime.min))
    points = policy.looks
    n = reached(points, len(pairs))
    used = pairs[:n] if n else pairs
    diffs = [p.shadow_reward - p.production_reward for p in used]
    base = {
        "pairs": len(pairs), "unsafe": unsafe, "episodes": [p.shadow for p in used][:MAX_LISTED],
        "difference": None, "look": n,
        "shadow_reward": sum(p.shadow_reward for p in used) / len(used) if used else None,
        "production_reward": sum(p.production_reward for p in used) / len(used) if used else None,
    }  # fmt: skip
    if unsafe:
        return ShadowVerdict(action="stop", reason=f"{len(unsafe)} shadow answer(s) failed the safety grader", **base)
    if n is None:
        return ShadowVerdict(action="wait", reason=f"{len(pairs)} of {policy.min_pairs} shadow episodes paired", **base)
    level = policy.alpha / len(points)
    mean = sum(diffs) / n
    low, high = mean_interval(diffs, RESAMPLES, seed, level)
    base |= {"difference": (mean, low, high), "level": level}
    said = (
        f"shadow - production reward {mean:+.3f} [{low:+.3f}, {high:+.3f}] over the first {n} of {len(pairs)} paired"
        f" episodes (look {points.index(n) + 1} of {len(points)}, one-sided level {level:.3g})"
    )
    passed, why = non_inferior(points, n, low, high, policy.max_drop)
    action = "wait" if passed is None else "canary" if passed else "stop"
    return ShadowVerdict(action=action, reason=f"{said}: {why}", **base)
