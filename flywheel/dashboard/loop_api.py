"""The dashboard's loop API, under ``/ui/api/loop``: the deployments and what each serves, the promotion timeline
(gate decisions with their lift's interval, shadow and canary verdicts with theirs, deployments, rollbacks, rewinds,
alarms), the audit trail with its verification, production episodes with their grades, and the human-review
agreement table. Read-only, over the store (``flywheel.store.browse``, ``deployments``, ``audit``, ``reviews``).

The timeline is the audit trail's events of the loop's actions (``TIMELINE``, written by ``flywheel.loop.ladder``,
``flywheel.loop.alarm``, ``flywheel.loop.driver`` and ``flywheel.store.deployments``), each with its evidence read
from the event's details into one shape (``EvidenceOut``): the trail is the record, so what the timeline shows is
what was decided on. Lists are paged (``limit``, ``offset``, newest first, with ``total`` and ``next_offset``); an
unknown model, split or event is a 404 naming those there are.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from pydantic import BaseModel
from sqlalchemy.orm import Session

from flywheel.dashboard.common import MAX_INT, MAX_PAGE, PAGE, PREFIX, Number, finite
from flywheel.graders.agreement import GraderAgreement, agreement
from flywheel.store import Store, audit, browse, deployments, reviews
from flywheel.store.arms import ARM_KEY
from flywheel.store.audit import AuditEventRecord
from flywheel.store.deployments import DeploymentRecord

PRODUCTION = "production"  # the split production episodes are recorded in (the loop's default ``intake_split``)
GATE = ("gate.pass", "gate.hold")
TIMELINE = (
    *GATE,
    "shadow.pass", "shadow.stop", "shadow.replace",  # the shadow's verdicts (ladder.watch_shadow, ladder._deploy)
    "canary.promote", "canary.rollback",  # the canary's (ladder.watch_canary)
    *deployments.ACTIONS,  # deploy, promote, rollback, remove: what each alias pointed at
    "loop.rewind", "loop.alarm", "loop.alarm.clear",  # training back on production's weights; the alarm
)  # fmt: skip
Kind = Literal["gate", "shadow", "canary", "deployment", "rewind", "alarm"]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]
Offset = Annotated[int, Query(ge=0, le=MAX_INT)]
Model = Annotated[str | None, Query(min_length=1, max_length=256, description="One model's (default: all)")]


class UnknownLoopItemError(LookupError):
    """No such model in the loop's records, split of episodes, or audit event."""


# ---- answers ---------------------------------------------------------------------------------------------------


class DeploymentOut(BaseModel):
    """A deployment: the alias, the checkpoint it serves (``serves``: ``MODEL@STEP``) and, for a canary or a shadow,
    the share of production's traffic it gets."""

    name: str
    model: str
    stage: str
    step: int
    serves: str
    share: Number
    updated_at: datetime
    updated_by: str
    event_id: int  # the audit event that last moved it


class IntervalOut(BaseModel):
    """A difference and its interval: the gate's lift (candidate - production on the held-out items), a canary's or
    a shadow's difference from production; ``level``: one-sided, of that look."""

    mean: Number
    low: Number
    high: Number
    level: Number = None


class EvidenceOut(BaseModel):
    """What an event records it decided on, in one shape (fields an event has no part of are null)."""

    step: int | None  # the checkpoint it is about
    interval: IntervalOut | None
    confirmation: IntervalOut | None = None  # the gate's fresh evaluation of a candidate that passed its screen
    look: int | None = None
    failed: list[str] = []  # the gate's checks that failed
    canary_episodes: int | None = None
    production_episodes: int | None = None
    pairs: int | None = None  # a shadow's episodes paired with production's
    unsafe: int | None = None  # episodes that failed the safety grader
    share: Number = None  # a deployment's
    events: list[int] = []  # the audit events it refers to (the gate decision a deployment follows, ...)


class TimelineEventOut(BaseModel):
    id: int
    at: datetime
    actor: str
    action: str
    kind: Kind
    subject: str
    model: str
    reason: str | None
    evidence: EvidenceOut


class TimelinePage(BaseModel):
    model: str | None
    models: list[str]  # every model the loop's records name
    total: int
    offset: int
    next_offset: int | None
    items: list[TimelineEventOut]


class VerificationOut(BaseModel):
    """``audit.verify`` with this process's witness (its audit key and anchor file): the chain, its MACs (with the
    key) and its anchors; ``bad_id``: the first row found wrong."""

    ok: bool
    count: int
    bad_id: int | None
    message: str


class AuditEventOut(BaseModel):
    id: int
    at: datetime
    actor: str
    action: str
    subject: str
    reason: str | None
    details: dict[str, Any]
    hash: str
    signed: bool  # carries a MAC (appended with the audit key)


class AuditPage(BaseModel):
    verification: VerificationOut
    total: int
    offset: int
    next_offset: int | None
    items: list[AuditEventOut]


class GradeOut(BaseModel):
    version: str
    component: str  # reward | safety | holdout/<name>
    grader: str
    score: Number


class EpisodeOut(BaseModel):
    id: str
    task_id: str
    split: str
    status: str
    reward: Number
    arm: str | None  # the deployment that answered its calls ("mixed": more than one)
    created_at: datetime
    grades: list[GradeOut]
    label: Number  # a reviewer's, once labelled


class EpisodePage(BaseModel):
    split: str
    splits: dict[str, int]  # every split's episodes
    total: int
    offset: int
    next_offset: int | None
    items: list[EpisodeOut]


class ReviewsOut(BaseModel):
    """The review queue's size and each grader version's agreement with the labels (``flywheel review agreement``)."""

    queued: int
    labelled: int
    graders: list[GraderAgreement]


# ---- the router ------------------------------------------------------------------------------------------------


def loop_router(store: Store) -> APIRouter:
    router = APIRouter(prefix=f"{PREFIX}/loop")

    @router.get("/deployments")
    def list_deployments(model: Model = None) -> list[DeploymentOut]:
        with store.session() as s:
            _known_model(s, model)
            found = deployments.list_deployments(s, model)
        return [deployment_out(d) for d in found]

    @router.get("/timeline")
    def timeline(model: Model = None, limit: Limit = PAGE, offset: Offset = 0) -> TimelinePage:
        with store.session() as s:
            models = _known_model(s, model)
            total, found = browse.audit_page(s, limit=limit, offset=offset, actions=TIMELINE, model=model)
        return TimelinePage(
            model=model, models=models, total=total, offset=offset, next_offset=_next(total, offset, limit),
            items=[_timeline_event(e) for e in found],
        )  # fmt: skip

    @router.get("/audit")
    def audit_trail(limit: Limit = PAGE, offset: Offset = 0) -> AuditPage:
        with store.session() as s:
            report = audit.verify(s)
        with store.session() as s:
            total, found = browse.audit_page(s, limit=limit, offset=offset)
        return AuditPage(
            verification=VerificationOut(**report.model_dump()), total=total, offset=offset,
            next_offset=_next(total, offset, limit), items=[_audit_event(e) for e in found],
        )  # fmt: skip

    @router.get("/audit/{event_id}")
    def audit_event(event_id: Annotated[int, PathParam(ge=1, le=MAX_INT)]) -> AuditEventOut:
        with store.session() as s:
            found = browse.audit_event(s, event_id)
            first, last = browse.audit_span(s)
        if found is None:
            held = f"events {first} to {last}" if first is not None else "no events"
            raise UnknownLoopItemError(f"No audit event has the id {event_id}: the trail has {held}.")
        return _audit_event(found)

    @router.get("/episodes")
    def episodes(
        split: Annotated[str | None, Query(min_length=1, max_length=32)] = None,
        limit: Limit = PAGE,
        offset: Offset = 0,
    ) -> EpisodePage:
        with store.session() as s:
            counts = browse.splits(s)
            if split is not None and split not in counts:
                raise UnknownLoopItemError(
                    f"No episodes of split '{split}'. Splits: {', '.join(counts) or 'none (no episodes yet)'}."
                )
            split = split or PRODUCTION
            found = browse.episodes_page(s, split, limit=limit, offset=offset)
            ids = [e.id for e in found]
            grades, labels = browse.grades_of_episodes(s, ids), browse.reviews_of_episodes(s, ids)
        total = counts.get(split, 0)
        items = [
            EpisodeOut(
                id=e.id, task_id=e.task_id, split=e.split, status=e.status, reward=finite(e.reward),
                arm=e.meta.get(ARM_KEY), created_at=e.created_at,
                grades=[GradeOut(version=g.version, component=g.component, grader=g.grader, score=finite(g.score))
                        for g in grades[e.id]],
                label=finite(labels[e.id].label) if e.id in labels else None,
            )
            for e in found
        ]  # fmt: skip
        return EpisodePage(
            split=split, splits=counts, total=total, offset=offset, next_offset=_next(total, offset, limit), items=items
        )

    @router.get("/reviews")
    def review_agreement() -> ReviewsOut:
        with store.session() as s:
            queued, labelled = browse.review_counts(s)
            graded = reviews.labelled_grades(s)
        return ReviewsOut(queued=queued, labelled=labelled, graders=agreement(graded))

    return router


def deployment_out(d: DeploymentRecord) -> DeploymentOut:
    return DeploymentOut(**d.model_dump(), serves=d.target)


def gate_decisions(s: Session, model: str) -> dict[int, TimelineEventOut]:
    """Each checkpoint step of ``model`` the gate decided on: its decision (the latest, should there be two)."""
    _, found = browse.audit_page(s, limit=None, actions=GATE, model=model)
    decided: dict[int, TimelineEventOut] = {}
    for event in reversed(found):  # oldest first: the latest wins
        out = _timeline_event(event)
        if out.evidence.step is not None:
            decided[out.evidence.step] = out
    return decided


# ---- reading events --------------------------------------------------------------------------------------------


def _known_model(s: Session, model: str | None) -> list[str]:
    """The models the loop's records name (deployments, timeline events); an ``UnknownLoopItemError`` for a
    ``model`` not among them."""
    named = {d.model for d in deployments.list_deployments(s)} | {
        _model_of(subject) for subject in browse.subjects(s, TIMELINE)
    }
    models = sorted(named)
    if model is not None and model not in named:
        raise UnknownLoopItemError(
            f"The loop has recorded nothing of model '{model}'. Models: {', '.join(models) or 'none yet'}."
        )
    return models


def _model_of(subject: str) -> str:
    """``calc@canary``, ``calc@3`` -> ``calc``; the loop's own events name the model alone."""
    model, sep, _ = subject.rpartition("@")
    return model if sep else subject


def _step_of(subject: str) -> int | None:
    _, sep, tail = subject.rpartition("@")
    return int(tail) if sep and tail.isdigit() else None


def _next(total: int, offset: int, limit: int) -> int | None:
    return offset + limit if offset + limit < total else None


def _kind(action: str) -> Kind:
    prefix = action.split(".", 1)[0]
    if prefix in ("gate", "shadow", "canary"):
        return prefix
    if action == "loop.rewind":
        return "rewind"
    return "alarm" if action.startswith("loop.alarm") else "deployment"


def _interval(value: Any, level: Any = None) -> IntervalOut | None:
    """A lift as the gate records it (``{"mean", "low", "high", "level", ...}``) or a verdict's difference (a list:
    mean, low, high; its level beside it)."""
    if isinstance(value, dict):
        return IntervalOut(
            mean=finite(value.get("mean")), low=finite(value.get("low")), high=finite(value.get("high")),
            level=finite(value.get("level")),
        )  # fmt: skip
    if isinstance(value, list) and len(value) == 3:
        return IntervalOut(mean=finite(value[0]), low=finite(value[1]), high=finite(value[2]), level=finite(level))
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _evidence(event: AuditEventRecord, kind: Kind) -> EvidenceOut:
    d = event.details
    refers = [
        i for key in ("gate_event", "deploy_event", "shadow_event", "replaced_event", "rollback_event", "alarm_event")
        if (i := _int(d.get(key))) is not None
    ]  # fmt: skip
    unsafe = d.get("unsafe")
    step = _step_of(event.subject) if kind == "gate" else _int(d.get("step", d.get("new_step")))
    if step is None and event.action == "remove":
        step = _int(d.get("previous_step"))
    return EvidenceOut(
        step=step,
        interval=_interval(d.get("lift") if kind == "gate" else d.get("difference"), d.get("level")),
        confirmation=_interval(d.get("confirmation")),
        look=_int(d.get("look")),
        failed=[str(c.get("name")) for c in d.get("checks", []) if isinstance(c, dict) and not c.get("passed")],
        canary_episodes=_int(d.get("canary_episodes")),
        production_episodes=_int(d.get("production_episodes")),
        pairs=_int(d.get("pairs")),
        unsafe=len(unsafe) if isinstance(unsafe, list) else None,
        share=finite(d.get("share")),
        events=refers,
    )


def _timeline_event(event: AuditEventRecord) -> TimelineEventOut:
    kind = _kind(event.action)
    return TimelineEventOut(
        id=event.id, at=event.at, actor=event.actor, action=event.action, kind=kind, subject=event.subject,
        model=_model_of(event.subject), reason=event.reason, evidence=_evidence(event, kind),
    )  # fmt: skip


def _audit_event(event: AuditEventRecord) -> AuditEventOut:
    return AuditEventOut(
        id=event.id, at=event.at, actor=event.actor, action=event.action, subject=event.subject, reason=event.reason,
        details=event.details, hash=event.hash, signed=event.mac is not None,
    )  # fmt: skip
