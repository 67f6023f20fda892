"""The flywheel loop: production episodes in, a gated candidate out.

Each step: new finished production episodes' items join the task pool (deduplicated by item id; held-out items,
by id or by content, never do, nor seed tasks that are held-out items, nor their episodes as off-policy members:
``Loop.is_heldout``, counted in the report's ``excluded_heldout``); groups of tasks are
queued for the gateway's runners against the model's live weights; with ``off_policy_members``, logged production
episodes of a group's item join it as off-policy members (``offpolicy.py``: their sampler log-probs, the truncated
importance ratio, left out when stale or without token ids); every episode is scored by the grader stack (its grades
recorded under the stack's version) and the groups train one step. Every ``candidate_every`` steps the
latest checkpoint is a candidate: it and production (the checkpoint ``MODEL@production`` points at, by its own name,
not the alias a canary shares; or the base model before any promotion) run the frozen held-out set through the same runners, the gate decides (``gate.decide``), the decision is an audit
event linking its evidence, and a candidate that passes is deployed as ``MODEL@canary`` with a share of traffic;
with a ``shadow`` stage it is ``MODEL@shadow`` first (a share of production's calls mirrored to it, its answers
never returned), and once ``min_pairs`` of its episodes are paired with their production originals and scored, it
goes to canary or is stopped (``shadow.py``; a ``shadow.pass`` or ``shadow.stop`` event with the evidence). A newer
candidate that passes replaces a shadow still pairing (``shadow.replace``, with its pairs so far) and never a canary
being watched: with a shadow stage it waits in shadow, without one it is held (``Loop._stage`` says why). After a
canary is rolled back or a shadow stopped, training goes on from production's weights (``rewind_on_rollback``,
``Loop.rewind_if_due``: a new checkpoint and a ``loop.rewind`` event), not from the rejected candidate's line.

Runners are in-process (``runners`` > 0: the configured agent, run by ``Runner`` against this backend's gateway) or
anywhere else that claims from the same gateway (``runners: 0``).

A loop may be killed at any moment and started again (``run`` resumes): nothing it decides lives only in memory.
The model resumes at its latest checkpoint, which also keeps the alarm's baseline (the last ``alarm.window`` steps'
means, written with the step, so never one step apart from it) and the off-policy members that trained (none joins
twice); the alarm is the audit trail's (``alarm.state``);
a checkpoint is due at the gate while no ``gate.*`` event names it, so a candidate the killed run trained but did
not decide is decided first, and none twice; the pool is rebuilt (seed tasks, production episodes) and the canary's
and shadow's scores recomputed (a shadow's verdict, the canary it deploys and the shadow's removal are one unit of
work; so are a gate decision, the shadow it replaces and the deployment). A rewind's checkpoint carries its event's
details, so a restart writes a missing ``loop.rewind`` event and never rewinds twice. The tasks an earlier run
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.agents.dynamic_sampling import DynamicSampler, DynamicSamplingConfig, MixedGroups, NoMixedGroupsError
from flywheel.gateway.client import QueueClient, TaskSpec
from flywheel.gateway.runner import Runner, load_agent
from flywheel.graders.regress import last_sample
from flywheel.graders.rewards import sample_of
from flywheel.graders.stack import GraderStack, StackScore, load_stack, score
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.loop import alarm as alarms
from flywheel.loop.alarm import AlarmPolicy, reward_hacking
from flywheel.loop.canary import CanaryPolicy, CanaryVerdict, Scored, verdict
from flywheel.loop.evaluate import HeldOutRun, evaluate
from flywheel.loop.gate import GateDecision, GatePolicy, HeldOutSet, decide_look
from flywheel.loop.offpolicy import OffPolicyDraw, OffPolicyStep, draw
from flywheel.loop.shadow import Pair, ShadowPolicy, ShadowVerdict
from flywheel.loop.shadow import verdict as shadow_verdict
from flywheel.model import TrainableModel
from flywheel.store import audit, deployments, tasks
from flywheel.store import episodes as db
from flywheel.store import grades as gdb
from flywheel.store.arms import Arm, ArmEpisode, arms
from flywheel.train.config import TrainConfig, TrainedWeights
from flywheel.types import TrajectoryGroup

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger("flywheel.loop")
GATE_ACTIONS = ("gate.pass", "gate.hold")  # a checkpoint's decision: one per step
ROLLBACKS = ("canary.rollback", "shadow.stop")  # a candidate judged worse or unsafe on live traffic
REWIND = "loop.rewind"  # training went back to production's weights after one (Loop.rewind_if_due)


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
    # after a canary is rolled back or a shadow stopped, training goes on from production's weights (a new
    # checkpoint: Loop.rewind_if_due), not from the line of checkpoints that candidate came from
    rewind_on_rollback: bool = True
    # after each iteration delete the checkpoints nothing needs (LocalBackend.prune_checkpoints): superseded steps
    # and candidates decided against; the latest, the deployed ones and their rollback steps stay
    prune: bool = False
    seed: int = 0

    @model_validator(mode="after")
    def _corrected(self) -> LoopConfig:
        if self.off_policy_members and self.train.importance_sampling_cap is None:
            raise ValueError(
                "off_policy_members needs train.importance_sampling_cap: an earlier checkpoint's episodes train"
                " only with their importance ratio, capped"
            )
        return self

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
    deployed: str | None  # MODEL@shadow (with a shadow stage) or MODEL@canary when it passed
    held: str | None = None  # why one that passed was not deployed (a canary was being watched)
    shadow: ShadowVerdict | None = None  # the verdict an older shadow got first (its evidence decided it)


class RewindError(RuntimeError):
    """Production's checkpoint, which training should go on from after a rollback, is gone."""


class Rewind(BaseModel):
    """A ``loop.rewind``: training went on from production's weights as checkpoint ``step``."""

    step: int  # the new checkpoint, with production's weights and a fresh optimizer
    from_step: int  # the live step it replaced (the rolled-back candidate's line)
    to_step: int | None  # production's step; None: the base model (no production deployment)
    production: str
    rollback_event: int  # the latest canary.rollback / shadow.stop it answers
    rollback_events: list[int]  # every one it answers
    event_id: int = 0  # the loop.rewind event


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
        if self.stack.safety is None:
            log.warning(
                "the grader stack %s has no safety grader: %s", self.stack.name,
                "candidates are promoted with safety not checked (gate.require_safety is off)"
                if not config.gate.require_safety else "the gate promotes nothing (gate.require_safety)",
            )  # fmt: skip
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
        self._scores: dict[str, StackScore] = {}  # production episodes the canary watch scored, by id
        # shadow episodes the shadow watch paired and scored, by the shadow's deploy event and id (one shadow episode
        # per production episode: its calls may come from two shadows deployed one after the other)
        self._pairs: dict[tuple[int, str], Pair] = {}
        # shadow episodes whose finished original had other last messages (the mirror missed its last call), by the
        # same key -> their calls then: read again only once a late mirror has added one
        self._unpaired: dict[tuple[int, str], int] = {}
        self.production: dict[str, list[str]] = {}  # pool key -> its finished production episodes, oldest first
        self.off_policy_used: dict[str, int] = {}  # production episode -> its answering step, once it trained
        self.model = TrainableModel(
            name=config.name,
            project=config.project,
            base_model=config.base_model,
            trained_weights=config.trained_weights,
        )

    @property
    def store(self):
        return self.backend.gateway.store

    def is_heldout(self, key: str, item: dict[str, Any]) -> bool:
        """Whether an item (under pool key ``key``) is a held-out one: its id, or its content under any id."""
        return key in self._heldout_ids or item_hash(item) in self._heldout_hashes

    def excluded_heldout(self) -> dict[str, int]:
        """How many held-out items were kept out of training, by source (``excluded``)."""
        return {source: len(kept) for source, kept in self.excluded.items()}

    def intake(self) -> int:
        """Production episodes' items into the pool, held-out ones excluded (counted and logged); how many were
        new."""
        with self.store.session() as s:
            found = gdb.recent_finished(s, split=self.config.intake_split, limit=self.config.intake_limit)
            items = [(item_id(item, e.task_id), item, e.id) for e in found if (item := gdb.item_of(s, e.id))]
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

        def record() -> None:
            with self.store.session() as s:
                for episode_id, result in recorded:
                    result.record(s, episode_id)

        await asyncio.to_thread(record)

    async def production_name(self) -> str:
        """What a candidate is compared with: the checkpoint the production deployment points at (``MODEL@<step>``,
        which the backend serves), never the alias (``MODEL@production`` sends a canary's share of episodes to the
        canary); else the base model (served for it)."""
        with self.store.session() as s:
            production = deployments.find(s, f"{self.config.name}@production")
        if production is not None:
            return production.target
        await self.backend.load(self.config.base_model)
        return self.config.base_model

    def look(self) -> int:
        """The gate's next look: 1 + its decisions since production last changed (the production deployment's
        latest event; every decision of this model before there is one). Each look spends part of the gate's
        lifetime error budget (``gate.levels``), so a candidate no better than production is rarely promoted
        however often the loop asks."""
        name = self.config.name
        with self.store.session() as s:
            production = deployments.find(s, f"{name}@production")
            after = production.event_id if production is not None else 0
            return 1 + audit.count_events(s, actions=GATE_ACTIONS, subject_prefix=f"{name}@", after=after)

    async def consider(self, queue: QueueClient, step: int) -> Candidate:
        """Evaluate checkpoint ``step`` against production on the held-out set; the gate decides (``settle``). A
        candidate that passes the look's screen is evaluated again, both sides afresh (``gate.decide_look``)."""
        production, look = await self.production_name(), self.look()
        name = self.model.get_inference_name(step)

        async def both() -> tuple[HeldOutRun, HeldOutRun]:
            # both sides warmed up, then their items interleaved: their latencies are comparable (``evaluate``)
            candidate, current = await evaluate(
                queue, self.heldout, [name, production], self.stack, samples=self.config.eval_samples,
                max_wait=self.config.max_wait, store=self.store, actor=self.actor, prefix=f"eval:{self.config.name}",
            )  # fmt: skip
            return candidate, current

        first = await both()
        greedy = first[0].greedy and first[1].greedy  # a repeat gives nothing new: decided without one
        screen = decide_look(self.config.gate, look, (first[0].results, first[1].results), deterministic=greedy)
        again = await both() if screen.needs_confirmation else None
        return await self.settle(step, production, *first, again=again, look=look)

    async def settle(
        self,
        step: int,
        production: str,
        candidate: HeldOutRun,
        current: HeldOutRun,
        *,
        again: tuple[HeldOutRun, HeldOutRun] | None = None,
        look: int | None = None,
    ) -> Candidate:
        """The gate's decision on checkpoint ``step``'s held-out run and production's (and, for a candidate that
        passed the screen, ``again``: both sides' fresh runs), at look ``look`` (default: the next, ``look()``),
        audited. One that passes is deployed (``_stage``) in the decision's unit of work: production if there is
        none yet, else the shadow (replacing an older one still pairing: a ``shadow.replace`` event with its pairs
        so far, after that shadow's own verdict, if its evidence already decides it) or, without a shadow stage,
        the canary, unless one is being watched: then it is held (the gate event says why)."""
        name, runs = self.model.get_inference_name(step), (candidate, current, *(again or ()))
        look = self.look() if look is None else look
        fresh = None if again is None else (again[0].results, again[1].results)
        deterministic = candidate.greedy and current.greedy
        decision = decide_look(
            self.config.gate, look, (candidate.results, current.results), fresh, deterministic=deterministic
        )
        log.info("candidate %s vs %s: %s", name, production, "promote" if decision.promote else "hold")
        failed = ", ".join(f"{c.name}: {c.detail}" for c in decision.failed)
        # a stack without a safety grader (gate.require_safety off, or the gate held it): the trail says so
        unchecked = {"safety": "not checked"} if not all(r.safety_checked for r in candidate.results) else {}
        first = production == self.config.base_model  # no production traffic to split: it becomes production
        # an older shadow's pairs scored up to now (its evidence, if it is replaced), and its verdict if they decide it
        older = await self.watch_shadow() if decision.promote and not first else None
        with self.store.session() as s:
            audit.lock(s)  # the deployments read here stay as they are until this unit of work commits
            stage, held = self._stage(s, first) if decision.promote else (None, None)
            event = audit.append(
                s,
                actor=self.actor,
                action="gate.pass" if decision.promote else "gate.hold",
                subject=name,
                reason=(f"look {look}: lift {decision.lift.mean:+.3f} [{decision.lift.low:+.3f}, "
                        f"{decision.lift.high:+.3f}] at one-sided level {decision.lift.level:.3g}"
                        + ("; safety not checked" if unchecked else "") + (f"; failed {failed}" if failed else "")
                        + (f"; held: {held}" if held else ""))[:2000],
                details={
                    "candidate": name, "production": production, "heldout": runs[0].heldout,
                    "stack": self.stack.version, "evaluations": [r.id for r in runs],
                    "lift": decision.lift.model_dump(), "checks": [c.model_dump() for c in decision.checks],
                    "look": look,
                } | ({"confirmation": decision.confirmation.lift.model_dump()} if decision.confirmation else {})
                  | ({"task_lift": decision.task_lift.model_dump()} if decision.task_lift else {})
                  | unchecked | ({"held": held} if held else {}),
            )  # fmt: skip
            deployed = None if stage is None else self._deploy(s, stage, step, event.id)
        return Candidate(
            step=step, production=production, decision=decision, event_id=event.id, deployed=deployed, held=held,
            shadow=older if older is not None and older.action != "wait" else None,
        )  # fmt: skip

    def _stage(self, s: Session, first: bool) -> tuple[str | None, str | None]:
        """Where a candidate that passed the gate goes, or why it is held. The first becomes production. With a
        shadow stage it becomes the shadow, whatever else runs: a newer candidate replaces a shadow still pairing
        (``_deploy``), and waits there while a canary is watched, its pairs scored against live production's
        answers meanwhile. Without one it becomes the canary, unless a canary is being watched: then it is held,
        not deployed. Replacing a canary would cut its evidence short and leave its verdict to episodes of two
        checkpoints; deploying this one after it would put live traffic on a comparison with a production that
        the canary's promotion may have replaced. The loop trains on, and its next candidate meets production as
        it is then."""
        name = self.config.name
        if first:
            return "production", None
        if self.config.shadow is not None:
            return "shadow", None
        if (canary := deployments.find(s, f"{name}@canary")) is not None:
            return None, (
                f"{canary.name} (step {canary.step}) is being watched: a candidate never replaces a canary; the next "
                "candidate meets production after its verdict"
            )
        return "canary", None

    def _deploy(self, s: Session, stage: str, step: int, gate_event: int) -> str:
        """Deploy checkpoint ``step`` as ``MODEL@stage`` in this unit of work (``_stage`` chose it). A shadow it
        replaces gets its ``shadow.replace`` event first: the old and new steps and the old shadow's pairs so far
        (its verdict's evidence; they never count for the new one: pairs are keyed by the deploy event)."""
        name, shadow = self.config.name, self.config.shadow
        alias = f"{name}@{stage}"
        reason = f"passed the gate (audit event {gate_event})"
        details: dict[str, Any] = {"gate_event": gate_event}
        if stage == "shadow" and shadow is not None and (old := deployments.find(s, alias)) is not None:
            pairs = [pair for (event_id, _), pair in sorted(self._pairs.items()) if event_id == old.event_id]
            so_far = shadow_verdict(pairs, shadow, self.config.seed)
            replaced = audit.append(
                s, actor=self.actor, action="shadow.replace", subject=alias,
                reason=f"step {step} passed the gate (audit event {gate_event}) while step {old.step}'s shadow was"
                f" pairing ({so_far.reason}): it replaces it",
                details=so_far.model_dump(exclude={"action", "reason"})
                | {"old_step": old.step, "new_step": step, "deploy_event": old.event_id, "gate_event": gate_event},
            )  # fmt: skip
            reason += f"; replaces step {old.step}'s shadow (audit event {replaced.id})"
            details["replaced_event"] = replaced.id
        elif stage == "production":
            reason += "; the first production deployment"
        share = {"production": None, "shadow": shadow.share if shadow else None, "canary": self.config.canary.share}
        deployments.deploy(s, alias, step, actor=self.actor, share=share[stage], reason=reason, details=details)
        return alias

    def _finished(self, arm: Arm | None) -> list[ArmEpisode]:
        """An arm's finished production episodes (not the held-out evaluations, which call the aliases too)."""
        split = self.config.intake_split
        return [e for e in (arm.episodes if arm else []) if e.status == "finished" and e.split == split]

    @property
    def task_prefixes(self) -> tuple[str, str]:
        """What the ids of the tasks this loop queues start with: its training groups', its held-out evaluations'."""
        return f"train:{self.config.name}:", f"eval:{self.config.name}:"

    def read_alarm(self) -> None:
        """The alarm as the audit trail has it (raised, or cleared: ``alarm.state``); the baseline drops the steps
        up to the latest clearing's."""
        with self.store.session() as s:
            found = alarms.state(s, self.config.name)
        self.alarm = found.raised
        if found.cleared_at_step is not None:
            self.step_means = [row for row in self.step_means if row["step"] > found.cleared_at_step]

    def check_alarm(self, groups: list[TrajectoryGroup], step: int = 0) -> str | None:
        """Record training step ``step``'s reward and holdout means; raise the reward-hacking alarm. Returns the
        alarm when this call raised it."""
        if (row := _means(groups, step)) is None:
            return None
        self.step_means.append(row)
        return self._raise_alarm()

    def _raise_alarm(self) -> str | None:
        """Raise the alarm (once: an audit event) when the recorded steps' reward rises over flat holdout graders."""
        if self.alarm is not None or (message := reward_hacking(self.step_means, self.config.alarm)) is None:
            return None
        self.alarm = message
        window = self.step_means[-self.config.alarm.window :]
        with self.store.session() as s:
            audit.append(
                s, actor=self.actor, action=alarms.RAISED, subject=self.config.name,
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
        self.read_alarm()
        self._raise_alarm()
        reason = f"cancelled: an earlier run of the loop {name} queued it and stopped before it used its group"
        with self.store.session() as s:
            cancelled = [task for prefix in self.task_prefixes for task in tasks.cancel(s, prefix, reason)]
            if cancelled:
                audit.append(
                    s, actor=self.actor, action="loop.cancel", subject=name,
                    reason=f"{len(cancelled)} task(s) an earlier run left open cancelled",
                    details={"tasks": cancelled[:100], "count": len(cancelled)},
                )  # fmt: skip
        if cancelled:
            log.info("cancelled %d task(s) an earlier run of %s left open", len(cancelled), name)
        return cancelled

    async def consider_due(self, queue: QueueClient) -> Candidate | None:
        """The latest checkpoint through the gate (``consider``) if it is due: a step this loop trained (its
        checkpoint keeps the loop's state), every ``candidate_every``-th, with no gate decision yet (a ``gate.*``
        event names it) and no alarm raised. So a restarted loop decides what its predecessor trained and did not
        get to decide, and no checkpoint is decided twice."""
        step = await self.model.get_step()
        if step == 0 or step % self.config.candidate_every or self.alarm is not None:
            return None
        saved = (await self.model.checkpoint_extra()).get("loop")
        if saved is None or saved.get("rewind"):  # not the loop's, or production's weights again (rewind_if_due)
            return None
        with self.store.session() as s:
            if audit.events(s, subject=self.model.get_inference_name(step), actions=GATE_ACTIONS, limit=1):
                return None
        return await self.consider(queue, step)

    async def rewind_if_due(self) -> Rewind | None:
        """With ``rewind_on_rollback``: once a canary was rolled back or a shadow stopped (``canary.rollback``,
        ``shadow.stop``), training goes on from the weights production serves (``MODEL@production``'s checkpoint,
        else the base model), not from the checkpoints that candidate came from and the steps since, which grew
        from it: a new checkpoint one step on with production's weights and a fresh optimizer (``LocalBackend.
        rewind``), then a ``loop.rewind`` event (from step, production's step, the rollback events). The alarm's
        baseline starts again after it (its steps trained other weights). Due for a rollback event after the last
        ``loop.rewind`` whose candidate is a later step than that rewind's (an older one's line was left then).

        A kill at any point: before the checkpoint is written, the next run rewinds; after it, the next run
        resumes from it (production's weights) and only writes the event its marker (the checkpoint's ``extra``)
        describes. So training never goes on from the candidate's weights, and no rollback rewinds twice."""
        if not self.config.rewind_on_rollback:
            return None
        name = self.config.name
        marker = ((await self.model.checkpoint_extra()).get("loop") or {}).get("rewind")
        with self.store.session() as s:
            done = audit.events(s, subject=name, actions=(REWIND,))
            if marker is not None and not any(e.details.get("step") == marker["step"] for e in done):
                return self._record_rewind(s, Rewind.model_validate(marker), "its checkpoint was written before a kill")
            last = done[-1].details if done else None
            aliases = (f"{name}@canary", f"{name}@shadow")
            judged = [
                e for e in audit.events(s, actions=ROLLBACKS) if e.subject in aliases
                and (last is None or (e.id > done[-1].id and e.details["step"] > last["step"]))
            ]  # fmt: skip
            production = deployments.find(s, f"{name}@production")
        if not judged:
            return None
        live = await self.model.get_step()
        rewind = Rewind(
            step=live + 1, from_step=live, to_step=production.step if production else None,
            production=production.name if production else self.config.base_model,
            rollback_event=judged[-1].id, rollback_events=[e.id for e in judged],
        )  # fmt: skip
        extra = {"loop": {"means": [], "off_policy": self.off_policy_used, "rewind": rewind.model_dump()}}
        try:
            written = await self.backend.rewind(self.model, rewind.to_step, extra=extra)
        except FileNotFoundError as exc:
            raise RewindError(
                f"cannot rewind {name} to {rewind.production} after audit event {rewind.rollback_event}: {exc} "
                "(deploy a checkpoint that exists as production, or set rewind_on_rollback: false)"
            ) from None
        assert written == rewind.step, (written, rewind.step)  # one step at a time: nothing else trains this model
        self.step_means = []
        with self.store.session() as s:
            return self._record_rewind(s, rewind, f"{judged[-1].action} (audit event {judged[-1].id})")

    def _record_rewind(self, s: Session, rewind: Rewind, why: str) -> Rewind:
        """The ``loop.rewind`` event of a rewound checkpoint, in this unit of work."""
        source = "the base model" if rewind.to_step is None else f"{rewind.production} (step {rewind.to_step})"
        event = audit.append(
            s, actor=self.actor, action=REWIND, subject=self.config.name,
            reason=f"training goes on from {source}'s weights as step {rewind.step}, not from step "
            f"{rewind.from_step}'s: {why}",
            details=rewind.model_dump(exclude={"event_id"}),
        )  # fmt: skip
        log.warning("rewound %s to %s as step %d (%s)", self.config.name, source, rewind.step, why)
        return rewind.model_copy(update={"event_id": event.id})

    async def watch_shadow(self) -> ShadowVerdict | None:
        """If ``MODEL@shadow`` serves (a shadow stage is configured): pair its shadow episodes since its deployment
        with their production originals (finished, of ``intake_split``, the shadow answered the same last
        messages), score both answers
        with the stack (grades recorded), and send it to canary or stop it (``shadow.verdict``), audited with its
        evidence; the shadow alias goes either way. It waits while a canary is still watched. None without one."""
        name, policy = self.config.name, self.config.shadow
        if policy is None:
            return None
        with self.store.session() as s:
            shadow = deployments.find(s, f"{name}@shadow")
            if shadow is None:
                return None
            mirrored = arms(s, name, since_event=shadow.event_id).arms.get(f"{name}@shadow")
            episodes = mirrored.episodes if mirrored else []
            linked = {e.id: (e.shadow_of, e.usage.calls) for e in episodes if e.shadow_of}
            inputs = {}
            for shadow_id, (origin, count) in sorted(linked.items()):
                key = (shadow.event_id, shadow_id)
                if key in self._pairs or self._unpaired.get(key) == count:  # no new call since it was looked at
                    continue
                original = db.get_episode(s, origin)
                if original.status != "finished" or original.split != self.config.intake_split:
                    continue  # not yet, or never: only production traffic pairs (an evaluation's never does)
                mirror, answered = db.calls(s, shadow_id), db.calls(s, origin)
                same = (
                    mirror and answered and mirror[-1].request.get("messages") == answered[-1].request.get("messages")
                )
                if same and mirror[-1].step == shadow.step:  # not an older shadow's late answer
                    inputs[shadow_id] = (origin, last_sample(mirror), last_sample(answered), gdb.item_of(s, origin))
                else:
                    self._unpaired[key] = len(mirror)
        scored = []
        for shadow_id, (origin, mirror, answered, item) in inputs.items():
            candidate, current = await score(self.stack, mirror, item), await score(self.stack, answered, item)
            self._pairs[shadow.event_id, shadow_id] = Pair(
                shadow=shadow_id, production=origin, shadow_reward=candidate.reward,
                production_reward=current.reward, safe=candidate.safe,
            )  # fmt: skip
            scored.append((shadow_id, candidate))

        def record() -> None:
            with self.store.session() as s:
                self.stack.register(s, actor=self.actor)  # once stored, a no-op
                for shadow_id, result in scored:
                    result.record(s, shadow_id)

        if scored:
            await asyncio.to_thread(record)
        pairs = [pair for i in sorted(linked) if (pair := self._pairs.get((shadow.event_id, i))) is not None]
        found = shadow_verdict(pairs, policy, self.config.seed)
        if found.action == "canary" and self.alarm is not None:
            found = found.model_copy(update={"action": "wait", "reason": f"promotion paused: {self.alarm}"})
        with self.store.session() as s:
            if found.action == "canary" and deployments.find(s, f"{name}@canary") is not None:
                found = found.model_copy(update={"action": "wait", "reason": f"{found.reason}; a canary is running"})
            if found.action == "wait":
                return found
            event = audit.append(
                s, actor=self.actor, action=f"shadow.{'pass' if found.action == 'canary' else 'stop'}",
                subject=f"{name}@shadow", reason=found.reason,
                details=found.model_dump() | {"step": shadow.step, "deploy_event": shadow.event_id},
            )  # fmt: skip
            if found.action == "canary":
                deployments.deploy(
                    s, f"{name}@canary", shadow.step, actor=self.actor, share=self.config.canary.share,
                    reason=f"passed the shadow stage (audit event {event.id})",
                    details={"shadow_event": event.id, "shadow_deploy_event": shadow.event_id},
                )  # fmt: skip
            deployments.remove(
                s, f"{name}@shadow", actor=self.actor,
                reason=f"shadow {'passed' if found.action == 'canary' else 'stopped'} (audit event {event.id})",
            )  # fmt: skip
        log.info("shadow %s@%d: %s (%s)", name, shadow.step, found.action, found.reason)
        return found

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
        self, queue: QueueClient, step: int, sampler: DynamicSampler
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

    async def draw_groups(
        self, queue: QueueClient, step: int
    ) -> tuple[list[TrajectoryGroup], list[TrajectoryGroup], OffPolicyDraw | None, MixedGroups | None]:
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

        def read() -> OffPolicyDraw:
            with self.store.session() as s:  # staleness along the checkpoints' line: where each rewind went back to
                events = audit.events(s, subject=config.name, actions=(REWIND,))
                return draw(
                    s, candidates, keys, model=config.name, base_model=config.base_model, step=step,
                    per_group=config.off_policy_members, max_staleness=config.max_staleness_steps,
                    used=self.off_policy_used, rewinds={e.details["step"]: e.details["to_step"] or 0 for e in events},
                )  # fmt: skip

        found = await asyncio.to_thread(read)
        for key, group in zip(keys, groups, strict=True):
            group.trajectories.extend(found.members[key])
        log.info("step %d: %d off-policy member(s) joined; left out: %s", step + 1, len(found.answered),
                 found.left_out or "none")  # fmt: skip
        return found

    async def run(self) -> LoopReport:
        """``steps`` iterations; a run after an earlier one of the same loop (killed or not) first ``resume``s."""
        config = self.config
        await self.model.register(self.backend)
        with self.store.session() as s:
            self.stack.register(s, actor=self.actor)
        cancelled = await self.resume()
        root = self.backend.base_url.removesuffix("/v1")
        runners = []
        if config.runners:
            agent = load_agent(config.agent)
            runners.append(asyncio.create_task(Runner(root, agent, concurrency=config.runners).run()))
        report = LoopReport(steps=[], intake=0, candidates=[], canary=[], cancelled=len(cancelled))
        try:
            async with QueueClient(root) as queue:
                for _ in range(config.steps):
                    self.read_alarm()  # a clearing (flywheel loop --clear-alarm) counts from the next iteration
                    # first the checkpoint a killed run trained and did not decide: it would have been, before this
                    if (candidate := await self.consider_due(queue)) is not None:
                        report.candidates.append(candidate)
                        report.shadow.extend([candidate.shadow] if candidate.shadow else [])
                    if (canary := await self.watch_canary()) is not None and canary.action != "wait":
                        report.canary.append(canary)
                    if (shadow := await self.watch_shadow()) is not None and shadow.action != "wait":
                        report.shadow.append(shadow)
                    if (rewind := await self.rewind_if_due()) is not None:  # before anything trains again
                        report.rewinds.append(rewind)
                    report.intake += self.intake()
                    if not self.pool:
                        raise ValueError("no tasks to train on: give seed tasks (tasks:) or let production episodes in")
                    step = await self.model.get_step()
                    started = time.monotonic()
                    groups, drawn, joined, mixed = await self.draw_groups(queue, step)
                    # the alarm's baseline goes with the checkpoint: a restart resumes both at the same step; its
                    # reward is every group drawn's (the kept ones alone lean to one half)
                    row = _means(drawn, step + 1)
                    kept = ([*self.step_means, row] if row else self.step_means)[-config.alarm.window :]
                    trainable = [g for g in groups if g.trajectories]
                    # off-policy members join once: kept with the checkpoint until they would be stale anyway
                    used = joined.used if joined else self.off_policy_used
                    sampled = mixed.metrics() if mixed is not None else None
                    metrics = await self.model.train(
                        trainable, config=config.train, extra={"loop": {"means": kept, "off_policy": used}},
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
                        self.check_alarm(drawn, trained)
                        self.off_policy_used = used
                    if (candidate := await self.consider_due(queue)) is not None:
                        report.candidates.append(candidate)
                        report.shadow.extend([candidate.shadow] if candidate.shadow else [])
                    if config.prune:  # the latest, the deployed (and their rollback steps) and a KL reference stay
                        await self.backend.prune_checkpoints(self.model, keep=[config.train.kl_reference_step or 0])
        finally:
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
