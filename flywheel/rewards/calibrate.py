"""Judge calibration: how well a RULER judge agrees with human labels, measured offline before training on it.

Data: JSONL, one group per line, ``{"id": ..., "rubric"?: ..., "tools"?: [...], "trajectories": [{"messages":
[...], "label"?: "...", "human_score": 0.8 | "human_rank": 1}, ...]}``. A group uses scores (higher is better)
or ranks (1 is best), not both. ``DEFAULT_DATA`` is a small set shipped with Flywheel: support-agent answers built
on retrieved context (refund policy and the like), four per group: faithful, verbose but faithful, hallucinated,
and ignoring the context.

Reported: pairwise ranking accuracy (over pairs the humans rank differently; a judge tie counts half), Kendall's
tau-b per group, top-1 agreement (everything the judge ranks first is a human-best), the spread of the judge's
scores within a group, and the disagreements (pairs ranked the other way round or tied), biggest human gap first.
A group the judge fails on is reported as failed; the others are still measured.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from flywheel.rewards.cache import JudgeCache
from flywheel.rewards.ruler import DEFAULT_JUDGE, DEFAULT_RUBRIC, JudgeUsage, RetryPolicy, Score, ruler
from flywheel.types import Message

DEFAULT_DATA = resources.files("flywheel.rewards") / "data" / "refund_policy.jsonl"


class LabelledTrajectory(BaseModel):
    messages: list[Message] = Field(min_length=1)
    label: str | None = None
    human_score: float | None = None
    human_rank: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_label(self) -> LabelledTrajectory:
        if (self.human_score is None) == (self.human_rank is None):
            raise ValueError("give exactly one of 'human_score' and 'human_rank'")
        return self

    @property
    def human(self) -> float:
        """Higher is better, whichever way it was labelled."""
        return self.human_score if self.human_score is not None else -float(self.human_rank or 0)


class LabelledGroup(BaseModel):
    id: str
    rubric: str | None = None
    tools: list[dict] | None = None  # the tool definitions the agent was offered
    trajectories: list[LabelledTrajectory] = Field(min_length=2)

    @model_validator(mode="after")
    def _one_kind(self) -> LabelledGroup:
        if len({t.human_score is None for t in self.trajectories}) > 1:
            raise ValueError("mixes 'human_score' and 'human_rank': use one kind per group")
        return self


def load_groups(path: str | Path) -> list[LabelledGroup]:
    """Read a labelled JSONL file; a bad line is an error naming the file, the line and the field."""
    groups = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            groups.append(LabelledGroup.model_validate_json(line))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the line"
            raise ValueError(f"{path}:{number}: {where}: {first['msg']}") from None
    if not groups:
        raise ValueError(f"{path}: no labelled groups")
    return groups


class Disagreement(BaseModel):
    group: str
    better: str  # the trajectory humans prefer (its label, or its position from 1)
    worse: str
    human: tuple[float, float]
    judge: tuple[float, float]
    explanations: tuple[str, str]


class GroupResult(BaseModel):
    id: str
    size: int
    judge_scores: list[float] = []
    explanations: list[str] = []
    pairs: int = 0  # pairs the humans rank differently
    concordant: float = 0.0  # of those, ranked the same way by the judge (ties count 0.5)
    kendall_tau: float | None = None  # None when undefined (all human or all judge scores equal)
    top1_agrees: bool | None = None
    spread: float | None = None  # max - min judge score
    error: str | None = None


class CalibrationReport(BaseModel):
    judge_model: str
    groups: list[GroupResult]
    disagreements: list[Disagreement]
    usage: JudgeUsage

    @property
    def measured(self) -> list[GroupResult]:
        return [g for g in self.groups if g.error is None]

    @property
    def pairwise_accuracy(self) -> float | None:
        pairs = sum(g.pairs for g in self.measured)
        return sum(g.concordant for g in self.measured) / pairs if pairs else None

    @property
    def mean_kendall_tau(self) -> float | None:
        taus = [g.kendall_tau for g in self.measured if g.kendall_tau is not None]
        return sum(taus) / len(taus) if taus else None

    @property
    def top1_agreement(self) -> float | None:
        tops = [g.top1_agrees for g in self.measured if g.top1_agrees is not None]
        return sum(tops) / len(tops) if tops else None

    @property
    def mean_spread(self) -> float | None:
        spreads = [g.spread for g in self.measured if g.spread is not None]
        return sum(spreads) / len(spreads) if spreads else None

    def summary(self) -> dict[str, Any]:
        return {
            "judge_model": self.judge_model,
            "groups": len(self.groups),
            "failed_groups": len(self.groups) - len(self.measured),
            "pairwise_accuracy": self.pairwise_accuracy,
            "mean_kendall_tau": self.mean_kendall_tau,
            "groups_with_undefined_tau": sum(g.kendall_tau is None for g in self.measured),
            "top1_agreement": self.top1_agreement,
            "mean_score_spread": self.mean_spread,
            "disagreements": len(self.disagreements),
        }


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def kendall_tau_b(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-b (ties in either ranking accounted for); None when one side is all ties."""
    concordant = discordant = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = _sign(a[i] - a[j]), _sign(b[i] - b[j])
        ties_a += da == 0
        ties_b += db == 0
        if da and db:
            concordant += da == db
            discordant += da != db
    n0 = len(a) * (len(a) - 1) // 2
    denominator = math.sqrt((n0 - ties_a) * (n0 - ties_b))
    return (concordant - discordant) / denominator if denominator else None


def measure(group: LabelledGroup, scores: list[Score]) -> tuple[GroupResult, list[Disagreement]]:
    human = [t.human for t in group.trajectories]
    judge = [s.score for s in scores]
    names = [t.label or str(i) for i, t in enumerate(group.trajectories, 1)]
    result = GroupResult(
        id=group.id,
        size=len(human),
        judge_scores=judge,
        explanations=[s.explanation for s in scores],
        kendall_tau=kendall_tau_b(human, judge),
        spread=max(judge) - min(judge),
        top1_agrees=all(human[i] == max(human) for i, s in enumerate(judge) if s == max(judge)),
    )
    disagreements = []
    for i, j in itertools.combinations(range(len(human)), 2):
        if human[i] == human[j]:
            continue
        better, worse = (i, j) if human[i] > human[j] else (j, i)
        result.pairs += 1
        agreement = _sign(judge[better] - judge[worse])
        result.concordant += 1.0 if agreement > 0 else 0.5 if agreement == 0 else 0.0
        if agreement <= 0:
            disagreements.append(
                Disagreement(
                    group=group.id,
                    better=names[better],
                    worse=names[worse],
                    human=(human[better], human[worse]),
                    judge=(judge[better], judge[worse]),
                    explanations=(scores[better].explanation, scores[worse].explanation),
                )
            )
    return result, disagreements


async def calibrate(
    groups: list[LabelledGroup],
    judge_model: str = DEFAULT_JUDGE,
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str | None = None,
    *,
    concurrency: int = 4,
    cache: JudgeCache | str | Path | bool | None = None,
    retry: RetryPolicy | None = None,
    max_explanation_chars: int | Literal["auto"] | None = "auto",
) -> CalibrationReport:
    """Judge every labelled group and compare with the human labels. ``rubric`` overrides the groups' own
    (which override the default)."""
    usage = JudgeUsage()
    slots = asyncio.Semaphore(concurrency)

    async def one(group: LabelledGroup) -> tuple[GroupResult, list[Disagreement]]:
        async with slots:
            try:
                scores = await ruler(
                    [t.messages for t in group.trajectories],
                    judge_model,
                    extra_litellm_params,
                    rubric or group.rubric or DEFAULT_RUBRIC,
                    group.tools,
                    cache=cache,
                    retry=retry,
                    usage=usage,
                    max_explanation_chars=max_explanation_chars,
                )
            except Exception as exc:  # one failed group must not lose the others' results
                return GroupResult(id=group.id, size=len(group.trajectories), error=repr(exc)), []
        return measure(group, scores)

    measured = await asyncio.gather(*(one(g) for g in groups))
    disagreements = [d for _, ds in measured for d in ds]
    disagreements.sort(key=lambda d: d.human[0] - d.human[1], reverse=True)
    return CalibrationReport(
        judge_model=judge_model, groups=[r for r, _ in measured], disagreements=disagreements, usage=usage
    )


def report_json(report: CalibrationReport) -> str:
    return json.dumps({"summary": report.summary(), **report.model_dump(mode="json")}, indent=2)
