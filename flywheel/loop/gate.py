"""The promotion gate: is a candidate better than production on a frozen held-out set, safe on all of it, and no
more costly than allowed?

Each policy's results are paired by held-out item (the same tickets, problems or prompts, each scored by the same
grader versions). The primary metric's lift is the mean of the per-item differences, with an interval over items
(``stats.mean_interval``: an expanded percentile bootstrap with a fixed seed, so a report is reproducible, or
Student's t where a look's tail is too deep for the resamples). The primary metric is the stack's reward, 0 where an
attempt failed the safety grader (what the policy is trained on); the reward grader's own scores give the task
metric's lift beside it (``task_lift``), so that a candidate that games the task shows both. Promotion needs all of:

- lift: the interval's lower bound, at the look's one-sided level (``levels``: the loop looks again and again, so
  each look spends part of a lifetime error budget, ``looks.py``), above ``min_lift`` (0.02 by default: better by
  something, not merely not worse); with ``confirm``, again on a fresh evaluation of both sides (``confirmed``);
- safety: the candidate passed the safety grader on every held-out item, every attempt finished (no tolerance; it
  is a gate, not a score); a stack without a safety grader promotes nothing unless ``require_safety`` is off;
- failures: each side's attempts that did not finish at most ``max_failure_rate`` of its attempts;
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
from pydantic import BaseModel, Field, field_validator, model_validator

from flywheel.loop.looks import look_budget
from flywheel.stats import Interval, mean_interval

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
    """One policy's result on one held-out item over its ``attempts`` (the episodes it was to run there). Every
    attempt counts: one that did not finish (a crash, a timeout) scores 0 and is not safe, so missing evidence never
    reads as good evidence. The costs are per finished attempt (0 when none finished)."""

    item: str
    score: float  # the primary metric: the mean over all attempts (the stack's reward: 0 where unsafe)
    # the reward grader's own score, unsafe attempts not zeroed (None: not known): what the task metric alone says
    task_score: float | None = None
    safe: bool  # every attempt finished and passed the safety grader (without one, ``safety_checked``: finished)
    attempts: int = Field(1, ge=1)
    failures: int = Field(0, ge=0)  # attempts that did not finish
    safety_checked: bool = True  # False: the grader stack had no safety grader
    tokens: float = 0.0  # per finished episode: completion tokens
    tool_calls: float = 0.0
    latency_ms: float = 0.0

    @field_validator("score", "task_score", "tokens", "tool_calls", "latency_ms")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value

    @model_validator(mode="after")
    def _failures_of_attempts(self) -> ItemResult:
        if self.failures > self.attempts:
            raise ValueError(f"item {self.item}: {self.failures} failures of only {self.attempts} attempts")
        return self


class GatePolicy(BaseModel):
    """When a candidate may be promoted. Efficiency limits are relative: 0.10 = at most 10% above production.

    The lift check is a one-sided test of "lift > ``min_lift``" on a percentile bootstrap over items. The loop looks
    again every ``candidate_every`` steps, so each look spends part of ``lifetime_alpha`` (``looks.look_budget``:
    the chance, over all the looks since production last changed, of promoting a candidate that is no better).
    With ``confirm``, a look screens at ``alpha`` and a candidate that passes is evaluated again on fresh samples
    (both sides), which must pass at the look's budget divided by ``alpha``; without it, the look itself tests at its
    budget (more items are needed for the same power)."""

    min_lift: float = 0.02  # positive: a candidate must be better by something, not merely not worse
    alpha: float = Field(0.025, gt=0, lt=0.5)  # one-sided level of a look's screening test
    lifetime_alpha: float = Field(0.05, gt=0, lt=1)  # false promotions over all looks since production changed
    planned_looks: int = Field(25, ge=1)  # looks the budget is spread over evenly (later ones share a reserve)
    confirm: bool = True  # a candidate that passes is evaluated again on fresh samples before it is deployed
    min_items: int = Field(20, ge=2)
    # the share of each side's held-out attempts that may fail to finish: beyond it the evidence is missing
    max_failure_rate: float = Field(0.05, ge=0, le=1)
    # False: a grader stack without a safety grader may promote (the evidence then says "safety not checked")
    require_safety: bool = True
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
    name: str  # lift | safety | failures | items | tokens | tool_calls | latency_ms
    passed: bool
    detail: str


class Lift(Interval):
    """The candidate's primary metric minus production's, per item, averaged (``mean``); with its bootstrap
    interval, ``level`` in each tail (0.025: a 95% interval)."""

    candidate: float  # each side's mean, for the record
    production: float
    level: float = 0.025


class GateDecision(BaseModel):
    promote: bool
    items: int
    lift: Lift
    checks: list[Check]
    # the same on the reward grader's own scores (unsafe attempts not zeroed), where both sides have them: a
    # candidate that games the task metric shows here a lift that its unsafe items take back in ``lift``
    task_lift: Lift | None = None
    look: int = 1  # since production last changed (``decide_look``)
    needs_confirmation: bool = False  # the screen passed: a fresh evaluation decides (``decide_look`` with ``again``)
    confirmation: GateDecision | None = None  # that fresh evaluation's decision, at the confirming level

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


def levels(policy: GatePolicy, look: int) -> tuple[float, float | None]:
    """The one-sided levels of look ``look``'s lift tests: the screen's, and the confirmation's (None without one).
    Under a candidate no better than production, with independent evaluations, the look promotes with probability
    at most their product: the look's budget (``looks.look_budget``)."""
    budget = look_budget(policy.lifetime_alpha, policy.planned_looks, look)
    if not policy.confirm:
        return min(policy.alpha, budget), None
    return policy.alpha, min(0.5, budget / policy.alpha)


def decide(
    candidate: list[ItemResult],
    production: list[ItemResult],
    policy: GatePolicy | None = None,
    *,
    level: float | None = None,
) -> GateDecision:
    """Compare a candidate with production on the same held-out items; promote only if every check passes. The lift
    is tested one-sided at ``level`` (default: the policy's ``alpha``; the loop passes a look's, ``levels``)."""
    policy = policy or GatePolicy()
    level = policy.alpha if level is None else level
    pairs = _paired(candidate, production)
    if not pairs:
        raise GateInputError("no held-out results to compare")
    lift = _lift([a.score for a, _ in pairs], [b.score for _, b in pairs], policy, level)
    task_lift = None
    if all(a.task_score is not None and b.task_score is not None for a, b in pairs):
        task_lift = _lift([a.task_score for a, _ in pairs], [b.task_score for _, b in pairs], policy, level)
    task = ""
    if task_lift is not None and task_lift.mean != lift.mean:
        task = (
            f"; on the task metric alone (the reward grader's scores, unsafe attempts not zeroed) the lift is "
            f"{task_lift.mean:+.4f} [{task_lift.low:+.4f}, {task_lift.high:+.4f}]"
        )
    checks = [
        Check(
            name="items",
            passed=len(pairs) >= policy.min_items,
            detail=f"{len(pairs)} held-out items (at least {policy.min_items} needed)",
        ),
        Check(
            name="lift",
            passed=lift.low > policy.min_lift,
            detail=f"lift {lift.mean:+.4f}, {1 - 2 * level:.2%} interval [{lift.low:+.4f}, {lift.high:+.4f}]; its "
            f"lower bound (one-sided level {level:.3g}) must exceed {policy.min_lift:+.4f}{task}",
        ),
    ]
    checks += [_safety(pairs, policy), _failures(pairs, policy)]
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
    return GateDecision(
        promote=all(ch.passed for ch in checks), items=len(pairs), lift=lift, checks=checks, task_lift=task_lift
    )


def _lift(candidate: list[float], production: list[float], policy: GatePolicy, level: float) -> Lift:
    """The paired lift and its interval, resampling items (the pairs stay together): an expanded percentile
    interval (``stats.mean_interval``)."""
    c, p = np.array(candidate), np.array(production)
    low, high = mean_interval(c - p, policy.resamples, policy.seed, level)
    return Lift(
        mean=float((c - p).mean()), low=low, high=high, candidate=float(c.mean()), production=float(p.mean()),
        level=level,
    )  # fmt: skip


def _safety(pairs: list[tuple[ItemResult, ItemResult]], policy: GatePolicy) -> Check:
    """The candidate safe on every item: each attempt finished and passed the safety grader. A stack without one
    checks nothing: that holds the candidate unless ``require_safety`` is off, and the detail says so either way."""
    unsafe = [a.item for a, _ in pairs if not a.safe]
    unfinished = sum(1 for a, _ in pairs if not a.safe and a.failures)
    listed = f": {unsafe[:5]}" if unsafe else ""
    if unfinished:
        listed = f" ({unfinished} of them with attempts that did not finish){listed}"
    if all(a.safety_checked for a, _ in pairs):
        detail = f"the candidate failed the safety grader on {len(unsafe)} of {len(pairs)} items{listed}"
        return Check(name="safety", passed=not unsafe, detail=detail)
    detail = "safety not checked: the grader stack has no safety grader; " + (
        "no promotion without one (gate.require_safety: false promotes unchecked)"
        if policy.require_safety
        else "gate.require_safety is off"
    )
    if unsafe:
        detail += f"; {len(unsafe)} of {len(pairs)} items not safe{listed}"
    return Check(name="safety", passed=not policy.require_safety and not unsafe, detail=detail)


def _failures(pairs: list[tuple[ItemResult, ItemResult]], policy: GatePolicy) -> Check:
    """Each side's share of attempts that did not finish, within ``max_failure_rate``: past it, that side's
    evidence is missing (and a side scored 0 on what it could not run would make the other look better)."""
    limit, parts, passed = policy.max_failure_rate, [], True
    for side, results in (("the candidate's", [a for a, _ in pairs]), ("production's", [b for _, b in pairs])):
        failures, attempts = sum(r.failures for r in results), sum(r.attempts for r in results)
        rate = failures / attempts
        over = f", {(rate - limit) * 100:.1f} points over" if rate > limit else ""
        parts.append(f"{side} {failures} of {attempts} attempts ({rate:.1%}{over})")
        passed = passed and rate <= limit
    return Check(
        name="failures",
        passed=passed,
        detail=f"attempts that did not finish: {', '.join(parts)}; at most {limit:.1%} each",
    )


Results = tuple[list[ItemResult], list[ItemResult]]  # a held-out evaluation of both sides: (candidate, production)


def decide_look(
    policy: GatePolicy, look: int, first: Results, again: Results | None = None, *, deterministic: bool = False
) -> GateDecision:
    """The gate's decision at the loop's ``look``-th look since production changed, on the evaluation ``first``.

    Without ``confirm``, the look tests at its budget. With it, ``first`` is a screen at ``alpha``; one that passes
    ``needs_confirmation`` (it does not promote) until ``again``, a fresh evaluation of both sides, passes at the
    confirming level. A ``deterministic`` evaluation (both sides greedy: ``HeldOutRun.greedy``), or an ``again``
    identical to ``first`` item by item, has no fresh evidence to give: the look then decides ``first`` at its
    budget alone, as without ``confirm`` (passing a screen and a repeat of it is passing the stricter of the two)."""
    screen_level, confirm_level = levels(policy, look)
    screen = decide(*first, policy, level=screen_level).model_copy(update={"look": look})
    if confirm_level is None or not screen.promote:
        return screen
    if deterministic or (again is not None and _scores(first) == _scores(again)):
        budget = look_budget(policy.lifetime_alpha, policy.planned_looks, look)
        alone = decide(*first, policy, level=budget).model_copy(update={"look": look})
        why = (
            "both sides were evaluated greedily (every call at temperature 0): a fresh evaluation would repeat it"
            if deterministic
            else "the fresh evaluation gave the same scores item by item (a deterministic evaluation)"
        )
        check = Check(
            name="confirmation", passed=True,
            detail=f"{why}: no new evidence, so the look decided at its budget alone (one-sided level {budget:.3g})",
        )  # fmt: skip
        return alone.model_copy(update={"checks": [*alone.checks, check]})
    if again is None:
        pending = Check(
            name="confirmation", passed=False,
            detail=f"pending: a fresh evaluation of both sides must pass at one-sided level {confirm_level:.3g}",
        )  # fmt: skip
        return screen.model_copy(update={"promote": False, "checks": [*screen.checks, pending],
                                         "needs_confirmation": True})  # fmt: skip
    confirmation = decide(*again, policy, level=confirm_level).model_copy(update={"look": look})
    check = Check(
        name="confirmation",
        passed=confirmation.promote,
        detail=f"a fresh evaluation of both sides: lift {confirmation.lift.mean:+.4f}, lower bound "
        f"{confirmation.lift.low:+.4f} at one-sided level {confirm_level:.3g}"
        + (f"; failed {', '.join(c.name for c in confirmation.failed)}" if confirmation.failed else ""),
    )
    return screen.model_copy(
        update={"promote": confirmation.promote, "checks": [*screen.checks, check], "confirmation": confirmation}
    )


def _scores(results: Results) -> list[list[tuple[str, float]]]:
    return [sorted((r.item, r.score) for r in side) for side in results]
