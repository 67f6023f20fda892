"""``flywheel eval``: run a model (a base model, or a trained one at any checkpoint) on RFT data and report each
grader's score with a 95% interval.

The interval is Wilson's when every score is 0 or 1 (a pass rate), else a percentile bootstrap of the mean
(fixed seed, so a report is reproducible). A row whose rollout failed scores 0 and counts a ``rollout_error``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from flywheel.checkpoints import layout
from flywheel.checkpoints.run import RunStore
from flywheel.gather import gather_trajectories
from flywheel.graders.data import RFTRow, load_rft_jsonl
from flywheel.graders.model_graders import JudgeSettings
from flywheel.graders.rollout import rft_rollout
from flywheel.graders.run import GradeResult
from flywheel.graders.sandbox import PythonSandbox, SandboxLimits
from flywheel.graders.scoring import sample_of, score_trajectory
from flywheel.graders.spec import Grader, MultiGrader, load_grader
from flywheel.home import default_home
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.model import Model, TrainableModel
from flywheel.stats import Interval, bootstrap_mean, wilson
from flywheel.train.config import TrainedWeights
from flywheel.types import Trajectory

ROLLOUT_ERROR = "rollout_error"


class Score(Interval):
    """A grader's mean score over the rows, with its 95% interval and how it was found."""

    method: str  # "wilson" | "bootstrap" | "none" (fewer than 2 values)


def score_interval(values: list[float], resamples: int = 4000, seed: int = 0) -> Score:
    """The mean and its 95% interval (Wilson for 0/1 scores, else percentile bootstrap)."""
    n = len(values)
    mean = sum(values) / n if n else 0.0
    if n < 2:
        return Score(mean=mean, low=mean, high=mean, method="none")
    if all(v in (0.0, 1.0) for v in values):
        low, high = wilson(sum(values), n)
        return Score(mean=mean, low=low, high=high, method="wilson")
    low, high = bootstrap_mean(values, resamples, seed)
    return Score(mean=mean, low=low, high=high, method="bootstrap")


def parse_model_spec(spec: str) -> tuple[str, int | None]:
    """``name@step`` -> (name, step); ``name`` -> (name, None)."""
    name, at, step = spec.rpartition("@")
    if not at:
        return spec, None
    if not name or not step.isdigit():
        raise ValueError(f"--model {spec!r}: expected NAME or NAME@STEP with STEP a checkpoint number")
    return name, int(step)


class EvalConfig(BaseModel):
    model: str
    data: Path
    graders: list[Path] = Field(min_length=1)
    project: str | None = None
    base_model: str = EMBEDDED_MODEL
    home: Path | None = None
    limit: int | None = Field(None, ge=1)
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    concurrency: int = Field(8, ge=1)
    judge: JudgeSettings = JudgeSettings()
    python: SandboxLimits = SandboxLimits()


class GraderSummary(BaseModel):
    name: str
    n: int
    score: Score
    sub_scores: dict[str, Score] = {}
    errors: dict[str, int] = {}


class EvalReport(BaseModel):
    model: str
    data: str
    rows: list[dict[str, Any]]
    summaries: list[GraderSummary]


def _projects_with(home: Path, name: str) -> list[str]:
    found = layout.find_models(home, name)
    return [project for project, path in found.items() if layout.checkpoints_dir(path).is_dir()]


async def _policy(config: EvalConfig, backend: LocalBackend) -> Model:
    """The model to evaluate: a trained model at a checkpoint (its latest without @STEP) or a base model."""
    name, step = parse_model_spec(config.model)
    home = backend.path
    project = config.project
    if project is None:
        found = _projects_with(home, name)
        if len(found) > 1:
            raise ValueError(
                f"model {name!r} exists in several projects under {home} ({', '.join(found)}): pass --project"
            )
        project = found[0] if found else None
    if project is None or not layout.checkpoints_dir(layout.model_path(home, project, name)).is_dir():
        if step is not None:
            raise ValueError(
                f"no checkpoints of model {name!r} under {home}/{project or '*'}/models/ (FLYWHEEL_HOME or --home)"
            )
        await backend.load(name)  # a base model as it is
        return Model(name=name, project="eval", inference_model_name=name, inference_base_url=backend.base_url)
    run = RunStore(layout.model_path(home, project, name))
    available = run.steps()
    if step is not None and step not in available:
        raise ValueError(f"{name}@{step}: no such checkpoint; available steps: {available or 'none'}")
    # trained as it was: a LoRA adapter of the saved shape, or every weight
    trained_weights = run.state(available[-1]).trained_weights if available else TrainedWeights()
    model = TrainableModel(name=name, project=project, base_model=config.base_model, trained_weights=trained_weights)
    await model.register(backend)
    if step is not None:
        await backend.restore(model, step)
    return model


def _summaries(graders: list[Grader], results: list[list[GradeResult]], rollout_errors: int) -> list[GraderSummary]:
    summaries = []
    for g, grader in enumerate(graders):
        per_row = [row[g] for row in results]
        errors: dict[str, int] = {ROLLOUT_ERROR: rollout_errors} if rollout_errors else {}
        for result in per_row:
            for kind, count in result.errors.items():
                errors[kind] = errors.get(kind, 0) + count
        sub_scores = {}
        if isinstance(grader, MultiGrader):
            sub_scores = {key: score_interval([r.sub_rewards.get(key, 0.0) for r in per_row]) for key in grader.graders}
        summaries.append(
            GraderSummary(
                name=grader.name,
                n=len(per_row),
                score=score_interval([r.reward for r in per_row]),
                sub_scores=sub_scores,
                errors=errors,
            )
        )
    return summaries


async def evaluate(config: EvalConfig) -> EvalReport:
    """Answer every row with the model (greedy by default), grade the answers, summarise per grader."""
    graders = [load_grader(path) for path in config.graders]  # bad graders or data fail before a model loads
    rows: list[RFTRow] = load_rft_jsonl(config.data)[: config.limit]
    sandbox = PythonSandbox(config.python)
    async with LocalBackend(path=config.home or default_home()) as backend:
        policy = await _policy(config, backend)
        sampling = {"temperature": config.temperature, "max_tokens": config.max_tokens}
        answered = await gather_trajectories(
            (rft_rollout(policy, row, **sampling) for row in rows),
            pbar_desc=f"eval {config.model}",
            max_exceptions=len(rows),
            max_concurrency=config.concurrency,
        )
    by_row: dict[int, Trajectory] = {
        int(t.metadata["rft_row"]): t  # type: ignore[arg-type]
        for t in answered
        if isinstance(t, Trajectory)  # failed rollouts come back as their exceptions
    }
    trajectories = [by_row.get(row.index) or Trajectory(messages_and_choices=row.messages) for row in rows]

    async def grade_row(row: RFTRow, trajectory: Trajectory) -> list[GradeResult]:
        return list(
            await asyncio.gather(
                *(
                    score_trajectory(
                        grader, trajectory, row.item, set_reward=i == 0, sandbox=sandbox, judge=config.judge
                    )
                    for i, grader in enumerate(graders)
                )
            )
        )

    results = await asyncio.gather(*(grade_row(row, t) for row, t in zip(rows, trajectories)))
    for row, row_results in zip(rows, results):  # a failed rollout scores 0, whatever graders made of no answer
        if row.index not in by_row:
            for result in row_results:
                result.reward, result.sub_rewards = 0.0, {key: 0.0 for key in result.sub_rewards}
    report_rows = [
        {
            "row": row.index,
            "output": sample_of(t).output_text,
            "tool_calls": sample_of(t).output_tools,
            "rollout_failed": row.index not in by_row,
            "graders": [r.to_openai() for r in row_results],
        }
        for row, t, row_results in zip(rows, trajectories, results)
    ]
    summaries = _summaries(graders, results, len(rows) - len(by_row))
    return EvalReport(model=config.model, data=str(config.data), rows=report_rows, summaries=summaries)
