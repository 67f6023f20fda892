"""Held-out evaluation through the gateway's runners: every item of a frozen set run by the agent in its own
environment against served model names (checkpoints such as ``calc@12``, or a base model: the loop names each side
by its checkpoint, never by a deployment's alias, which a canary shares), each episode scored by a grader stack, the
grades recorded, one ``ItemResult`` per item and model for the gate.

The items go to the rollout queue as tasks of split ``eval`` (``samples`` attempts each: their mean is the item's
result), so the same runners that collect training groups run them, wherever they are. Every attempt counts: one
that did not finish scores 0 and is not safe (``_item_result``), so an item is safe only if all its attempts
finished and passed the safety grader.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence

from pydantic import BaseModel
from sqlalchemy.orm import Session

from flywheel.gateway.client import GroupQueue
from flywheel.gateway.schemas import TaskSpec
from flywheel.graders.scoring import sample_of
from flywheel.graders.stack import GraderStack, StackScore, score
from flywheel.loop.gate import HeldOutSet, ItemResult
from flywheel.store import Store
from flywheel.train.credit import sampled_turns
from flywheel.types import Trajectory, sampled_tokens


class HeldOutRun(BaseModel):
    """One model's results on one version of a held-out set, by one version of a grader stack."""

    id: str
    model: str
    heldout: str  # name@version
    stack: str  # version
    results: list[ItemResult]
    episodes: list[str]
    failed_items: list[str]  # no attempt finished
    # every attempt finished and every call in it was drawn at temperature 0: a run again would repeat this one
    greedy: bool = False


def _greedy(trajectory: Trajectory) -> bool:
    """Whether every call of ``trajectory`` (its other histories' too) was drawn at temperature 0 (a call that does
    not say how it was drawn is not)."""
    choices = sampled_turns(trajectory)
    return bool(choices) and all((drawn := sampled_tokens(c)) is not None and drawn.greedy for c in choices)


def _tool_calls(trajectory: Trajectory) -> int:
    return sum(len(m.get("tool_calls") or []) for m in trajectory.messages() if m.get("role") == "assistant")


def _item_result(
    item_id: str, attempts: int, trajectories: list[Trajectory], scores: list[StackScore], *, safety_checked: bool
) -> ItemResult:
    """An item's result over its ``attempts``, of which ``trajectories`` finished: the others score 0 and are not
    safe (a candidate that crashes on exactly the risky items must not pass the safety gate); the costs are the
    finished attempts' means. ``score`` is the stack's reward (0 where unsafe), ``task_score`` the reward grader's
    own."""
    finished = len(trajectories) or 1
    return ItemResult(
        item=item_id,
        score=sum(s.reward for s in scores) / attempts,
        task_score=sum(s.grades["reward"].reward for s in scores) / attempts,
        safe=len(trajectories) == attempts and all(s.safe for s in scores),
        attempts=attempts,
        failures=attempts - len(trajectories),
        safety_checked=safety_checked,
        tokens=sum(float(t.metrics.get("completion_tokens", 0)) for t in trajectories) / finished,
        tool_calls=sum(_tool_calls(t) for t in trajectories) / finished,
        latency_ms=sum(float(t.metrics.get("latency_ms", 0)) for t in trajectories) / finished,
    )


async def evaluate(
    queue: GroupQueue,
    heldout: HeldOutSet,
    models: Sequence[str],
    stack: GraderStack,
    *,
    samples: int = 1,
    max_wait: float = 1800.0,
    store: Store | None = None,
    actor: str = "loop",
    prefix: str = "eval",
) -> list[HeldOutRun]:
    """Run each of ``models`` on every held-out item through the queue's runners; score and (with ``store``)
    record; one run per model, in their order.

    The sides are timed alike: each first runs one untimed warm-up episode (the first item: a checkpoint loaded,
    or kernels compiled, then are not in its timed run), and the timed tasks are queued item by item with the
    models alternating (the runners claim in that order), so that no side has a stretch of the machine to itself.
    Task ids: ``<prefix>:<held-out name>:<version>:<run id>:<item id>``, a warm-up's ``...:<run id>-warm`` (a
    loop's prefix names it)."""
    base, run_ids = f"{prefix}:{heldout.name}:{heldout.version}", [secrets.token_hex(6) for _ in models]
    if (first := next(iter(heldout.items.values()), None)) is not None:
        warm_ups = [
            TaskSpec(task_id=f"{base}:{run_id}-warm", payload=first, group_size=1, split="eval", model=model)
            for model, run_id in zip(models, run_ids, strict=True)
        ]
        await queue.gather_groups(
            warm_ups, max_wait=max_wait, allow_failed=True
        )  # unscored: a failure shows in the timed run
    sides = list(zip(models, run_ids, strict=True))
    specs = [
        TaskSpec(task_id=f"{base}:{run_id}:{i}", payload=item, group_size=samples, split="eval", model=model)
        for i, item in heldout.items.items()
        for model, run_id in sides
    ]
    groups = iter(await queue.gather_groups(specs, max_wait=max_wait, allow_failed=True))
    scored: list[dict[str, tuple[list[Trajectory], list[StackScore]]]] = [{} for _ in sides]
    for item_id, item in heldout.items.items():
        for side in scored:
            trajectories = list(next(groups).trajectories)
            scores = await asyncio.gather(*(score(stack, sample_of(t), item) for t in trajectories))
            side[item_id] = (trajectories, list(scores))
    if store is not None:

        def record(s: Session) -> None:
            stack.register(s, actor=actor)
            for side in scored:
                for trajectories, scores in side.values():
                    for t, result in zip(trajectories, scores, strict=True):
                        result.record(s, str(t.metadata["episode_id"]))

        await store.run(record)
    checked = stack.safety is not None
    return [
        HeldOutRun(
            id=run_id,
            model=model,
            heldout=f"{heldout.name}@{heldout.version}",
            stack=stack.version,
            results=[_item_result(i, samples, *side[i], safety_checked=checked) for i in heldout.items],
            episodes=[str(t.metadata["episode_id"]) for ts, _ in side.values() for t in ts],
            failed_items=[i for i, (ts, _) in side.items() if not ts],
            greedy=bool(side) and all(len(ts) == samples and all(_greedy(t) for t in ts) for ts, _ in side.values()),
        )
        for (model, run_id), side in zip(sides, scored, strict=True)
    ]
