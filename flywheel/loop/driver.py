"""The flywheel loop: production episodes in, a gated candidate out.

Each step: new finished production episodes' items join the task pool (deduplicated by item id); groups of tasks are
queued for the gateway's runners against the model's live weights; every episode is scored by the grader stack
(its grades recorded under the stack's version) and the groups train one step. Every ``candidate_every`` steps the
latest checkpoint is a candidate: it and production (``MODEL@production``, or the base model before any promotion)
run the frozen held-out set through the same runners, the gate decides (``gate.decide``), the decision is an audit
event linking its evidence, and a candidate that passes is deployed as ``MODEL@canary`` with a share of traffic.

Runners are in-process (``runners`` > 0: the configured agent, run by ``Runner`` against this backend's gateway) or
anywhere else that claims from the same gateway (``runners: 0``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flywheel.backend import LocalBackend
from flywheel.gateway.client import QueueClient, TaskSpec
from flywheel.gateway.runner import Runner, load_agent
from flywheel.graders.regress import last_sample
from flywheel.graders.rewards import sample_of
from flywheel.graders.stack import GraderStack, StackScore, load_stack, score
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.loop.alarm import AlarmPolicy, reward_hacking
from flywheel.loop.canary import CanaryPolicy, CanaryVerdict, Scored, verdict
from flywheel.loop.evaluate import evaluate
from flywheel.loop.gate import GateDecision, GatePolicy, HeldOutSet, decide
from flywheel.model import TrainableModel
from flywheel.store import audit, deployments
from flywheel.store import episodes as db
from flywheel.store import grades as gdb
from flywheel.store.arms import Arm, ArmEpisode, arms
from flywheel.train.config import TrainConfig, TrainedWeights
from flywheel.types import TrajectoryGroup

log = logging.getLogger("flywheel.loop")


class LoopConfig(BaseModel):
    """``flywheel loop CONFIG`` (YAML or JSON); paths are relative to the config file."""

    model_config = ConfigDict(extra="forbid")

    name: str
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
    steps: int = Field(8, ge=1)  # iterations this run (one training step each, unless no group had varied rewards)
    candidate_every: int = Field(4, ge=1)
    eval_samples: int = Field(1, ge=1)
    train: TrainConfig = Field(default_factory=TrainConfig)
    gate: GatePolicy = Field(default_factory=GatePolicy)
    canary: CanaryPolicy = Field(default_factory=CanaryPolicy)
    alarm: AlarmPolicy = Field(default_factory=AlarmPolicy)  # reward rising over flat holdout graders: no promotion
    max_wait: float = Field(1800.0, gt=0)  # seconds a step's groups may take
    seed: int = 0

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


class Candidate(BaseModel):
    step: int
    production: str  # what it was compared with
    decision: GateDecision
    event_id: int  # the audit event recording the decision
    deployed: str | None  # MODEL@canary when it passed


class LoopReport(BaseModel):
    steps: list[int]  # the model's step after each iteration (the same again when no group could train)
    intake: int  # tasks that came from production episodes
    candidates: list[Candidate]
    canary: list[CanaryVerdict]  # promotions and rollbacks of canaries, in order
    alarm: str | None = None  # why promotions stopped, if the reward-hacking alarm was raised


def item_id(item: dict[str, Any], fallback: str) -> str:
    value = item.get("id")
    return str(value) if value is not None else fallback


class Loop:
    def __init__(self, config: LoopConfig, backend: LocalBackend, *, actor: str = "loop"):
        self.config, self.backend, self.actor = config, backend, actor
        self.stack: GraderStack = load_stack(config.stack)
        self.heldout = HeldOutSet.model_validate_json(Path(config.heldout).read_text())
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
                self.pool[item_id(task, f"seed-{n}")] = task
        self._rng = random.Random(config.seed)
        self.step_means: list[dict[str, float]] = []  # per iteration: reward and holdout graders' means
        self.alarm: str | None = None  # once raised, nothing is promoted
        self._scores: dict[str, StackScore] = {}  # production episodes the canary watch scored, by id
        self.model = TrainableModel(
            name=config.name,
            project=config.project,
            base_model=config.base_model,
            trained_weights=config.trained_weights,
        )

    @property
    def store(self):
        return self.backend.gateway.store

    def intake(self) -> int:
        """Production episodes' items into the pool; how many were new."""
        with self.store.session() as s:
            found = gdb.recent_finished(s, split=self.config.intake_split, limit=self.config.intake_limit)
            items = [(item_id(item, e.task_id), item) for e in found if (item := gdb.item_of(s, e.id))]
        new = [(k, item) for k, item in items if k not in self.pool]
        self.pool.update(new)
        return len(new)

    async def score_groups(self, groups: list[TrajectoryGroup], payloads: list[dict[str, Any]]) -> None:
        """The stack's reward on every trajectory (and its components as metrics); grades recorded."""
        recorded = []
        for group, payload in zip(groups, payloads, strict=True):
            for t in group.trajectories:
                result = await score(self.stack, sample_of(t), payload)
                t.reward = result.reward
                t.metrics.update(result.metrics())
                recorded.append((str(t.metadata["episode_id"]), result))

        def record() -> None:
            with self.store.session() as s:
                for episode_id, result in recorded:
                    result.record(s, episode_id)

        await asyncio.to_thread(record)

    async def production_name(self) -> str:
        """What a candidate is compared with: the production deployment, else the base model (served for it)."""
        alias = f"{self.config.name}@production"
        with self.store.session() as s:
            if deployments.find(s, alias) is not None:
                return alias
        await self.backend.load(self.config.base_model)
        return self.config.base_model

    async def consider(self, queue: QueueClient, step: int) -> Candidate:
        """Evaluate checkpoint ``step`` against production on the held-out set; the gate decides; audited."""
        production = await self.production_name()
        name = self.model.get_inference_name(step)
        runs = [
            await evaluate(queue, self.heldout, model, self.stack, samples=self.config.eval_samples,
                           max_wait=self.config.max_wait, store=self.store, actor=self.actor)
            for model in (name, production)
        ]  # fmt: skip
        decision = decide(runs[0].results, runs[1].results, self.config.gate)
        log.info("candidate %s vs %s: %s", name, production, "promote" if decision.promote else "hold")
        failed = ", ".join(f"{c.name}: {c.detail}" for c in decision.failed)
        with self.store.session() as s:
            event = audit.append(
                s,
                actor=self.actor,
                action="gate.pass" if decision.promote else "gate.hold",
                subject=name,
                reason=(f"lift {decision.lift.mean:+.3f} [{decision.lift.low:+.3f}, {decision.lift.high:+.3f}]"
                        + (f"; failed {failed}" if failed else ""))[:2000],
                details={
                    "candidate": name, "production": production, "heldout": runs[0].heldout,
                    "stack": self.stack.version, "evaluations": [r.id for r in runs],
                    "lift": decision.lift.model_dump(), "checks": [c.model_dump() for c in decision.checks],
                },
            )  # fmt: skip
            deployed = None
            if decision.promote:
                # the first deployment has no production traffic to split: it becomes production, gated all the same
                first = production == self.config.base_model
                deployed = f"{self.config.name}@{'production' if first else 'canary'}"
                deployments.deploy(
                    s, deployed, step, actor=self.actor, share=None if first else self.config.canary.share,
                    reason=f"passed the gate (audit event {event.id})"
                    + ("; the first production deployment" if first else ""),
                    details={"gate_event": event.id},
                )  # fmt: skip
        return Candidate(step=step, production=production, decision=decision, event_id=event.id, deployed=deployed)

    def _finished(self, arm: Arm | None) -> list[ArmEpisode]:
        """An arm's finished production episodes (not the held-out evaluations, which call the aliases too)."""
        split = self.config.intake_split
        return [e for e in (arm.episodes if arm else []) if e.status == "finished" and e.split == split]

    def check_alarm(self, groups: list[TrajectoryGroup]) -> str | None:
        """Record an iteration's reward and holdout means; raise the reward-hacking alarm (once: an audit event)
        when the reward rises over flat holdout graders. Returns the alarm when this iteration raised it."""
        trajectories = [t for g in groups for t in g.trajectories]
        if not trajectories:
            return None
        row = {"reward": _mean_reward(groups)}
        for key in {k for t in trajectories for k in t.metrics if k.startswith("stack/holdout/")}:
            values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
            row[key.removeprefix("stack/")] = sum(values) / len(values)
        self.step_means.append(row)
        if self.alarm is not None or (message := reward_hacking(self.step_means, self.config.alarm)) is None:
            return None
        self.alarm = message
        with self.store.session() as s:
            audit.append(
                s, actor=self.actor, action="loop.alarm", subject=self.config.name,
                reason=f"reward hacking suspected: {message}; promotions stopped",
                details={"steps": self.step_means[-self.config.alarm.window :]},
            )  # fmt: skip
        log.warning("reward hacking suspected: %s; promotions stopped", message)
        return message

    async def watch_canary(self) -> CanaryVerdict | None:
        """If ``MODEL@canary`` serves: score both arms since its deployment; promote it, roll it back, or wait
        (``canary.verdict``). A promotion or rollback is audited with its evidence. None without a canary."""
        name, policy = self.config.name, self.config.canary
        with self.store.session() as s:
            canary = deployments.find(s, f"{name}@canary")
            if canary is None:
                return None
            report = arms(s, name, since_event=canary.event_id)
            sides = {side: self._finished(report.arms.get(f"{name}@{side}")) for side in ("canary", "production")}
            # a finished episode's answer does not change: each is scored once (its feedback is read every time)
            new = {e.id for side in sides.values() for e in side} - self._scores.keys()
            inputs = {i: (last_sample(db.calls(s, i)), gdb.item_of(s, i)) for i in sorted(new)}
        for episode_id, (sample, item) in inputs.items():
            self._scores[episode_id] = await score(self.stack, sample, item)

        def scored(side: str) -> list[Scored]:
            out = []
            for e in sides[side]:
                result = self._scores[e.id]
                values = e.feedback.get(policy.kpi, []) if policy.kpi else [result.reward]
                out.append(Scored(episode_id=e.id, kpi=sum(values) / len(values) if values else None, safe=result.safe))
            return out

        found = verdict(scored("canary"), scored("production"), policy)
        if found.action == "promote" and self.alarm is not None:
            found = found.model_copy(update={"action": "wait", "reason": f"promotion paused: {self.alarm}"})
        if found.action == "wait":
            return found
        with self.store.session() as s:
            event = audit.append(
                s, actor=self.actor, action=f"canary.{found.action}", subject=f"{name}@canary", reason=found.reason,
                details=found.model_dump() | {"step": canary.step, "deploy_event": canary.event_id},
            )  # fmt: skip
            if found.action == "promote":
                deployments.promote(s, name, actor=self.actor, reason=f"{found.reason} (audit event {event.id})")
            deployments.remove(
                s, f"{name}@canary", actor=self.actor, reason=f"canary {found.action}d (audit event {event.id})"
            )
        log.info("canary %s@%d: %s (%s)", name, canary.step, found.action, found.reason)
        return found

    async def run(self) -> LoopReport:
        config = self.config
        await self.model.register(self.backend)
        with self.store.session() as s:
            self.stack.register(s, actor=self.actor)
        root = self.backend.base_url.removesuffix("/v1")
        runners = []
        if config.runners:
            agent = load_agent(config.agent)
            runners.append(asyncio.create_task(Runner(root, agent, concurrency=config.runners).run()))
        report = LoopReport(steps=[], intake=0, candidates=[], canary=[])
        try:
            async with QueueClient(root) as queue:
                considered = await self.model.get_step()  # a candidate needs steps taken since
                for _ in range(config.steps):
                    if (canary := await self.watch_canary()) is not None and canary.action != "wait":
                        report.canary.append(canary)
                    report.intake += self.intake()
                    if not self.pool:
                        raise ValueError("no tasks to train on: give seed tasks (tasks:) or let production episodes in")
                    step = await self.model.get_step()
                    chosen = self._rng.sample(sorted(self.pool), min(config.groups_per_step, len(self.pool)))
                    specs = [
                        TaskSpec(task_id=f"train:{config.name}:{step + 1}:{k}:{self._rng.getrandbits(32):08x}",
                                 payload=self.pool[k], group_size=config.group_size, split="train", model=config.name)
                        for k in chosen
                    ]  # fmt: skip
                    started = time.monotonic()
                    groups = await queue.gather_groups(specs, max_wait=config.max_wait, allow_failed=True)
                    await self.score_groups(groups, [self.pool[k] for k in chosen])
                    await self.model.train([g for g in groups if g.trajectories], config=config.train)
                    step = await self.model.get_step()  # unchanged when every group's rewards were equal
                    report.steps.append(step)
                    log.info("step %d: reward %.3f (%.0f s)", step, _mean_reward(groups), time.monotonic() - started)
                    if (raised := self.check_alarm(groups)) is not None:
                        report.alarm = raised
                    if step > considered and step % config.candidate_every == 0 and self.alarm is None:
                        considered = step
                        report.candidates.append(await self.consider(queue, step))
        finally:
            for task in runners:
                task.cancel()
        return report


def _mean_reward(groups: list[TrajectoryGroup]) -> float:
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / len(rewards) if rewards else 0.0
