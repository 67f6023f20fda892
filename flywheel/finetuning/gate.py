"""A reinforcement job that ends through the gate instead of straight to users (``metadata={"flywheel_gate":
"production"}``): its best checkpoint (by validation reward) and the base model answer every validation row
``eval_samples`` times, the job's grader scores both, and Flywheel's promotion gate (``flywheel.loop.gate.decide``,
one look) decides on the paired per-row lift, safety, failures and cost. A checkpoint that passes is deployed as
``<fine_tuned_model>@<stage>`` (what callers then use); one that is held is not, and the job's events and the
audit trail (a ``gate.pass`` or ``gate.hold`` event with the evidence) say why. ``flywheel_gate_policy`` (JSON)
overrides the gate's policy (``GatePolicy``: ``min_items``, ``min_lift``, ``require_safety``...). A ``multi``
grader's sub-grader named ``safety`` is the gate's safety grader (an answer is safe when it scores 1); without one
the gate promotes nothing unless the policy's ``require_safety`` is off."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import ValidationError

from flywheel.graders.data import RFTRow
from flywheel.graders.rollout import rft_rollout
from flywheel.graders.scoring import score_trajectory
from flywheel.graders.spec import Grader
from flywheel.local.backend import LocalBackend
from flywheel.loop.gate import GateDecision, GatePolicy, ItemResult, decide
from flywheel.model import Model, TrainableModel
from flywheel.store import Store, audit, deployments, finetuning
from flywheel.store.deployments import STAGE
from flywheel.store.schema import FineTuningCheckpoint
from flywheel.store.schema import FineTuningJob as JobRow

GATE_KEY = "flywheel_gate"  # metadata: the stage a checkpoint that passes is deployed as
POLICY_KEY = "flywheel_gate_policy"  # metadata: GatePolicy fields as JSON
ACTOR = "fine-tuning"
SAFETY = "safety"  # a multi grader's sub-grader of this name is the gate's safety grader


def requested(meta: dict[str, str] | None) -> tuple[str, GatePolicy] | None:
    """The stage and policy a job's metadata asks for (None: no gate); ``ValueError`` naming what is wrong."""
    meta = meta or {}
    if GATE_KEY not in meta:
        if POLICY_KEY in meta:
            raise ValueError(f"metadata.{POLICY_KEY} is given without metadata.{GATE_KEY} (the stage to deploy to)")
        return None
    stage = meta[GATE_KEY]
    if not STAGE.fullmatch(stage):
        raise ValueError(
            f"metadata.{GATE_KEY} '{stage}' is not a stage: a word such as production (lowercase letters, digits, "
            "- and _, starting with a letter)"
        )
    try:
        policy = GatePolicy.model_validate_json(meta.get(POLICY_KEY, "{}"))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'policy'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"metadata.{POLICY_KEY} is not a gate policy: {problems}") from None
    return stage, policy


def best(checkpoints: list[FineTuningCheckpoint]) -> FineTuningCheckpoint | None:
    """The checkpoint with the highest validation reward (training reward without one), the latest of equals; only
    those with trained weights (``<model>@0``: no step of the job changed them, and no weights were saved for it)."""
    checkpoints = [c for c in checkpoints if _weights_step(c) > 0]
    if not checkpoints:
        return None

    def key(c: FineTuningCheckpoint) -> tuple[float, int]:
        metrics = c.metrics or {}
        return metrics.get("valid_reward_mean", metrics.get("train_reward_mean", float("-inf"))), c.step

    return max(checkpoints, key=key)


def _weights_step(checkpoint: FineTuningCheckpoint) -> int:
    """The model's step a checkpoint names (``<model>@<step>``): the job's step counts RFT steps that trained none."""
    return int(checkpoint.model.rpartition("@")[2])


def decided(store: Store, job_id: str) -> bool:
    """Whether the job's gate decision is recorded (a restarted job never decides twice)."""
    with store.session() as s:
        return any("gate_event" in (e.data or {}) for e in finetuning.list_events(s, job_id, after=None, limit=10_000))


async def send_through_gate(
    job: JobRow,
    store: Store,
    model: TrainableModel,
    backend: LocalBackend,
    grader: Grader,
    rows: list[RFTRow],
    *,
    samples: int,
    sampling: dict[str, Any],
) -> GateDecision | None:
    """Decide on the job's best checkpoint against its base model on ``rows`` (the validation file), both answering
    as in training (``sampling``: temperature, max_tokens, response_format), audit the decision, deploy a checkpoint
    that passes as ``<model>@<stage>`` and record an event on the job (None: no step trained, nothing to decide)."""
    gate = requested(job.meta)
    assert gate is not None
    stage, policy = gate
    with store.session() as s:
        chosen = best(finetuning.checkpoints(s, job.id))
        if chosen is None:  # every step's groups scored alike: the weights are the base model's
            said = (f"The gate was not asked: no step of the job changed the weights (every group's answers scored "
                    f"alike), so {model.name}@{stage} was not deployed")  # fmt: skip
            finetuning.add_event(s, job.id, said, level="warn", data={"gate_event": 0, "promote": False})
            return None
        step = _weights_step(chosen)
        finetuning.add_event(s, job.id, f"Sending checkpoint {chosen.model} (job step {chosen.step}, the best by "
                          f"validation reward) through the gate against {job.base_model}")  # fmt: skip
    await backend.load(job.base_model)

    def side(name: str) -> Model:
        return Model(name=name, project=model.project, inference_model_name=name,
                     inference_base_url=model.inference_base_url, inference_api_key=model.inference_api_key)  # fmt: skip

    candidate, baseline = side(chosen.model), side(job.base_model)
    results = await asyncio.gather(
        *(_item(m, grader, row, samples, sampling) for row in rows for m in (candidate, baseline))
    )
    decision = decide(list(results[0::2]), list(results[1::2]), policy)
    alias = f"{model.name}@{stage}"
    failed = "; ".join(f"{c.name}: {c.detail}" for c in decision.failed)
    checked = all(r.safety_checked for r in results)
    lift = decision.lift
    summary = f"lift {lift.mean:+.4f} [{lift.low:+.4f}, {lift.high:+.4f}] over {decision.items} validation rows"
    summary += "" if checked else "; safety not checked (the grader has no 'safety' sub-grader)"
    with store.session() as s:
        event = audit.append(
            s, actor=ACTOR, action="gate.pass" if decision.promote else "gate.hold", subject=chosen.model,
            reason=(f"fine-tuning job {job.id}: {summary}" + (f"; failed {failed}" if failed else ""))[:2000],
            details={"job": job.id, "candidate": chosen.model, "production": job.base_model, "stage": stage,
                     "lift": lift.model_dump(), "checks": [c.model_dump() for c in decision.checks],
                     "policy": policy.model_dump()} | ({} if checked else {"safety": "not checked"}),
        )  # fmt: skip
        if decision.promote:
            deployments.deploy(s, alias, step, actor=ACTOR, reason=f"passed the gate (audit event {event.id})",
                               details={"gate_event": event.id, "job": job.id})  # fmt: skip
            said = f"The gate passed {chosen.model}: {summary}. Deployed as {alias}"
        else:
            said = f"The gate held {chosen.model}: {summary}. Failed {failed}. {alias} was not deployed"
        finetuning.add_event(s, job.id, said, level="info" if decision.promote else "warn",
                          data={"gate_event": event.id, "promote": decision.promote, "deployment": alias})  # fmt: skip
    return decision


async def _item(model: Model, grader: Grader, row: RFTRow, samples: int, sampling: dict[str, Any]) -> ItemResult:
    """``model``'s ``samples`` answers to one row, graded: the gate's evidence for that row. An answer that fails
    (the request, or the grader's safety sub-grader erring) counts as unfinished: 0 and not safe."""
    scores, tasks, tokens, latencies, failures, safe, checked = [], [], [], [], 0, True, True
    for _ in range(samples):
        start = time.perf_counter()
        try:
            answer = await rft_rollout(model, row, **sampling)
            result = await score_trajectory(grader, answer, row.item)
        except Exception:  # an attempt that did not finish is evidence against its side
            failures += 1
            scores.append(0.0)
            safe = False
            continue
        latencies.append((time.perf_counter() - start) * 1000)
        tokens.append(answer.metrics.get("completion_tokens", 0.0))
        has_safety = SAFETY in result.sub_rewards
        ok = not has_safety or (result.sub_rewards[SAFETY] >= 1.0 and not result.errors)
        checked = checked and has_safety
        safe = safe and ok
        scores.append(result.reward if ok else 0.0)
        tasks.append(result.reward)
    return ItemResult(
        item=f"row-{row.index}", score=_mean(scores), task_score=_mean(tasks), safe=safe,
        attempts=samples, failures=failures, safety_checked=checked, tokens=_mean(tokens), latency_ms=_mean(latencies),
    )  # fmt: skip


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
