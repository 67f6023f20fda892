"""A grader stack: the graders a loop scores episodes with, versioned together as one policy.

``reward`` is the training reward (one grader; a ``multi`` grader combines components with a formula).
``safety`` is a gate, not a score: an episode whose safety grade is below ``safety_pass`` gets reward 0 whatever
else it did, and the promotion gate requires it on every held-out item. ``holdout`` graders are scored and
reported but never enter the training reward, so the gate can check what the policy was not optimised against (a
reward that rises while they do not is the sign of a hacked reward). Python verifiers are ``python`` graders.

What each grader sees of an episode (an ``EpisodeSample``): the reward and holdout graders its final answer, the
graded sample of OpenAI's RFT (``{{sample.output_text}}`` and the rest read it); the safety gate every assistant
turn the model produced, each as a sample of the same shape, and each tool call of a turn that made several on its
own. An episode is safe only if every one of them passes: an unsafe tool call is unsafe whatever the episode's
last message says. A plain ``Sample`` is an episode of one turn.

``version`` is a hash of the stack's canonical JSON and of ``SCORING`` (how ``score`` reads an episode): any change
to any grader, threshold or formula, or to that rule, is a new version, and every score names the version that
produced it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from sqlalchemy.orm import Session

from flywheel.graders.model_graders import JudgeSettings
from flywheel.graders.run import GradeResult, grade
from flywheel.graders.sample import EpisodeSample, Sample
from flywheel.graders.sandbox import PythonSandbox
from flywheel.graders.spec import Grader, read_spec_file, validate_spec
from flywheel.store import grades

SCORING = "safety-on-every-turn"
"""How ``score`` reads an episode (the module docstring). It decides scores as much as the graders do, so it is part
of every version: grades given under another rule (before it, the safety gate read the last message only) never
share a version with these."""


def safety_samples(sample: Sample) -> dict[str, Sample]:
    """What the safety gate grades of an episode, by label: each turn (``turn N``), and each tool call of a turn
    that made several, alone (``turn N, tool call K``: a grader that reads one call a turn still sees them all)."""
    turns = sample.turns if isinstance(sample, EpisodeSample) and sample.turns else [sample]
    samples: dict[str, Sample] = {}
    for n, turn in enumerate(turns, 1):
        samples[f"turn {n}"] = turn
        if len(turn.output_tools) > 1:
            for k, call in enumerate(turn.output_tools, 1):
                samples[f"turn {n}, tool call {k}"] = turn.model_copy(update={"output_tools": [call]})
    return samples


def _gate(results: dict[str, GradeResult], safety_pass: float) -> GradeResult:
    """An episode's safety grade from its samples' (``safety_samples``): the worst one's (the first of equals), with
    the errors of all counted (each detail naming its sample when there are several), their seconds summed, how
    many were graded (``details["samples"]``) and which failed (``details["unsafe"]``)."""
    worst = min(results.values(), key=lambda result: result.reward)
    errors: Counter[str] = Counter()
    error_details: dict[str, str] = {}
    for label, result in results.items():
        errors.update(result.errors)
        for kind, detail in result.error_details.items():
            error_details.setdefault(kind, f"{label}: {detail}" if len(results) > 1 else detail)
    unsafe = [label for label, result in results.items() if result.reward < safety_pass]
    return worst.model_copy(
        update={
            "errors": dict(errors),
            "error_details": error_details,
            "details": worst.details | {"samples": len(results), "unsafe": unsafe},
            "latency_s": sum(result.latency_s for result in results.values()),
        }
    )


class GraderStack(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    reward: Grader
    safety: Grader | None = None
    safety_pass: float = 1.0  # a safety grade at or above this passes
    holdout: dict[str, Grader] = Field(default_factory=dict)

    def components(self) -> list[str]:
        """The names its grades go by: ``reward``, ``safety`` (if any), ``holdout/<name>``."""
        return ["reward", *(["safety"] if self.safety else []), *(f"holdout/{name}" for name in self.holdout)]

    def register(self, s: Session, *, actor: str) -> None:
        """Store this version (once: registering it again changes nothing; a new version is an audit event)."""
        grades.register_stack(s, self.name, self.version, self.model_dump(mode="json"), actor=actor)

    @property
    def version(self) -> str:
        content = {"scoring": SCORING, "stack": self.model_dump(mode="json")}
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class StackGradingError(RuntimeError):
    """A grader of the stack failed on an episode (``StackScore.checked``): its reward would be a 0 that says
    nothing about the agent, so a job that must not learn from it stops or drops the episode instead."""


class StackScore(BaseModel):
    """One episode scored by a stack: the reward it trains on, whether it was safe, and every grade."""

    version: str
    reward: float  # the reward grader's score, or 0 when the safety gate failed
    safe: bool
    grades: dict[str, GradeResult]  # "reward", "safety", "holdout/<name>"

    def record(self, s: Session, episode_id: str) -> None:
        """Store these grades as the episode's under this version (which must be registered)."""
        by_key = {key: (g.name, g.reward, g.model_dump(mode="json")) for key, g in self.grades.items()}
        grades.record_grades(s, episode_id, self.version, by_key)

    def checked(self, where: str) -> StackScore:
        """This score, or a ``StackGradingError`` naming ``where`` and each failed component's error (the last
        line of its detail: a traceback's is the exception) when any grader failed."""
        failed = [
            f"{key}: {kind}: {((g.error_details.get(kind) or '').strip().splitlines() or [''])[-1]}"[:400]
            for key, g in self.grades.items()
            for kind in g.errors
        ]
        if failed:
            raise StackGradingError(f"{where}: the grader stack could not grade the episode: " + "; ".join(failed))
        return self

    def metrics(self) -> dict[str, float]:
        """Per-component metrics (``stack/<component>``), for a trajectory's metrics or a step's log."""
        return {f"stack/{key}": result.reward for key, result in self.grades.items()} | {"stack/safe": float(self.safe)}


_STACK: TypeAdapter[GraderStack] = TypeAdapter(GraderStack)


def parse_stack(data: Any, source: str = "grader stack") -> GraderStack:
    """Validate a stack given as plain data; problems at their JSON paths (``GraderSpecError``)."""
    return validate_spec(_STACK, data, source)


def load_stack(path: str | Path) -> GraderStack:
    """Load a stack from a JSON or YAML file."""
    return parse_stack(read_spec_file(path), str(path))


async def score(
    stack: GraderStack,
    sample: Sample | str,
    item: Mapping[str, Any] | None = None,
    *,
    sandbox: PythonSandbox | None = None,
    judge: JudgeSettings | None = None,
) -> StackScore:
    """Grade one episode with every grader of the stack, concurrently: the reward and holdout graders its final
    answer, the safety gate each of its ``safety_samples`` (an ``EpisodeSample``'s turns; a text or plain
    ``Sample`` is one turn)."""
    if isinstance(sample, str):
        sample = Sample.from_text(sample)
    answer = {"reward": stack.reward} | {f"holdout/{name}": g for name, g in stack.holdout.items()}
    answered, safety = await asyncio.gather(
        asyncio.gather(*(grade(g, sample, item, sandbox=sandbox, judge=judge) for g in answer.values())),
        _safety_grade(stack, sample, item, sandbox=sandbox, judge=judge),
    )
    graded = dict(zip(answer, answered, strict=True)) | safety
    by_component = {key: graded[key] for key in stack.components()}
    safe = "safety" not in by_component or by_component["safety"].reward >= stack.safety_pass
    return StackScore(
        version=stack.version, reward=by_component["reward"].reward if safe else 0.0, safe=safe, grades=by_component
    )


async def _safety_grade(
    stack: GraderStack,
    sample: Sample,
    item: Mapping[str, Any] | None,
    *,
    sandbox: PythonSandbox | None,
    judge: JudgeSettings | None,
) -> dict[str, GradeResult]:
    """``{"safety": the episode's safety grade}`` (``_gate`` of its ``safety_samples``), or nothing without one."""
    if stack.safety is None:
        return {}
    checks = safety_samples(sample)
    results = await asyncio.gather(
        *(grade(stack.safety, turn, item, sandbox=sandbox, judge=judge) for turn in checks.values())
    )
    return {"safety": _gate(dict(zip(checks, results, strict=True)), stack.safety_pass)}
