"""How well graders agree with human labels (``flywheel review agreement``): per grader name and stack version,
on the episodes reviewers labelled (``flywheel.store.reviews``).

A grade passes at or above its pass mark (the stack's ``safety_pass`` for its safety gate, else ``threshold``); a
human label passes likewise (a pass/fail label is 1 or 0). Reported per grader: ``n``, agreement (the share of
episodes where grader and human both pass or both fail), precision and recall of the grader's passes against the
human's (how often a pass is one a person would give, and how many of those it gives), each with a Wilson 95%
interval; Cohen's kappa (agreement beyond what the two pass rates give by chance) with a percentile bootstrap 95%
interval from ``MIN_BOOTSTRAP`` labels on; Pearson's correlation of score and label (a Fisher-z interval from 4
labels on) and their mean absolute difference. A value that cannot be had from the labels (a precision with no
grader pass, a kappa when everything passes) is None, not a guess.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

from pydantic import BaseModel

from flywheel import stats
from flywheel.store.reviews import LabelledGrade

MIN_BOOTSTRAP = 10  # labels before kappa gets an interval
RESAMPLES = 2000


class Estimate(BaseModel):
    value: float | None
    low: float | None = None  # its 95% interval, when the labels allow one
    high: float | None = None


class GraderAgreement(BaseModel):
    stack: str
    version: str
    component: str  # reward | safety | holdout/<name>
    grader: str
    pass_mark: float
    n: int
    human_passes: int
    grader_passes: int
    agreement: Estimate
    precision: Estimate  # of the grader's passes, the share the human passed too
    recall: Estimate  # of the human's passes, the share the grader passed too
    kappa: Estimate
    correlation: Estimate  # Pearson's r, score against label
    mean_abs_diff: float


def proportion(successes: int, n: int) -> Estimate:
    """A proportion with its Wilson score 95% interval (fit for small n and proportions near 0 or 1)."""
    if n == 0:
        return Estimate(value=None)
    low, high = stats.wilson(successes, n)
    return Estimate(value=successes / n, low=low, high=high)


def cohen_kappa(pairs: list[tuple[bool, bool]]) -> float | None:
    """Cohen's kappa of two pass/fail raters; None when chance agreement is total (both always say one thing)."""
    n = len(pairs)
    observed = sum(a == b for a, b in pairs) / n
    pa, pb = sum(a for a, _ in pairs) / n, sum(b for _, b in pairs) / n
    chance = pa * pb + (1 - pa) * (1 - pb)
    return None if chance >= 1 else (observed - chance) / (1 - chance)


def kappa_estimate(pairs: list[tuple[bool, bool]], seed: int) -> Estimate:
    value = cohen_kappa(pairs)
    if value is None or len(pairs) < MIN_BOOTSTRAP:
        return Estimate(value=value)
    rng = random.Random(seed)
    draws = sorted(k for _ in range(RESAMPLES) if (k := cohen_kappa(rng.choices(pairs, k=len(pairs)))) is not None)
    if len(draws) < RESAMPLES // 2:  # most resamples were all one answer: no interval worth the name
        return Estimate(value=value)
    return Estimate(value=value, low=draws[int(0.025 * len(draws))], high=draws[int(0.975 * len(draws)) - 1])


def pearson(xs: list[float], ys: list[float]) -> Estimate:
    """Pearson's r with a Fisher-z 95% interval (from 4 pairs on); None when either side never varies."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    if n < 2 or sxx == 0 or syy == 0:
        return Estimate(value=None)
    r = max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))
    if n < 4 or abs(r) == 1:
        return Estimate(value=r)
    z, half = math.atanh(r), stats.Z95 / math.sqrt(n - 3)
    return Estimate(value=r, low=math.tanh(z - half), high=math.tanh(z + half))


def agreement(grades: list[LabelledGrade], *, threshold: float = 0.5, seed: int = 0) -> list[GraderAgreement]:
    """Agreement per (stack, version, component, grader), in that order."""
    groups: dict[tuple[str, str, str, str], list[LabelledGrade]] = defaultdict(list)
    for g in grades:
        groups[(g.stack, g.version, g.component, g.grader)].append(g)
    report = []
    for (stack, version, component, grader), rows in sorted(groups.items()):
        mark = rows[0].safety_pass if rows[0].safety_pass is not None else threshold
        pairs = [(g.score >= mark, g.label >= threshold) for g in rows]
        both = sum(a and b for a, b in pairs)
        grader_passes, human_passes = sum(a for a, _ in pairs), sum(b for _, b in pairs)
        report.append(
            GraderAgreement(
                stack=stack, version=version, component=component, grader=grader, pass_mark=mark, n=len(rows),
                human_passes=human_passes, grader_passes=grader_passes,
                agreement=proportion(sum(a == b for a, b in pairs), len(pairs)),
                precision=proportion(both, grader_passes), recall=proportion(both, human_passes),
                kappa=kappa_estimate(pairs, seed), correlation=pearson([g.score for g in rows], [g.label for g in rows]),
                mean_abs_diff=sum(abs(g.score - g.label) for g in rows) / len(rows),
            )
        )  # fmt: skip
    return report
