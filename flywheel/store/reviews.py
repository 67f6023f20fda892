"""The human review queue: a random sample of scored episodes queued for a person to label, and their labels.

``sample`` queues a share of the scored episodes (those with a grade) not queued before, drawn with a seed among
those of a split and a model, so that who reviews what is not chosen by hand; an episode is queued once ever (the
table's key). A label is 1 (pass), 0 (fail) or a score from 0 to 1, with a note; each label, and each sample, is an
audit event written in the same unit of work. ``labelled_grades`` pairs every labelled episode's grades with its
label, for the agreement report (``flywheel.graders.agreement``).
"""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from flywheel.store import audit
from flywheel.store.episodes import Timestamp, _episode
from flywheel.store.schema import Episode, Grade, GraderStackVersion, Review


class LabelKind(StrEnum):
    pass_fail = "pass_fail"  # 1 pass, 0 fail
    score = "score"  # a score from 0 to 1


class ReviewError(ValueError):
    """A label the queue cannot take: its episode is not queued, the value is out of range, or the episode has
    another label already."""


class ReviewRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    episode_id: str
    sample_event: int
    queued_at: Timestamp
    label: float | None
    kind: LabelKind | None
    note: str | None
    labelled_by: str | None
    labelled_at: Timestamp | None
    label_event: int | None


class SampleResult(BaseModel):
    candidates: int  # scored episodes of the filters that were not queued yet
    queued: list[str]  # the episodes this sample queued, in the order drawn
    event_id: int | None  # its audit event (None when it queued nothing)


class LabelledGrade(BaseModel):
    """One grade of a labelled episode beside the human label: what the agreement report counts."""

    episode_id: str
    version: str
    stack: str  # the stack's name
    component: str  # reward | safety | holdout/<name>
    grader: str
    score: float
    safety_pass: float | None  # the stack's pass mark when ``component`` is its safety gate
    label: float
    kind: LabelKind


def sample(
    s: Session,
    share: float,
    *,
    seed: int,
    actor: str,
    split: str | None = None,
    model: str | None = None,
    limit: int | None = None,
    reason: str | None = None,
) -> SampleResult:
    """Queue ``share`` (0..1, rounded up) of the scored episodes (of ``split`` and ``model``) that were never
    queued, at most ``limit``, drawn with ``seed``: the same store and arguments draw the same episodes. The draw
    and its audit event are one unit of work; it holds the audit chain's head, so two samples never draw at once."""
    if not 0 < share <= 1:
        raise ValueError(f"the share to review must be above 0 and at most 1, not {share}")
    if limit is not None and limit < 1:
        raise ValueError(f"the limit must be at least 1, not {limit}")
    audit.lock(s)
    query = (
        select(Episode.id)
        .where(exists().where(Grade.episode_id == Episode.id))
        .where(~exists().where(Review.episode_id == Episode.id))
        .order_by(Episode.id)
    )
    if split is not None:
        query = query.where(Episode.split == split)
    if model is not None:
        query = query.where(Episode.model == model)
    candidates = list(s.scalars(query))
    count = min(math.ceil(share * len(candidates)), limit or len(candidates))
    drawn = random.Random(seed).sample(candidates, count)
    if not drawn:
        return SampleResult(candidates=len(candidates), queued=[], event_id=None)
    event = audit.append(
        s,
        actor=actor,
        action="review.sample",
        subject="review",
        reason=reason,
        details={"share": share, "seed": seed, "split": split, "model": model, "limit": limit,
                 "candidates": len(candidates), "queued": len(drawn)},
    )  # fmt: skip
    now = datetime.now(UTC)
    s.add_all(Review(episode_id=e, sample_event=event.id, queued_at=now) for e in drawn)
    s.flush()
    return SampleResult(candidates=len(candidates), queued=drawn, event_id=event.id)


def queue(s: Session, *, labelled: bool | None = False, limit: int | None = None) -> list[ReviewRecord]:
    """Reviews in the order they were queued: the unlabelled ones (``labelled=False``), the labelled, or all."""
    query = select(Review).order_by(Review.queued_at, Review.episode_id).limit(limit)
    if labelled is not None:
        query = query.where(Review.labelled_at.is_not(None) if labelled else Review.labelled_at.is_(None))
    return [ReviewRecord.model_validate(row) for row in s.scalars(query)]


def check_label(value: float, kind: LabelKind) -> float:
    """The label as stored, or a ``ReviewError`` saying what a label may be."""
    if kind == LabelKind.pass_fail and value not in (0, 1):
        raise ReviewError(f"a pass/fail label is 1 (pass) or 0 (fail), not {value}")
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise ReviewError(f"a score label is a number from 0 to 1, not {value}")
    return float(value)


def label(
    s: Session,
    episode_id: str,
    value: float,
    kind: LabelKind,
    *,
    actor: str,
    note: str | None = None,
    reason: str | None = None,
    relabel: bool = False,
) -> tuple[ReviewRecord, bool]:
    """Label a queued episode, with its audit event (reason: ``reason``, else the note); ``(record, changed)``.
    The same label again changes nothing (a label file read twice); another one for a labelled episode is a
    ``ReviewError`` unless ``relabel`` (its event then names the label it replaces). An unknown episode is an
    ``UnknownEpisodeError``; one that is not queued, a ``ReviewError``."""
    value = check_label(value, kind)
    audit.lock(s)  # before the review is read: two reviewers labelling one episode take turns
    _episode(s, episode_id)
    row = s.get(Review, episode_id)
    if row is None:
        raise ReviewError(
            f"episode {episode_id!r} is not in the review queue (`flywheel review sample` queues episodes)"
        )
    note = note or None
    if row.labelled_at is not None:
        if (row.label, row.kind, row.note) == (value, kind, note):
            return ReviewRecord.model_validate(row), False
        if not relabel:
            raise ReviewError(
                f"episode {episode_id!r} was already labelled {_shown(row.label, row.kind)} by {row.labelled_by}"
                " (give --relabel to replace it)"
            )
    previous: dict[str, Any] | None = (
        None if row.labelled_at is None else {"label": row.label, "kind": row.kind, "by": row.labelled_by}
    )
    event = audit.append(
        s,
        actor=actor,
        action="review.label",
        subject=f"episode:{episode_id}",
        reason=reason or note,
        details={"label": value, "kind": kind.value, "note": note, "previous": previous},
    )
    row.label, row.kind, row.note = value, kind.value, note
    row.labelled_by, row.labelled_at, row.label_event = actor, datetime.now(UTC), event.id
    s.flush()
    return ReviewRecord.model_validate(row), True


def _shown(value: float | None, kind: str | None) -> str:
    if kind == LabelKind.pass_fail:
        return "pass" if value == 1 else "fail"
    return f"{value:g}"


def labelled_grades(s: Session, *, version: str | None = None) -> list[LabelledGrade]:
    """Every grade of every labelled episode, beside its label (of one stack version, or all)."""
    query = (
        select(Grade, GraderStackVersion, Review)
        .join(Review, Review.episode_id == Grade.episode_id)
        .join(GraderStackVersion, GraderStackVersion.version == Grade.version)
        .where(Review.labelled_at.is_not(None))
        .order_by(GraderStackVersion.name, Grade.version, Grade.component, Grade.episode_id)
    )
    if version is not None:
        query = query.where(Grade.version == version)
    found = []
    for grade, stack, review in s.execute(query):
        safety_pass = float(stack.spec.get("safety_pass", 1.0)) if grade.component == "safety" else None
        found.append(
            LabelledGrade(
                episode_id=grade.episode_id, version=grade.version, stack=stack.name, component=grade.component,
                grader=grade.grader, score=grade.score, safety_pass=safety_pass, label=review.label,
                kind=review.kind,
            )
        )  # fmt: skip
    return found
