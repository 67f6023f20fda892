"""The promotion ladder: a checkpoint the loop trained goes up it to production, or is stopped on the way.

Every ``candidate_every`` steps the latest checkpoint is a candidate (``consider_due``): it and production (the
checkpoint ``MODEL@production`` points at, by its own name, not the alias a canary shares; or the base model before
any promotion) run the frozen held-out set through the same runners, the gate decides (``gate.decide_look``), the
decision is an audit event linking its evidence, and a candidate that passes is deployed as ``MODEL@canary`` with a
share of traffic; with a ``shadow`` stage it is ``MODEL@shadow`` first (a share of production's calls mirrored to
it, its answers never returned), and once ``min_pairs`` of its episodes are paired with their production originals
and scored, it goes to canary or is stopped (``watch_shadow``, ``shadow.py``; a ``shadow.pass`` or ``shadow.stop``
event with the evidence). A canary is promoted or rolled back on both arms' scores (``watch_canary``,
``canary.py``). A newer candidate that passes replaces a shadow still pairing (``shadow.replace``, with its pairs
so far) and never a canary being watched: with a shadow stage it waits in shadow, without one it is held
(``_stage`` says why). While the reward-hacking alarm is raised (``alarm.py``, the loop's) nothing is promoted.
After a canary is rolled back or a shadow stopped, training goes on from production's weights
(``rewind_on_rollback``, ``rewind_if_due``: a new checkpoint and a ``loop.rewind`` event), not from the rejected
candidate's line.

The loop (``driver.py``) owns a ``PromotionLadder`` and calls it each iteration. Nothing the ladder decides lives
only in memory: a checkpoint is due at the gate while no ``gate.*`` event names it, so a candidate a killed run
trained but did not decide is decided first, and none twice; the canary's and shadow's scores are recomputed (a
shadow's verdict, the canary it deploys and the shadow's removal are one unit of work; so are a gate decision, the
shadow it replaces and the deployment). A rewind's checkpoint carries its event's details, so a restart writes a
missing ``loop.rewind`` event and never rewinds twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from flywheel.gateway.client import GroupQueue
from flywheel.graders.regress import last_sample
from flywheel.graders.stack import GraderStack, StackScore, score
from flywheel.local.backend import LocalBackend
from flywheel.loop.canary import CanaryVerdict, Scored, verdict
from flywheel.loop.evaluate import HeldOutRun, evaluate
from flywheel.loop.gate import GateDecision, HeldOutSet, decide_look
from flywheel.loop.shadow import Pair, ShadowVerdict
from flywheel.loop.shadow import verdict as shadow_verdict
from flywheel.model import TrainableModel
from flywheel.store import Store, audit, deployments, episodes, grades
from flywheel.store.arms import Arm, ArmEpisode, arms
from flywheel.store.audit import AuditEventRecord
from flywheel.store.deployments import DeploymentRecord

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from flywheel.loop.driver import LoopConfig

log = logging.getLogger("flywheel.loop")
GATE_ACTIONS = ("gate.pass", "gate.hold")  # a checkpoint's decision: one per step
ROLLBACKS = ("canary.rollback", "shadow.stop")  # a candidate judged worse or unsafe on live traffic
REWIND = "loop.rewind"  # training went back to production's weights after one (PromotionLadder.rewind_if_due)
ENDED = {"promote": "promoted", "rollback": "rolled back"}  # a canary's end, as its removal says it


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


class PromotionLadder:
    """The loop's candidates up the ladder: gate, shadow, canary, production; a rewind after a rollback. ``alarm``:
    why promotions are paused (the loop's reward-hacking alarm), or None; read at each decision."""

    def __init__(
        self,
        config: LoopConfig,
        backend: LocalBackend,
        model: TrainableModel,
        stack: GraderStack,
        heldout: HeldOutSet,
        *,
        actor: str,
        alarm: Callable[[], str | None],
    ):
        self.config, self.backend, self.model, self.actor = config, backend, model, actor
        self.stack, self.heldout, self._alarm = stack, heldout, alarm
        if stack.safety is None:
            log.warning(
                "the grader stack %s has no safety grader: %s", stack.name,
                "candidates are promoted with safety not checked (gate.require_safety is off)"
                if not config.gate.require_safety else "the gate promotes nothing (gate.require_safety)",
            )  # fmt: skip
        self._scores: dict[str, StackScore] = {}  # production episodes the canary watch scored, by id
        # shadow episodes the shadow watch paired and scored, by the shadow's deploy event and id (one shadow episode
        # per production episode: its calls may come from two shadows deployed one after the other)
        self._pairs: dict[tuple[int, str], Pair] = {}
        # shadow episodes whose finished original had other last messages (the mirror missed its last call), by the
        # same key -> their calls then: read again only once a late mirror has added one
        self._unpaired: dict[tuple[int, str], int] = {}

    @property
    def store(self) -> Store:
        return self.backend.gateway.store

    async def production_name(self) -> str:
        """What a candidate is compared with: the checkpoint the production deployment points at (``MODEL@<step>``,
        which the backend serves), never the alias (``MODEL@production`` sends a canary's share of episodes to the
        canary); else the base model (served for it)."""
        production = await self.store.run(deployments.find, f"{self.config.name}@production")
        if production is not None:
            return production.target
        await self.backend.load(self.config.base_model)
        return self.config.base_model

    async def look(self) -> int:
        """The gate's next look: 1 + its decisions since production last changed (the production deployment's
        latest event; every decision of this model before there is one). Each look spends part of the gate's
        lifetime error budget (``gate.levels``), so a candidate no better than production is rarely promoted
        however often the loop asks."""
        name = self.config.name

        def count(s: Session) -> int:
            production = deployments.find(s, f"{name}@production")
            after = production.event_id if production is not None else 0
            return 1 + audit.count_events(s, actions=GATE_ACTIONS, subject_prefix=f"{name}@", after=after)

        return await self.store.run(count)

    async def consider_due(self, queue: GroupQueue) -> Candidate | None:
        """The latest checkpoint through the gate (``consider``) if it is due: a step this loop trained (its
        checkpoint keeps the loop's state), every ``candidate_every``-th, with no gate decision yet (a ``gate.*``
        event names it) and no alarm raised. So a restarted loop decides what its predecessor trained and did not
        get to decide, and no checkpoint is decided twice."""
        step = await self.model.get_step()
        if step == 0 or step % self.config.candidate_every or self._alarm() is not None:
            return None
        saved = (await self.model.checkpoint_extra()).get("loop")
        if saved is None or saved.get("rewind"):  # not the loop's, or production's weights again (rewind_if_due)
            return None
        if await self.store.run(audit.events, subject=self.model.get_inference_name(step), actions=GATE_ACTIONS, limit=1):  # fmt: skip
            return None
        return await self.consider(queue, step)

    async def consider(self, queue: GroupQueue, step: int) -> Candidate:
        """Evaluate checkpoint ``step`` against production on the held-out set; the gate decides (``decide``). A
        candidate that passes the look's screen is evaluated again, both sides afresh (``gate.decide_look``)."""
        production, look = await self.production_name(), await self.look()
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
        return await self.decide(step, production, *first, again=again, look=look)

    async def decide(
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
        look = await self.look() if look is None else look
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

        def record(s: Session) -> tuple[str | None, AuditEventRecord, str | None]:
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
            return held, event, None if stage is None else self._deploy(s, stage, step, event.id)

        held, event, deployed = await self.store.run(record)
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

    async def watch_shadow(self) -> ShadowVerdict | None:
        """If ``MODEL@shadow`` serves (a shadow stage is configured): pair its shadow episodes since its deployment
        with their production originals (finished, of ``intake_split``, the shadow answered the same last
        messages), score both answers
        with the stack (grades recorded), and send it to canary or stop it (``shadow.verdict``), audited with its
        evidence; the shadow alias goes either way. It waits while a canary is still watched. None without one."""
        name, policy = self.config.name, self.config.shadow
        if policy is None:
            return None

        def read(s: Session) -> tuple[DeploymentRecord, dict[str, tuple[str, int]], dict[str, tuple]] | None:
            shadow = deployments.find(s, f"{name}@shadow")
            if shadow is None:
                return None
            mirrored = arms(s, name, since_event=shadow.event_id).arms.get(f"{name}@shadow")
            shadow_episodes = mirrored.episodes if mirrored else []
            linked = {e.id: (e.shadow_of, e.usage.calls) for e in shadow_episodes if e.shadow_of}
            inputs = {}
            for shadow_id, (origin, count) in sorted(linked.items()):
                key = (shadow.event_id, shadow_id)
                if key in self._pairs or self._unpaired.get(key) == count:  # no new call since it was looked at
                    continue
                original = episodes.get_episode(s, origin)
                if original.status != "finished" or original.split != self.config.intake_split:
                    continue  # not yet, or never: only production traffic pairs (an evaluation's never does)
                mirror, answered = episodes.calls(s, shadow_id), episodes.calls(s, origin)
                same = (
                    mirror and answered and mirror[-1].request.get("messages") == answered[-1].request.get("messages")
                )
                if same and mirror[-1].step == shadow.step:  # not an older shadow's late answer
                    inputs[shadow_id] = (origin, last_sample(mirror), last_sample(answered), grades.item_of(s, origin))
                else:
                    self._unpaired[key] = len(mirror)
            return shadow, linked, inputs

        if (found_shadow := await self.store.run(read)) is None:
            return None
        shadow, linked, inputs = found_shadow
        scored = []
        for shadow_id, (origin, mirror, answered, item) in inputs.items():
            candidate, current = await score(self.stack, mirror, item), await score(self.stack, answered, item)
            self._pairs[shadow.event_id, shadow_id] = Pair(
                shadow=shadow_id, production=origin, shadow_reward=candidate.reward,
                production_reward=current.reward, safe=candidate.safe,
            )  # fmt: skip
            scored.append((shadow_id, candidate))

        def record(s: Session) -> None:
            self.stack.register(s, actor=self.actor)  # once stored, a no-op
            for shadow_id, result in scored:
                result.record(s, shadow_id)

        if scored:
            await self.store.run(record)
        pairs = [pair for i in sorted(linked) if (pair := self._pairs.get((shadow.event_id, i))) is not None]
        found = shadow_verdict(pairs, policy, self.config.seed)
        if found.action == "canary" and (alarm := self._alarm()) is not None:
            found = found.model_copy(update={"action": "wait", "reason": f"promotion paused: {alarm}"})

        def decide(s: Session, found: ShadowVerdict) -> ShadowVerdict:
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
            return found

        found = await self.store.run(decide, found)
        if found.action == "wait":
            return found
        log.info("shadow %s@%d: %s (%s)", name, shadow.step, found.action, found.reason)
        return found

    async def watch_canary(self) -> CanaryVerdict | None:
        """If ``MODEL@canary`` serves: score both arms since its deployment; promote it, roll it back, or wait
        (``canary.verdict``). A promotion or rollback is audited with its evidence. None without a canary."""
        name, policy = self.config.name, self.config.canary

        def read(s: Session) -> tuple[DeploymentRecord, dict[str, list[ArmEpisode]], dict[str, tuple]] | None:
            canary = deployments.find(s, f"{name}@canary")
            if canary is None:
                return None
            report = arms(s, name, since_event=canary.event_id)
            sides = {side: self._finished(report.arms.get(f"{name}@{side}")) for side in ("canary", "production")}
            # a finished episode's answer does not change: each is scored once (its feedback is read every time)
            new = {e.id for side in sides.values() for e in side} - self._scores.keys()
            return canary, sides, {i: (last_sample(episodes.calls(s, i)), grades.item_of(s, i)) for i in sorted(new)}

        if (found_canary := await self.store.run(read)) is None:
            return None
        canary, sides, inputs = found_canary
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
        if found.action == "promote" and (alarm := self._alarm()) is not None:
            found = found.model_copy(update={"action": "wait", "reason": f"promotion paused: {alarm}"})
        if found.action == "wait":
            return found

        def end(s: Session) -> None:
            event = audit.append(
                s, actor=self.actor, action=f"canary.{found.action}", subject=f"{name}@canary", reason=found.reason,
                details=found.model_dump() | {"step": canary.step, "deploy_event": canary.event_id},
            )  # fmt: skip
            if found.action == "promote":
                deployments.promote(s, name, actor=self.actor, reason=f"{found.reason} (audit event {event.id})")
            deployments.remove(
                s, f"{name}@canary", actor=self.actor, reason=f"canary {ENDED[found.action]} (audit event {event.id})"
            )

        await self.store.run(end)
        log.info("canary %s@%d: %s (%s)", name, canary.step, found.action, found.reason)
        return found

    def _finished(self, arm: Arm | None) -> list[ArmEpisode]:
        """An arm's finished production episodes (not the held-out evaluations, which call the aliases too)."""
        split = self.config.intake_split
        return [e for e in (arm.episodes if arm else []) if e.status == "finished" and e.split == split]

    async def rewind_if_due(self, off_policy_used: dict[str, int]) -> Rewind | None:
        """With ``rewind_on_rollback``: once a canary was rolled back or a shadow stopped (``canary.rollback``,
        ``shadow.stop``), training goes on from the weights production serves (``MODEL@production``'s checkpoint,
        else the base model), not from the checkpoints that candidate came from and the steps since, which grew
        from it: a new checkpoint one step on with production's weights and a fresh optimizer (``LocalBackend.
        rewind``; it keeps ``off_policy_used``, the off-policy members that trained, and no alarm baseline), then a
        ``loop.rewind`` event (from step, production's step, the rollback events). Due for a rollback event after
        the last ``loop.rewind`` whose candidate is a later step than that rewind's (an older one's line was left
        then).

        A kill at any point: before the checkpoint is written, the next run rewinds; after it, the next run
        resumes from it (production's weights) and only writes the event its marker (the checkpoint's ``extra``)
        describes. So training never goes on from the candidate's weights, and no rollback rewinds twice."""
        if not self.config.rewind_on_rollback:
            return None
        name = self.config.name
        marker = ((await self.model.checkpoint_extra()).get("loop") or {}).get("rewind")

        def read(s: Session) -> Rewind | tuple[list[AuditEventRecord], DeploymentRecord | None]:
            """The rewind a killed run wrote and did not record (recorded now), else the rollbacks it is due for."""
            done = audit.events(s, subject=name, actions=(REWIND,))
            if marker is not None and not any(e.details.get("step") == marker["step"] for e in done):
                return self._record_rewind(s, Rewind.model_validate(marker), "its checkpoint was written before a kill")
            last = done[-1].details if done else None
            aliases = (f"{name}@canary", f"{name}@shadow")
            judged = [
                e for e in audit.events(s, actions=ROLLBACKS) if e.subject in aliases
                and (last is None or (e.id > done[-1].id and e.details["step"] > last["step"]))
            ]  # fmt: skip
            return judged, deployments.find(s, f"{name}@production")

        if isinstance(found := await self.store.run(read), Rewind):
            return found
        judged, production = found
        if not judged:
            return None
        live = await self.model.get_step()
        rewind = Rewind(
            step=live + 1, from_step=live, to_step=production.step if production else None,
            production=production.name if production else self.config.base_model,
            rollback_event=judged[-1].id, rollback_events=[e.id for e in judged],
        )  # fmt: skip
        extra = {"loop": {"means": [], "off_policy": off_policy_used, "rewind": rewind.model_dump()}}
        try:
            written = await self.backend.rewind(self.model, rewind.to_step, extra=extra)
        except FileNotFoundError as exc:
            raise RewindError(
                f"cannot rewind {name} to {rewind.production} after audit event {rewind.rollback_event}: {exc} "
                "(deploy a checkpoint that exists as production, or set rewind_on_rollback: false)"
            ) from None
        assert written == rewind.step, (written, rewind.step)  # one step at a time: nothing else trains this model
        return await self.store.run(self._record_rewind, rewind, f"{judged[-1].action} (audit event {judged[-1].id})")

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
