"""Graders as rewards: score trajectories in a rollout or in ``gather``'s ``after_each``, and aggregate the
per-grader metrics of a step.

A trajectory's sample is its final assistant message: its text and tool calls (as in OpenAI's RFT, where the
graded sample is the model's last output); ``sample_of`` keeps every turn the model produced with it, which a grader
stack's safety gate grades one by one (``stack.score``). Scoring sets ``trajectory.reward`` and adds metrics, which
``model.log`` averages per split and ``grader_metrics`` aggregates properly:

- ``grader/<name>``: the reward; ``grader/<name>/<key>``: a multi grader's sub-rewards;
- ``grader/<name>/errors``: errors in this grade; ``grader/<name>/error/<kind>``: by kind (when any);
- ``grader/<name>/latency_s``: seconds spent grading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from openai.types.chat.chat_completion import Choice

from flywheel.graders.data import RFTRow
from flywheel.graders.model_graders import JudgeSettings
from flywheel.graders.run import GradeResult, grade
from flywheel.graders.sample import EpisodeSample, Sample
from flywheel.graders.sandbox import PythonSandbox
from flywheel.graders.spec import Grader
from flywheel.types import Trajectory, TrajectoryGroup, choice_to_message

ItemOf = Callable[[Trajectory], Mapping[str, Any]]


def sample_of(trajectory: Trajectory) -> EpisodeSample:
    """A trajectory as graders see it: its final assistant message (empty if the model never answered) and, as
    ``turns``, every turn the model produced: the sampled Choices of its main and additional histories (a
    sub-agent's, a history the client edited), or, in a trajectory that holds none (made of message dicts), every
    assistant message, since nothing tells the model's from the prompt's there."""
    last = trajectory.messages_and_choices[-1] if trajectory.messages_and_choices else None
    finish_reason = last.finish_reason if isinstance(last, Choice) else "stop"
    final = next((m for m in reversed(trajectory.messages()) if m.get("role") == "assistant"), None)
    answer = Sample.from_message(final, finish_reason=finish_reason) if final is not None else Sample()
    histories = [trajectory, *trajectory.additional_histories]
    choices = [item for h in histories for item in h.messages_and_choices if isinstance(item, Choice)]
    turns = (
        [Sample.from_message(choice_to_message(c), finish_reason=c.finish_reason) for c in choices]
        if choices
        else [Sample.from_message(m) for h in histories for m in h.messages() if m.get("role") == "assistant"]
    )
    return EpisodeSample(**answer.model_dump(), turns=turns)


def metrics_of(result: GradeResult) -> dict[str, float]:
    """A grade as trajectory metrics (see the module docstring for the names)."""
    prefix = f"grader/{result.name}"
    metrics = {
        prefix: result.reward,
        f"{prefix}/errors": float(sum(result.errors.values())),
        f"{prefix}/latency_s": result.latency_s,
    }
    metrics |= {f"{prefix}/{key}": value for key, value in result.sub_rewards.items()}
    metrics |= {f"{prefix}/error/{kind}": float(count) for kind, count in result.errors.items()}
    return metrics


async def score_trajectory(
    grader: Grader,
    trajectory: Trajectory,
    item: Mapping[str, Any],
    *,
    set_reward: bool = True,
    sandbox: PythonSandbox | None = None,
    judge: JudgeSettings | None = None,
) -> GradeResult:
    """Grade a trajectory's final answer against its scenario's item; record the metrics and (with
    ``set_reward``) the reward on it. Error messages go to ``trajectory.logs``."""
    result = await grade(grader, sample_of(trajectory), item, sandbox=sandbox, judge=judge)
    if set_reward:
        trajectory.reward = result.reward
    trajectory.metrics = {**trajectory.metrics, **metrics_of(result)}
    if result.error_details:
        trajectory.logs = [
            *trajectory.logs,
            *(f"grader {kind}: {detail}" for kind, detail in result.error_details.items()),
        ]
    return result


def _item_getter(items: Sequence[RFTRow] | ItemOf) -> ItemOf:
    if callable(items):
        return items
    rows = list(items)

    def item_of(trajectory: Trajectory) -> Mapping[str, Any]:
        index = trajectory.metadata.get("rft_row")
        if not isinstance(index, int) or not 0 <= index < len(rows):
            raise KeyError(
                f"trajectory {trajectory.id} has no valid metadata['rft_row'] (got {index!r}); rollouts of RFT rows "
                "set it (flywheel.graders.rollout.rft_rollout), or pass a function trajectory -> item"
            )
        return rows[index].item

    return item_of


async def score_group(
    grader: Grader,
    group: TrajectoryGroup,
    items: Sequence[RFTRow] | ItemOf,
    *,
    sandbox: PythonSandbox | None = None,
    judge: JudgeSettings | None = None,
) -> TrajectoryGroup:
    """Score every trajectory of a group concurrently; ``items``: the RFT rows the rollouts answered (found by
    ``metadata["rft_row"]``) or a function trajectory -> item."""
    item_of = _item_getter(items)
    await asyncio.gather(
        *(score_trajectory(grader, t, item_of(t), sandbox=sandbox, judge=judge) for t in group.trajectories)
    )
    return group


def after_each(
    grader: Grader,
    items: Sequence[RFTRow] | ItemOf,
    *,
    sandbox: PythonSandbox | None = None,
    judge: JudgeSettings | None = None,
) -> Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup]]:
    """For ``gather_trajectory_groups(..., after_each=after_each(grader, rows))``: scores each group as it
    finishes."""
    item_of = _item_getter(items)

    async def score(group: TrajectoryGroup) -> TrajectoryGroup:
        return await score_group(grader, group, item_of, sandbox=sandbox, judge=judge)

    return score


def grader_metrics(trajectories: Iterable[Trajectory | TrajectoryGroup], split: str = "train") -> dict[str, float]:
    """Per-grader metrics of a step, prefixed by ``split``: reward and sub-reward means, error counts (summed,
    by kind and in all), the fraction of grades with an error, mean latency."""
    flat = [t for x in trajectories for t in (x.trajectories if isinstance(x, TrajectoryGroup) else [x])]
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for trajectory in flat:
        for key, value in trajectory.metrics.items():
            if key.startswith("grader/"):
                sums[key] = sums.get(key, 0.0) + float(value)
                counts[key] = counts.get(key, 0) + 1
    metrics: dict[str, float] = {}
    for key, total in sums.items():
        if "/error/" in key:
            metrics[f"{split}/{key}"] = total
        elif key.endswith("/errors"):
            metrics[f"{split}/{key}"] = total
            with_errors = sum(1 for t in flat if t.metrics.get(key, 0) > 0)
            metrics[f"{split}/{key.removesuffix('/errors')}/error_rate"] = with_errors / counts[key]
        else:
            metrics[f"{split}/{key}{'' if key.endswith('latency_s') else '/mean'}"] = total / counts[key]
    return metrics
