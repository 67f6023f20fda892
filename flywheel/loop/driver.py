"""The flywheel loop: production episodes in, a gated candidate out.

Each step: new finished production episodes' items join the task pool (deduplicated by item id; held-out items,
by id or by content, never do, nor seed tasks that are held-out items, nor their episodes as off-policy members:
``Loop.is_heldout``, counted in the report's ``excluded_heldout``); groups of tasks are
queued for the gateway's runners against the model's live weights; with ``off_policy_members``, logged production
episodes of a group's item join it as off-policy members (``offpolicy.py``: their sampler log-probs, the truncated
importance ratio, left out when stale or without token ids); every episode is scored by the grader stack (its grades
recorded under the stack's version) and the groups train one step. The training reward is watched for reward
hacking (``alarm.py``: while the alarm is raised nothing is promoted). Every ``candidate_every`` steps the latest
checkpoint is a candidate for the promotion ladder the loop owns (``ladder.py``: the gate, shadow and canary; after a
rollback, training goes on from production's weights, ``Loop.rewind_if_due``), which each iteration also watches.

With ``async_steps`` k > 0 the loop is pipelined: the groups of the next k iterations are drawn (queued, run and
scored) while a step trains, each trained within ``max_staleness_steps`` of the weights that answered it (older
groups are dropped whole: ``train/staleness.py``; the capped importance ratio corrects the rest); a rollback
cancels what was drawn ahead, and a restart cancels its queued tasks as any other's.

Runners are in-process (``runners`` > 0: the configured agent, run by ``Runner`` against this backend's gateway) or
anywhere else that claims from the same gateway (``runners: 0``).

A loop may be killed at any moment and started again (``run`` resumes): nothing it decides lives only in memory.
The model resumes at its latest checkpoint, which also keeps the alarm's baseline (the last ``alarm.window`` steps'
means, written with the step, so never one step apart from it) and the off-policy members that trained (none joins
twice); the alarm is the audit trail's (``alarm.state``); the ladder's state is its deployments' and audit events'
(``ladder.py``); the pool is rebuilt (seed tasks, production episodes). The tasks an earlier run
queued (ids ``train:<name>:...``, ``eval:<name>:...``) and did not use are cancelled (``tasks.cancel``, one
``loop.cancel`` event): a runner's late result for one of them changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import secrets
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy.orm import Session

from flywheel.agents.dynamic_sampling import DynamicSampler, DynamicSamplingConfig, MixedGroups, NoMixedGroupsError
from flywheel.gateway.client import GroupQueue
from flywheel.gateway.queue import InProcessQueue
from flywheel.gateway.recorder import Gateway
from flywheel.gateway.runner import Runner, load_agent
from flywheel.gateway.schemas import TaskSpec
from flywheel.graders.scoring import sample_of
from flywheel.graders.stack import GraderStack, load_stack, score
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.loop import alarm as alarms
from flywheel.loop.alarm import AlarmPolicy, reward_hacking
from flywheel.loop.canary import CanaryPolicy, CanaryVerdict
from flywheel.loop.gate import GatePolicy, HeldOutSet
from flywheel.loop.ladder import REWIND, Candidate, PromotionLadder, Rewind
from flywheel.loop.offpolicy import OffPolicyDraw, OffPolicyStep, draw
from flywheel.loop.shadow import ShadowPolicy, ShadowVerdict
from flywheel.model import TrainableModel
from flywheel.pipeline import RolloutPipeline
from flywheel.store import Store, audit, grades, tasks
from flywheel.train.config import TrainConfig, TrainedWeights
from flywheel.types import TrajectoryGroup

log = logging.getLogger("flywheel.loop")

# an iteration's groups: (to train, every group drawn, the off-policy draw, what dynamic sampling drew)
Drawn = tuple[list[TrajectoryGroup], list[TrajectoryGroup], OffPolicyDraw | None, MixedGroups | None]


class LoopConfig(BaseModel):
    """``flywheel loop CONFIG`` (YAML or JSON); paths are relative to the config file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[^\s:/@]+$", max_length=200)  # the model's: no spaces, ':', '/' nor '@'
    project: str = "flywheel"
    base_model: str = EMBEDDED_MODEL
    trained_weights: TrainedWeights = Field(default_factory=TrainedWeights)
    agent: str  # the runner agent, "module:function" (async def agent(task, base_url) -> reward)
    runners: int = Field(4, ge=0)  # in-process runner concurrency; 0: runners run elsewhere
    stack: Path  # the grader stack
    heldout: Path  # JSON {"name": ..., "items": {id: item}}
    tasks: Path | None = None  # JSONL of seed tasks (objects with an "id"), before any production episode
    intake_split: str = "production"
    intake_limit: int = Field(1000, ge=0)  # the last N finished production episodes looked at
    group_size: int = Field(4, ge=2)
    groups_per_step: int = Field(4, ge=1)
    # DAPO's dynamic sampling: pool items are drawn, run and scored in waves until the step has groups_per_step
    # groups whose rewards differ (each item once a step; bounded by max_draws x groups_per_step and max_seconds);
    # None: groups_per_step items, trained as they come (a step whose groups all tie trains nothing)
    dynamic_sampling: DynamicSamplingConfig | None = None
    steps: int = Field(8, ge=1)  # iterations this run (one training step each, unless no group had varied rewards)
    candidate_every: int = Field(4, ge=1)
    eval_samples: int = Field(1, ge=1)
    train: TrainConfig = Field(default_factory=TrainConfig)
    gate: GatePolicy = Field(default_factory=GatePolicy)
    canary: CanaryPolicy = Field(default_factory=CanaryPolicy)
    shadow: ShadowPolicy | None = None  # set: a candidate that passes the gate is MODEL@shadow before MODEL@canary
    alarm: AlarmPolicy = Field(default_factory=AlarmPolicy)  # reward rising over flat holdout graders: no promotion
    max_wait: float = Field(1800.0, gt=0)  # seconds a step's groups may take
    # logged production episodes of a group's task that may join it as off-policy members (loop/offpolicy.py),
    # answered by a checkpoint at most max_staleness_steps before the step they train
    off_policy_members: int = Field(0, ge=0)
    max_staleness_steps: int = Field(2, ge=0)
    # the asynchronous pipeline: the groups of the next async_steps iterations are drawn while a step trains, each
    # at most max_staleness_steps stale (train.max_staleness_steps: set to it when unset; staler groups dropped
    # whole); 0: synchronous
    async_steps: int = Field(0, ge=0)
    # after a canary is rolled back or a shadow stopped, training goes on from production's weights (a new
    # checkpoint: PromotionLadder.rewind_if_due), not from the line of checkpoints that candidate came from
    rewind_on_rollback: bool = True
    # after each iteration delete the checkpoints nothing needs (LocalBackend.prune_checkpoints): superseded steps
    # and candidates decided against; the latest, the deployed ones and their rollback steps stay
    prune: bool = False
    seed: int = 0

    @model_validator(mode="after")
    def _corrected(self) -> LoopConfig:
        for field in ("off_policy_members", "async_steps"):
            if getattr(self, field) and self.train.importance_sampling_cap is None:
                raise ValueError(
                    f"{field} needs train.importance_sampling_cap: rollouts of an earlier checkpoint train only"
                    " with their importance ratio, capped"
                )
        if self.async_steps > self.max_staleness_steps:
            raise ValueError(
                f"async_steps ({self.async_steps}) is above max_staleness_steps ({self.max_staleness_steps}):"
                " groups drawn that far ahead would be too stale to train"
            )
        return self

    @property
    def train_config(self) -> TrainConfig:
        """``train``, bounded by ``max_staleness_steps`` where the pipeline runs ahead and it sets no bound."""
        if self.async_steps and self.train.max_staleness_steps is None:
            return self.train.model_copy(update={"max_staleness_steps": self.max_staleness_steps})
        return self.train

    @classmethod
    def load(cls, path: str | Path) -> LoopConfig:
        from flywheel.graders.spec import read_spec_file

        path = Path(path)
        data = read_spec_file(path)
        config = cls.model_validate(data)
        for field in ("stack", "heldout", "tasks"):
            value = getattr(config, field)
            if value is not None and not value.is_absolute():
                setattr(config, field, path.parent / value)
        return config


class LoopReport(BaseModel):
    steps: list[int]  # the model's step after each iteration (the same again when no group could train)
    intake: int  # tasks that came from production episodes
    candidates: list[Candidate]
    canary: list[CanaryVerdict]  # promotions and rollbacks of canaries, in order
    shadow: list[ShadowVerdict] = []  # shadows sent to canary or stopped, in order
    alarm: str | None = None  # why promotions are stopped, if the reward-hacking alarm is raised (at the end)
    cancelled: int = 0  # tasks an earlier run of the loop had left open, cancelled at the start
    off_policy: list[OffPolicyStep] = []  # per iteration, with off_policy_members: who joined, who was left out
    rewinds: list[Rewind] = []  # with rewind_on_rollback: training went back to production's weights
    # per iteration, with dynamic_sampling: the step it trained and the groups drawn, kept and dropped
    # (``MixedGroups.metrics``; also in the step's history row)
    sampling: list[dict[str, float]] = []
    # held-out items kept out of training (``Loop.excluded``), by source: seed tasks, production episodes at intake,
    # production episodes kept from joining a group as off-policy members
    excluded_heldout: dict[str, int] = {}


def item_id(item: dict[str, Any], fallback: str) -> str:
    value = item.get("id")
    return str(value) if value is not None else fallback


def item_hash(item: dict[str, Any]) -> str:
    """An item's content whatever its id: a hash of its canonical JSON without the ``id`` field (a held-out item
    copied under another id is still that item)."""
    content = {k: v for k, v in item.items() if k != "id"}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class Loop:
    def __init__(self, config: LoopConfig, backend: LocalBackend, *, actor: str = "loop"):
        self.config, self.backend, self.actor = config, backend, actor
        self.stack: GraderStack = load_stack(config.stack)
        self.heldout = HeldOutSet.model_validate_json(Path(config.heldout).read_text())
        self.model = TrainableModel(
            name=config.name,
            project=config.project,
            base_model=config.base_model,
            trained_weights=config.trained_weights,
        )
        # candidates up the ladder (gate, shadow, canary); nothing is promoted while the alarm is raised
        self.ladder = PromotionLadder(
            config, backend, self.model, self.stack, self.heldout, actor=actor, alarm=lambda: self.alarm
        )
        # the held-out items, by id and by content (``item_hash``): never trained on, or the gate would score items
        # the candidate learnt (the normal case when the held-out set was sampled from production traffic)
        self._heldout_ids = set(self.heldout.items) | {item_id(v, k) for k, v in self.heldout.items.items()}
        self._heldout_hashes = {item_hash(item) for item in self.heldout.items.values()}
        # what was kept out, by source: seed tasks (by pool key), production episodes at intake and off-policy
        # members (by episode id); each counted once however often it is read again
        self.excluded: dict[str, set[str]] = {"seed": set(), "intake": set(), "off_policy": set()}
        self.pool: dict[str, dict[str, Any]] = {}
        if config.tasks is not None:
            for n, line in enumerate(Path(config.tasks).read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    task = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{config.tasks} line {n}: not JSON ({exc})") from None
                if not isinstance(task, dict):
                    raise ValueError(f"{config.tasks} line {n}: a task is a JSON object, not {type(task).__name__}")
                key = item_id(task, f"seed-{n}")
                if self.is_heldout(key, task):
                    self.excluded["seed"].add(key)
                else:
                    self.pool[key] = task
            if self.excluded["seed"]:
                log.warning("%d seed task(s) are held-out items, left out of training: %s",
                            len(self.excluded["seed"]), sorted(self.excluded["seed"])[:10])  # fmt: skip
        self._rng = random.Random(config.seed)
        self.sampler = DynamicSampler(config.dynamic_sampling) if config.dynamic_sampling else None
        self.step_means: list[dict[str, float]] = []  # per training step: its step, reward and holdout graders' means
        self.alarm: str | None = None  # while raised (audit events: alarm.state), nothing is promoted
        self.production: dict[str, list[str]] = {}  # pool key -> its finished production episodes, oldest first
        self.off_policy_used: dict[str, int] = {}  # production episode -> its answering step, once it trained
        # ... and once an iteration drew it (an iteration drawn ahead, async_steps, takes none another drew)
        self.off_policy_drawn: dict[str, int] = {}

    @property
    def gateway(self) -> Gateway:
        assert self.backend.gateway is not None  # the loop registers its model, which starts the backend's server
        return self.backend.gateway

    @property
    def store(self) -> Store:
        return self.gateway.store

    def is_heldout(self, key: str, item: dict[str, Any]) -> bool:
        """Whether an item (under pool key ``key``) is a held-out one: its id, or its content under any id."""
        return key in self._heldout_ids or item_hash(item) in self._heldout_hashes

    def excluded_heldout(self) -> dict[str, int]:
        """How many held-out items were kept out of training, by source (``excluded``)."""
        return {source: len(kept) for source, kept in self.excluded.items()}

    async def intake(self) -> int:
        """Production episodes' items into the pool, held-out ones excluded (counted and logged); how many were
        new."""

        def read(s: Session) -> list[tuple[str, dict[str, Any], str]]:
            found = grades.recent_finished(s, split=self.config.intake_split, limit=self.config.intake_limit)
            return [(item_id(item, e.task_id), item, e.id) for e in found if (item := grades.item_of(s, e.id))]

        items = await self.store.run(read)
        self.production = {}
        for k, _, episode_id in items:
            self.production.setdefault(k, []).append(episode_id)
        heldout = {episode_id for k, item, episode_id in items if self.is_heldout(k, item)}
        if fresh := heldout - self.excluded["intake"]:
            log.warning("%d production episode(s) of held-out items left out of training", len(fresh))
            self.excluded["intake"] |= fresh
        # an item two episodes share: once
        new = {k: item for k, item, e in items if e not in heldout and k not in self.pool}
        self.pool.update(new)
        return len(new)

    def off_policy_candidates(self, keys: list[str]) -> dict[str, list[str]]:
        """The production episodes that may join the groups of pool keys ``keys`` as off-policy members: those of
        held-out items excluded (an episode under a pool item's id with a held-out item's content), counted."""
        candidates, kept = {}, []
        for key in keys:
            episodes = self.production.get(key, [])
            candidates[key] = [e for e in episodes if e not in self.excluded["intake"]]
            kept += [e for e in episodes if e in self.excluded["intake"]]
        if fresh := set(kept) - self.excluded["off_policy"]:
            log.warning(
                "%d production episode(s) of held-out items kept from joining as off-policy members", len(fresh)
            )
            self.excluded["off_policy"] |= fresh
        return candidates

    async def score_groups(self, groups: list[TrajectoryGroup], payloads: list[dict[str, Any]]) -> None:
        """The stack's reward on every trajectory (and its components as metrics); grades recorded."""
        recorded = []
        for group, payload in zip(groups, payloads, strict=True):
            for t in group.trajectories:
                result = await score(self.stack, sample_of(t), payload)
                t.reward = result.reward
                t.metrics.update(result.metrics())
                recorded.append((str(t.metadata["episode_id"]), result))

        def record(s: Session) -> None:
            for episode_id, result in recorded:
                result.record(s, episode_id)

        await self.store.run(record)

    @property
    def task_prefixes(self) -> tuple[str, str]:
        """What the ids of the tasks this loop queues start with: its training groups', its held-out evaluations'."""
        return f"train:{self.config.name}:", f"eval:{self.config.name}:"

    async def read_alarm(self) -> None:
        """The alarm as the audit trail has it (raised, or cleared: ``alarm.state``); the baseline drops the steps
        up to the latest clearing's."""
        found = await self.store.run(alarms.state, self.config.name)
        self.alarm = found.raised
        if found.cleared_at_step is not None:
            self.step_means = [row for row in self.step_means if row["step"] > found.cleared_at_step]

    async def check_alarm(self, groups: list[TrajectoryGroup], step: int = 0) -> str | None:
        """Record training step ``step``'s reward and holdout means; raise the reward-hacking alarm. Returns the
        alarm when this call raised it."""
        if (row := _means(groups, step)) is None:
            return None
        self.step_means.append(row)
        return await self._raise_alarm()

    async def _raise_alarm(self) -> str | None:
        """Raise the alarm (once: an audit event) when the recorded steps' reward rises over flat holdout graders."""
        if self.alarm is not None or (message := reward_hacking(self.step_means, self.config.alarm)) is None:
            return None
        self.alarm = message
        window = self.step_means[-self.config.alarm.window :]
        await self.store.run(
            audit.append, actor=self.actor, action=alarms.RAISED, subject=self.config.name,
            reason=f"reward hacking suspected: {message}; promotions stopped",
            details={"message": message, "step": int(window[-1]["step"]), "steps": window},
        )  # fmt: skip
        log.warning("reward hacking suspected: %s; promotions stopped", message)
        return message

    async def resume(self) -> list[str]:
        """Take up the state an earlier run of this loop (its name) left: the alarm's baseline from the latest
        checkpoint, the alarm from the audit trail (raised now if the baseline raises it: that run was killed
        before it recorded it), and its tasks that are still open cancelled (one ``loop.cancel`` event). Returns
        the cancelled tasks' ids."""
        name = self.config.name
        saved = (await self.model.checkpoint_extra()).get("loop") or {}
        self.step_means = list(saved.get("means", []))
        self.off_policy_used = {k: int(v) for k, v in (saved.get("off_policy") or {}).items()}
        await self.read_alarm()
        await self._raise_alarm()
        reason = f"cancelled: an earlier run of the loop {name} queued it and stopped before it used its group"

        def cancel(s: Session) -> list[str]:
            cancelled = [task for prefix in self.task_prefixes for task in tasks.cancel(s, prefix, reason)]
            if cancelled:
                audit.append(
                    s, actor=self.actor, action="loop.cancel", subject=name,
                    reason=f"{len(cancelled)} task(s) an earlier run left open cancelled",
                    details={"tasks": cancelled[:100], "count": len(cancelled)},
                )  # fmt: skip
            return cancelled

        cancelled = await self.store.run(cancel)
        if cancelled:
            log.info("cancelled %d task(s) an earlier run of %s left open", len(cancelled), name)
        return cancelled

    async def rewind_if_due(self) -> Rewind | None:
        """After a rollback, training goes on from production's weights (``PromotionLadder.rewind_if_due``: a new
        checkpoint that keeps the off-policy members that trained); the alarm's baseline starts again after it (its
        steps trained other weights)."""
        rewind = await self.ladder.rewind_if_due(self.off_policy_used)
        if rewind is not None:
            self.step_means = []
        return rewind

    def specs(self, step: int) -> list[TaskSpec]:
        """The groups of the iteration that trains step ``step`` + 1: ``groups_per_step`` pool items (the seed's
        draw)."""
        chosen = self._rng.sample(sorted(self.pool), min(self.config.groups_per_step, len(self.pool)))
        return [self.spec(step, k) for k in chosen]

    def spec(self, step: int, key: str) -> TaskSpec:
        """Pool item ``key``'s group in the iteration that trains step ``step`` + 1. Its id carries a random part of
        its own: no run queues a task id an earlier run did."""
        config = self.config
        return TaskSpec(task_id=f"{self.task_prefixes[0]}{step + 1}:{key}:{secrets.token_hex(4)}",
                        payload=self.pool[key], group_size=config.group_size, split="train", model=config.name)  # fmt: skip

    async def draw_mixed(
        self, queue: GroupQueue, step: int, sampler: DynamicSampler
    ) -> tuple[list[TaskSpec], MixedGroups]:
        """Dynamic sampling for the iteration that trains step ``step`` + 1: pool items in the seed's order, each
        at most once, run and scored in waves (``DynamicSampler``) until ``groups_per_step`` groups have rewards
        that differ. The kept groups' specs (in their order) and what was drawn; ``NoMixedGroupsError`` when the
        pool ran dry with none kept."""
        config = self.config
        order = self._rng.sample(sorted(self.pool), len(self.pool))
        specs: dict[int, TaskSpec] = {}

        async def run(key: str) -> TrajectoryGroup:
            spec = self.spec(step, key)
            (group,) = await queue.gather_groups([spec], max_wait=config.max_wait, allow_failed=True)
            await self.score_groups([group], [spec.payload])
            specs[id(group)] = spec
            return group

        # a failed attempt is no exception here: the group has one trajectory fewer (allow_failed)
        mixed = await sampler.draw(
            (run(k) for k in order), config.groups_per_step, pbar_desc=None, max_exceptions=math.inf
        )
        return [specs[id(g)] for g in mixed.kept], mixed

    async def draw_groups(self, queue: GroupQueue, step: int) -> Drawn:
        """The iteration's groups, scored, with their off-policy members (``join_off_policy``), as
        ``(to train, every group drawn, the off-policy draw, what dynamic sampling drew)``."""
        if self.sampler is None:
            specs = self.specs(step)
            groups = await queue.gather_groups(specs, max_wait=self.config.max_wait, allow_failed=True)
            joined = await self.join_off_policy(specs, groups, step)
            await self.score_groups(groups, [spec.payload for spec in specs])
            return groups, groups, joined, None
        try:
            specs, mixed = await self.draw_mixed(queue, step, self.sampler)
        except NoMixedGroupsError as exc:
            log.warning("step %d: %s", step + 1, exc)
            return [], [], None, None
        members = [len(g.trajectories) for g in mixed.kept]
        joined = await self.join_off_policy(specs, mixed.kept, step)
        # the members who joined, scored (the groups' own rollouts were, as they were drawn)
        late = [TrajectoryGroup(trajectories=g.trajectories[n:]) for g, n in zip(mixed.kept, members, strict=True)]
        await self.score_groups(late, [spec.payload for spec in specs])
        return mixed.kept, mixed.kept + mixed.dropped, joined, mixed

    async def join_off_policy(
        self, specs: list[TaskSpec], groups: list[TrajectoryGroup], step: int
    ) -> OffPolicyDraw | None:
        """Logged production episodes of each group's task join it (at most ``off_policy_members`` each) as
        off-policy members of the iteration that trains step ``step`` + 1 (``loop/offpolicy.py``); None when the
        loop takes none."""
        config = self.config
        if not config.off_policy_members:
            return None
        prefix = f"{self.task_prefixes[0]}{step + 1}:"  # a spec's id: <prefix><pool key>:<random part>
        keys = [spec.task_id.removeprefix(prefix).rpartition(":")[0] for spec in specs]
        candidates = self.off_policy_candidates(keys)

        def read(s: Session) -> OffPolicyDraw:
            # staleness along the checkpoints' line: where each rewind went back to
            events = audit.events(s, subject=config.name, actions=(REWIND,))
            return draw(
                s, candidates, keys, model=config.name, base_model=config.base_model, step=step,
                per_group=config.off_policy_members, max_staleness=config.max_staleness_steps,
                used=self.off_policy_used | self.off_policy_drawn, rewinds={e.details["step"]: e.details["to_step"] or 0 for e in events},
            )  # fmt: skip

        found = await self.store.run(read)
        self.off_policy_drawn |= found.answered
        for key, group in zip(keys, groups, strict=True):
            group.trajectories.extend(found.members[key])
        log.info("step %d: %d off-policy member(s) joined; left out: %s", step + 1, len(found.answered),
                 found.left_out or "none")  # fmt: skip
        return found

    async def run(self) -> LoopReport:
        """``steps`` iterations; a run after an earlier one of the same loop (killed or not) first ``resume``s."""
        config = self.config
        await self.model.register(self.backend)
        await self.store.run(self.stack.register, actor=self.actor)
        cancelled = await self.resume()
        root = self.backend.base_url.removesuffix("/v1")
        runners = []
        if config.runners:
            agent = load_agent(config.agent)
            runners.append(asyncio.create_task(Runner(root, agent, concurrency=config.runners).run()))
        report = LoopReport(steps=[], intake=0, candidates=[], canary=[], cancelled=len(cancelled))

        def iteration_groups(j: int) -> Awaitable[Drawn]:
            """Iteration ``j``'s groups, for the step it trains: ``j - n`` steps after the model's step at the
            iteration ``n`` running when ``j`` is started (``offset``: that step - n)."""
            return self.draw_groups(queue, offset + j)

        pipeline = RolloutPipeline(iteration_groups, async_steps=config.async_steps, stop=config.steps)
        try:
            queue = InProcessQueue(self.gateway, root)
            for n in range(config.steps):
                await self.read_alarm()  # a clearing (flywheel loop --clear-alarm) counts from the next iteration
                # first the checkpoint a killed run trained and did not decide: it would have been, before this
                if (candidate := await self.ladder.consider_due(queue)) is not None:
                    report.candidates.append(candidate)
                    report.shadow.extend([candidate.shadow] if candidate.shadow else [])
                if (canary := await self.ladder.watch_canary()) is not None and canary.action != "wait":
                    report.canary.append(canary)
                if (shadow := await self.ladder.watch_shadow()) is not None and shadow.action != "wait":
                    report.shadow.append(shadow)
                if (rewind := await self.rewind_if_due()) is not None:  # before anything trains again
                    report.rewinds.append(rewind)
                    await pipeline.aclose()  # what was drawn ahead came from the weights rolled back
                report.intake += await self.intake()
                if not self.pool:
                    raise ValueError("no tasks to train on: give seed tasks (tasks:) or let production episodes in")
                step = await self.model.get_step()
                offset, started = step - n, time.monotonic()
                _, (groups, drawn, joined, mixed) = await anext(pipeline)  # the next ones drawn while this trains
                # the alarm's baseline goes with the checkpoint: a restart resumes both at the same step; its
                # reward is every group drawn's (the kept ones alone lean to one half)
                row = _means(drawn, step + 1)
                kept = ([*self.step_means, row] if row else self.step_means)[-config.alarm.window :]
                trainable = [g for g in groups if g.trajectories]
                # off-policy members join once: kept with the checkpoint until they would be stale anyway
                used = joined.used if joined else self.off_policy_used
                sampled = mixed.metrics() if mixed is not None else None
                metrics = await self.model.train(
                    trainable, config=config.train_config, extra={"loop": {"means": kept, "off_policy": used}},
                    metrics=sampled,
                )  # fmt: skip
                trained = await self.model.get_step()  # unchanged when every group's rewards were equal
                if sampled is not None:
                    report.sampling.append({"step": float(trained), **sampled})
                if joined is not None:
                    report.off_policy.append(
                        OffPolicyStep(
                            step=trained, joined=len(joined.answered), episodes=sorted(joined.answered),
                            left_out=joined.left_out, is_ratio_mean=metrics.get("off_policy_is_ratio_mean"),
                        )
                    )  # fmt: skip
                report.steps.append(trained)
                log.info("step %d: reward %.3f (%.0f s)", trained, _mean_reward(drawn), time.monotonic() - started)
                if trained > step:
                    await self.check_alarm(drawn, trained)
                    self.off_policy_used = used
                if (candidate := await self.ladder.consider_due(queue)) is not None:
                    report.candidates.append(candidate)
                    report.shadow.extend([candidate.shadow] if candidate.shadow else [])
                if config.prune:  # the latest, the deployed (and their rollback steps) and a KL reference stay
                    await self.backend.prune_checkpoints(self.model, keep=[config.train.kl_reference_step or 0])
        finally:
            await pipeline.aclose()  # a restart cancels their queued tasks (``resume``): nothing of them trains
            for task in runners:
                task.cancel()
        report.alarm = self.alarm
        report.excluded_heldout = self.excluded_heldout()
        return report


def _means(groups: list[TrajectoryGroup], step: int) -> dict[str, float] | None:
    """A training step's row for the alarm: its step, the reward's mean and each holdout grader's; None without
    trajectories."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories:
        return None
    row = {"step": float(step), "reward": _mean_reward(groups)}
    for key in {k for t in trajectories for k in t.metrics if k.startswith("stack/holdout/")}:
        values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
        row[key.removeprefix("stack/")] = sum(values) / len(values)
    return row


def _mean_reward(groups: list[TrajectoryGroup]) -> float:
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / len(rewards) if rewards else 0.0
