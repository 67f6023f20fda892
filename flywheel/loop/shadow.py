"""The shadow stage's verdict: a candidate that passed the gate answers a share of live requests beside production
(``MODEL@shadow``: the gateway mirrors the calls after the user's answer and records them in linked shadow
episodes, ``gateway/traffic.py``), its answers never returned; then it goes to canary, or is stopped.

The loop pairs each shadow episode with its production original (the same inputs: the original is finished and
the shadow answered its last call, the same messages) and scores both answers with the grader stack. Any shadow
answer that fails the safety grader stops it at once. Otherwise, once ``min_pairs`` pairs are scored, it goes to
canary unless the mean of the paired differences (shadow - production) is more than ``max_drop`` below zero, in
which case it is stopped. The verdict carries its evidence: the pairs, both means, and a bootstrap 95% interval on
the paired difference.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from flywheel.stats import bootstrap_mean

RESAMPLES = 2000
MAX_LISTED = 200  # episode ids an audit event lists


class ShadowPolicy(BaseModel):
    share: float = Field(0.1, gt=0, le=1)  # of production's episodes whose calls are mirrored to the shadow
    min_pairs: int = Field(20, ge=1)  # shadow episodes scored against their originals before it goes to canary
    max_drop: float = Field(0.05, ge=0)  # how far below production's the shadow's paired mean reward may be


class Pair(BaseModel):
    """A shadow episode and its production original, answered on the same inputs, scored by one stack."""

    shadow: str
    production: str
    shadow_reward: float
    production_reward: float
    safe: bool  # the shadow's answer passed the safety grader


class ShadowVerdict(BaseModel):
    action: Literal["wait", "canary", "stop"]
    reason: str
    pairs: int
    shadow_reward: float | None  # means over the pairs
    production_reward: float | None
    difference: tuple[float, float, float] | None  # shadow - production: mean, bootstrap 95% interval (low, high)
    unsafe: list[str]  # shadow episodes that failed the safety grader
    episodes: list[str]  # the pairs' shadow episodes (the first MAX_LISTED)


def verdict(pairs: list[Pair], policy: ShadowPolicy, seed: int = 0) -> ShadowVerdict:
    unsafe = [p.shadow for p in pairs if not p.safe]
    n = len(pairs)
    diffs = [p.shadow_reward - p.production_reward for p in pairs]
    difference = (sum(diffs) / n, *bootstrap_mean(diffs, RESAMPLES, seed)) if n else None
    base = {
        "pairs": n, "unsafe": unsafe, "episodes": [p.shadow for p in pairs][:MAX_LISTED], "difference": difference,
        "shadow_reward": sum(p.shadow_reward for p in pairs) / n if n else None,
        "production_reward": sum(p.production_reward for p in pairs) / n if n else None,
    }  # fmt: skip
    if unsafe:
        return ShadowVerdict(action="stop", reason=f"{len(unsafe)} shadow answer(s) failed the safety grader", **base)
    if difference is None or n < policy.min_pairs:
        return ShadowVerdict(action="wait", reason=f"{n} of {policy.min_pairs} shadow episodes paired", **base)
    mean, low, high = difference
    said = f"shadow - production reward {mean:+.3f} [{low:+.3f}, {high:+.3f}] over {n} paired episodes"
    if mean < -policy.max_drop:
        return ShadowVerdict(action="stop", reason=f"{said}: more than {policy.max_drop:g} below", **base)
    return ShadowVerdict(action="canary", reason=said, **base)
