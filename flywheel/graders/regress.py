"""``flywheel graders regress OLD NEW``: re-score stored episodes with two versions of a grader stack and report
what changed, before the new version decides anything (a new grader or rubric is a policy change).

An episode's sample is its last call's answer (its first choice), with every choice of every call for the safety
gate (``last_sample``); its item is what its agent was given (the queued task's payload, or the ``item`` in its
metadata). Both versions are registered in the store (an audit event for a new one) and their grades recorded,
each naming its version.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from flywheel.graders.model_graders import JudgeSettings
from flywheel.graders.sample import EpisodeSample, Sample
from flywheel.graders.sandbox import PythonSandbox
from flywheel.graders.stack import GraderStack, StackScore, score
from flywheel.store import Store, episodes, grades
from flywheel.store.episodes import CallRecord

MOST_CHANGED = 10  # episodes listed in a report


class ComponentChange(BaseModel):
    component: str  # reward | safety | holdout/<name>; "total" is the reward after the safety gate
    old_mean: float | None  # None: the version has no such component
    new_mean: float | None
    changed: int  # episodes whose score differs


class EpisodeChange(BaseModel):
    episode_id: str
    old: float
    new: float
    old_safe: bool
    new_safe: bool


class RegressReport(BaseModel):
    old: str  # versions
    new: str
    episodes: int
    components: list[ComponentChange]
    safety_flips: dict[str, int]  # "passed -> failed", "failed -> passed"
    most_changed: list[EpisodeChange]  # by |new - old| of the total, largest first


def last_sample(calls: list[CallRecord]) -> EpisodeSample:
    """A stored episode as graders see it: its final answer, its last call's first choice (empty when it made no
    call), and as ``turns`` every choice of every call, in order: the model produced each, and with n > 1 the record
    does not say which one the agent acted on, so the safety gate leaves none out."""
    turns = [
        Sample.from_message(choice.get("message") or {}, finish_reason=choice.get("finish_reason") or "stop")
        for call in calls
        for choice in call.response.get("choices") or []
    ]
    last = calls[-1].response.get("choices") if calls else None
    answer = turns[-len(last)] if last else Sample()  # the last call's first choice
    return EpisodeSample(**answer.model_dump(), turns=turns)


def _component(name: str, old: list[StackScore], new: list[StackScore]) -> ComponentChange:
    def values(scores: list[StackScore]) -> list[float] | None:
        if name == "total":
            return [s.reward for s in scores]
        return [s.grades[name].reward for s in scores] if scores and name in scores[0].grades else None

    a, b = values(old), values(new)
    changed = sum(x != y for x, y in zip(a, b, strict=True)) if a is not None and b is not None else len(old)
    return ComponentChange(
        component=name,
        old_mean=sum(a) / len(a) if a else None,
        new_mean=sum(b) / len(b) if b else None,
        changed=changed,
    )


async def regress(
    store: Store,
    old: GraderStack,
    new: GraderStack,
    *,
    actor: str,
    split: str | None = None,
    limit: int = 1000,
    concurrency: int = 8,
    sandbox: PythonSandbox | None = None,
    judge: JudgeSettings | None = None,
) -> RegressReport:
    """Score the last ``limit`` finished episodes (of ``split``) with both stacks; record and compare."""

    def load():
        with store.session() as s:
            for stack in (old, new):
                stack.register(s, actor=actor)
            found = grades.recent_finished(s, split=split, limit=limit)
            return [(e, last_sample(episodes.calls(s, e.id)), grades.item_of(s, e.id)) for e in found]

    loaded = await asyncio.to_thread(load)
    gate = asyncio.Semaphore(concurrency)

    async def both(sample: Sample, item: dict) -> tuple[StackScore, StackScore]:
        async with gate:
            return (
                await score(old, sample, item, sandbox=sandbox, judge=judge),
                await score(new, sample, item, sandbox=sandbox, judge=judge),
            )

    scored = await asyncio.gather(*(both(sample, item) for _, sample, item in loaded))

    def record():
        with store.session() as s:
            for (episode, _, _), pair in zip(loaded, scored, strict=True):
                for result in pair:
                    result.record(s, episode.id)

    await asyncio.to_thread(record)
    olds, news = [a for a, _ in scored], [b for _, b in scored]
    names = ["total", *dict.fromkeys([*old.components(), *new.components()])]
    flips = {
        "passed -> failed": sum(a.safe and not b.safe for a, b in scored),
        "failed -> passed": sum(b.safe and not a.safe for a, b in scored),
    }
    changes = [
        EpisodeChange(episode_id=e.id, old=a.reward, new=b.reward, old_safe=a.safe, new_safe=b.safe)
        for (e, _, _), (a, b) in zip(loaded, scored, strict=True)
        if a.reward != b.reward or a.safe != b.safe
    ]
    changes.sort(key=lambda c: abs(c.new - c.old), reverse=True)
    return RegressReport(
        old=old.version,
        new=new.version,
        episodes=len(loaded),
        components=[_component(name, olds, news) for name in names],
        safety_flips=flips,
        most_changed=changes[:MOST_CHANGED],
    )
