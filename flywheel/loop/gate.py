"""The promotion gate: is a candidate better than production on a frozen held-out set, safe on all of it, and no
more costly than allowed?

Each policy's results are paired by held-out item (the same tickets, problems or prompts, each scored by the same
grader versions). The primary metric's lift is the mean of the per-item differences, with a percentile bootstrap
95% interval over items (fixed seed: a report is reproducible). Promotion needs all of:

- lift: the interval's lower bound above ``min_lift`` (0 by default: better, not merely not worse);
- safety: the candidate passed the safety grader on every held-out item (no tolerance; it is a gate, not a score);
- efficiency: mean tokens, tool calls and latency no more than the configured share above production's;
- enough items: an interval over a handful of items says little.

A check that fails says by how much, so that the audit event recording the decision explains it.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, field_validator

from flywheel.stats import bootstrap_mean

EFFICIENCY = {"tokens", "tool_calls", "latency_ms"}  # metrics that must not grow past a limit


class HeldOutSet(BaseModel):
    """A frozen evaluation set: its items (whatever the agent is given) under stable ids. ``version`` is a content
    hash, so a changed set is a new version and results on different versions are never paired."""

    name: str
    items: dict[str, dict[str, Any]]  # item id -> the item (what the agent is given)

    @property
    def version(self) -> str:
        canonical = json.dumps(self.items, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(f"{self.name}\n{canonical}".encode()).hexdigest()[:16]


class ItemResult(BaseModel):
    """One policy's result on one held-out item (the mean of its episodes there, when it ran several)."""

    item: str
    score: float  # the primary metric
    safe: bool  # the safety grader passed on every episode of the item
    tokens: float = 0.0  # per episode: completion tokens
    tool_calls: float = 0.0
    latency_ms: float = 0.0

    @field_validator("score", "tokens", "tool_calls", "latency_ms")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value


class GatePolicy(BaseModel):
    """When a candidate may be promoted. Efficiency limits are relative: 0.10 = at most 10% above production."""

    min_lift: float = 0.0
    min_items: int = Field(20, ge=2)
    resamples: int = Field(10_000, ge=100)
    seed: int = 0
    max_increase: dict[str, float] = Field(
        default_factory=lambda: {"tokens": 0.25, "tool_calls": 0.25, "latency_ms": 0.5}
    )

    @field_validator("max_increase")
    @classmethod
    def _known_metrics(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = set(value) - EFFICIENCY
        if unknown:
            raise ValueError(f"unknown efficiency metric(s) {sorted(unknown)}; known: {sorted(EFFICIENCY)}")
        return value


class Check(BaseModel):
    name: str  # lift | safety | items | tokens | tool_calls | latency_ms
    passed: bool
    detail: str


class Lift(BaseModel):
    """The candidate's primary metric minus production's, per item, averaged; with its bootstrap 95% interval."""

    mean: float
    low: float
    high: float
    candidate: float  # each side's mean, for the record
    production: float


class GateDecision(BaseModel):
    promote: bool
    items: int
    lift: Lift
    checks: list[Check]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]


class GateInputError(ValueError):
    """The two sides' results cannot be paired (other items, duplicates): no decision can be made from them."""


def _paired(candidate: list[ItemResult], production: list[ItemResult]) -> list[tuple[ItemResult, ItemResult]]:
    sides = {}
    for side, results in (("candidate", candidate), ("production", production)):
        by_item = {r.item: r for r in results}
        if len(by_item) != len(results):
            twice = sorted({r.item for r in results if sum(s.item == r.item for s in results) > 1})
            raise GateInputError(f"the {side}'s results name item(s) {twice[:5]} more than once")
        sides[side] = by_item
    only_c, only_p = sides["candidate"].keys() - sides["production"], sides["production"].keys() - sides["candidate"]
    if only_c or only_p:
        raise GateInputError(
            "the two sides were not run on the same held-out items: "
            f"{len(only_c)} only in the candidate's ({sorted(only_c)[:5]}), "
            f"{len(only_p)} only in production's ({sorted(only_p)[:5]})"
        )
    return [(sides["candidate"][k], sides["production"][k]) for k in sorted(sides["candidate"])]


def decide(candidate: list[ItemResult], production: list[ItemResult], policy: GatePolicy | None = None) -> GateDecision:
    """Compare a candidate with production on the same held-out items; promote only if every check passes."""
    policy = policy or GatePolicy()
    pairs = _paired(candidate, production)
    if not pairs:
        raise GateInputError("no held-out results to compare")
    c = np.array([a.score for a, _ in pairs])
    p = np.array([b.score for _, b in pairs])
    low, high = bootstrap_mean(c - p, policy.resamples, policy.seed)  # resampling items: the pairs stay together
    lift = Lift(mean=float((c - p).mean()), low=low, high=high, candidate=float(c.mean()), production=float(p.mean()))
    checks = [
        Check(
            name="items",
            passed=len(pairs) >= policy.min_items,
            detail=f"{len(pairs)} held-out items (at least {policy.min_items} needed)",
        ),
        Check(
            name="lift",
            passed=low > policy.min_lift,
            detail=f"lift {lift.mean:+.4f}, 95% interval [{low:+.4f}, {high:+.4f}]; its lower bound must exceed "
            f"{policy.min_lift:+.4f}",
        ),
    ]
    unsafe = [a.item for a, _ in pairs if not a.safe]
    checks.append(
        Check(
            name="safety",
            passed=not unsafe,
            detail=f"the candidate failed the safety grader on {len(unsafe)} of {len(pairs)} items"
            + (f": {unsafe[:5]}" if unsafe else ""),
        )
    )
    for metric, limit in policy.max_increase.items():
        mean_c = float(np.mean([getattr(a, metric) for a, _ in pairs]))
        mean_p = float(np.mean([getattr(b, metric) for _, b in pairs]))
        increase = (mean_c - mean_p) / mean_p if mean_p > 0 else (0.0 if mean_c <= 0 else math.inf)
        checks.append(
            Check(
                name=metric,
                passed=increase <= limit,
                detail=f"{metric} {mean_c:.4g} vs production's {mean_p:.4g} ({increase:+.1%}; at most {limit:+.0%})",
            )
        )
    return GateDecision(promote=all(ch.passed for ch in checks), items=len(pairs), lift=lift, checks=checks)
