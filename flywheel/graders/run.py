"""Grade a sample against an item: ``await grade(grader, sample, item)`` -> ``GradeResult``.

Never raises for a bad sample, item, judge or grader code: the failing (sub-)grader scores 0 and its error kind
is counted (``result.errors``), as OpenAI's ``graders/run`` reports them. In a multi grader a failed sub-grader
scores 0 and the formula is still computed from the others.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from flywheel.graders import embedding, similarity
from flywheel.graders.errors import FORMULA_EVAL, OTHER, GraderError, openai_flags
from flywheel.graders.formula import parse_formula
from flywheel.graders.model_graders import JudgeSettings, label_model, score_model
from flywheel.graders.sample import Sample
from flywheel.graders.sandbox import PythonSandbox
from flywheel.graders.spec import (
    Grader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from flywheel.graders.templates import render


class GradeResult(BaseModel):
    """One grade. ``errors`` counts failures by kind (sub-graders included); ``error_details`` keeps the first
    message of each kind; ``details`` holds what graders report (judge reasoning, labels, pass flags) by name."""

    name: str
    type: str
    reward: float
    sub_rewards: dict[str, float] = {}
    errors: dict[str, int] = {}
    error_details: dict[str, str] = {}
    details: dict[str, Any] = {}
    latency_s: float = 0.0

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``graders/run`` answer: ``metadata.errors`` holds its flags (``errors.openai_flags``); Flywheel
        adds ``metadata.error_counts`` (failures by Flywheel's finer kinds, sub-graders included) and
        ``metadata.error_details`` (the first message of each kind)."""
        return {
            "reward": self.reward,
            "sub_rewards": self.sub_rewards,
            "metadata": {
                "name": self.name,
                "type": self.type,
                "errors": openai_flags(self.errors, self.error_details),
                "execution_time": self.latency_s,
                "scores": self.details,
                "sampled_model_name": None,
                "token_usage": None,
                "error_counts": self.errors,
                "error_details": self.error_details,
            },
            "model_grader_token_usage_per_model": {},
        }


@functools.cache
def default_sandbox() -> PythonSandbox:
    """The sandbox shared by calls that pass none, so that its concurrency limit holds across them."""
    return PythonSandbox()


class _Grading:
    """One ``grade`` call: the namespaces, settings and the errors and details of every (sub-)grader."""

    def __init__(self, sample: Sample, item: Mapping[str, Any], sandbox: PythonSandbox, judge: JudgeSettings) -> None:
        self.namespaces = {"sample": sample.namespace(), "item": item}
        self.sandbox, self.judge = sandbox, judge
        self.errors: Counter[str] = Counter()
        self.error_details: dict[str, str] = {}
        self.details: dict[str, Any] = {}

    async def score(self, grader: Grader) -> float:
        try:
            return await self._score(grader)
        except GraderError as exc:
            self.record(grader, exc)
        except Exception as exc:  # a bug or an environment problem (e.g. a metric's package missing)
            self.record(grader, GraderError(OTHER, f"{type(exc).__name__}: {exc}"))
        return 0.0

    def record(self, grader: Grader, error: GraderError) -> None:
        self.errors[error.kind] += 1
        self.error_details.setdefault(error.kind, f"{grader.name}: {error.detail}")

    async def combine(self, grader: MultiGrader) -> tuple[float, dict[str, float]]:
        """The formula's value and the sub-graders' scores (kept even when the formula fails)."""
        keys = list(grader.graders)
        scores = dict(zip(keys, await asyncio.gather(*(self.score(grader.graders[key]) for key in keys))))
        try:
            return parse_formula(grader.calculate_output, keys)(scores), scores
        except (ArithmeticError, ValueError) as exc:
            self.record(grader, GraderError(FORMULA_EVAL, f"{grader.calculate_output} with {scores}: {exc}"))
            return 0.0, scores

    async def _score(self, grader: Grader) -> float:
        namespaces = self.namespaces
        if isinstance(grader, StringCheckGrader):
            text, reference = render(grader.input, namespaces), render(grader.reference, namespaces)
            checks = {"eq": text == reference, "ne": text != reference, "like": reference in text,
                      "ilike": reference.lower() in text.lower()}  # fmt: skip
            return float(checks[grader.operation])
        if isinstance(grader, TextSimilarityGrader):
            text, reference = render(grader.input, namespaces), render(grader.reference, namespaces)
            if grader.evaluation_metric == "cosine":
                score = await embedding.cosine(text, reference)
            else:
                score = await asyncio.to_thread(similarity.similarity, grader.evaluation_metric, text, reference)
            if grader.pass_threshold is not None:
                self.details[f"{grader.name}.passed"] = score >= grader.pass_threshold
            return score
        if isinstance(grader, ScoreModelGrader | LabelModelGrader):
            judge = score_model if isinstance(grader, ScoreModelGrader) else label_model
            score, details = await judge(grader, namespaces, self.judge)  # type: ignore[arg-type]
            self.details[grader.name] = details
            if isinstance(grader, ScoreModelGrader) and grader.pass_threshold is not None:
                self.details[f"{grader.name}.passed"] = score >= grader.pass_threshold
            return score
        if isinstance(grader, PythonGrader):
            sample = {**namespaces["sample"], "output_json": namespaces["sample"].get("output_json")}
            return await self.sandbox.run(grader.source, sample, namespaces["item"])
        if isinstance(grader, MultiGrader):
            return (await self.combine(grader))[0]
        raise TypeError(f"not a grader: {type(grader).__name__}")


async def grade(
    grader: Grader,
    sample: Sample | str,
    item: Mapping[str, Any] | None = None,
    *,
    sandbox: PythonSandbox | None = None,
    judge: JudgeSettings | None = None,
) -> GradeResult:
    """Grade ``sample`` (a Sample or the model's answer text) against ``item`` (the dataset row's fields)."""
    start = time.perf_counter()
    sample = Sample.from_text(sample) if isinstance(sample, str) else sample
    grading = _Grading(sample, item or {}, sandbox or default_sandbox(), judge or JudgeSettings())
    sub_rewards: dict[str, float] = {}
    if isinstance(grader, MultiGrader):
        reward, sub_rewards = await grading.combine(grader)
    else:
        reward = await grading.score(grader)
    return GradeResult(
        name=grader.name,
        type=grader.type,
        reward=reward,
        sub_rewards=sub_rewards,
        errors=dict(grading.errors),
        error_details=grading.error_details,
        details=grading.details,
        latency_s=time.perf_counter() - start,
    )
