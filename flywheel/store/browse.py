"""Read-only paged queries for browsing what the loop recorded (the dashboard's loop view, ``flywheel.dashboard.
loop_api``): audit events newest first (of some actions, of one model), episodes of a split newest first, and the
grades and review labels of a page of episodes. Nothing here writes; each page comes with the total it is a page of.
"""

from __future__ import annotations

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from flywheel.store.audit import AuditEventRecord
from flywheel.store.db import in_chunks
from flywheel.store.episodes import EpisodeRecord
from flywheel.store.grades import GradeRecord
from flywheel.store.reviews import ReviewRecord
from flywheel.store.schema import AuditEvent, Episode, Grade, Review


def _of_model(model: str):
    """An event about ``model``: the model itself (the loop's own events) or one of its names (``model@...``)."""
    return or_(AuditEvent.subject == model, AuditEvent.subject.startswith(f"{model}@", autoescape=True))


def audit_page(
    s: Session,
    *,
    limit: int | None,
    offset: int = 0,
    actions: tuple[str, ...] | None = None,
    model: str | None = None,
) -> tuple[int, list[AuditEventRecord]]:
    """Audit events, newest first: how many there are, and the ``limit`` of them after skipping ``offset``."""
    conditions = []
    if actions is not None:
        conditions.append(AuditEvent.action.in_(actions))
    if model is not None:
        conditions.append(_of_model(model))
    total = s.scalar(select(func.count()).select_from(AuditEvent).where(*conditions)) or 0
    query = select(AuditEvent).where(*conditions).order_by(AuditEvent.id.desc()).limit(limit).offset(offset)
    return int(total), [AuditEventRecord.model_validate(row) for row in s.scalars(query)]


def audit_event(s: Session, event_id: int) -> AuditEventRecord | None:
    row = s.get(AuditEvent, event_id)
    return None if row is None else AuditEventRecord.model_validate(row)


def audit_span(s: Session) -> tuple[int | None, int | None]:
    """The first and last event ids (None, None for an empty trail)."""
    first, last = s.execute(select(func.min(AuditEvent.id), func.max(AuditEvent.id))).one()
    return first, last


def subjects(s: Session, actions: tuple[str, ...]) -> list[str]:
    """The subjects events of ``actions`` name, sorted."""
    query = select(AuditEvent.subject).where(AuditEvent.action.in_(actions)).distinct()
    return sorted(s.scalars(query))


def splits(s: Session) -> dict[str, int]:
    """Each split's episodes, by split name."""
    query = select(Episode.split, func.count()).group_by(Episode.split).order_by(Episode.split)
    return {split: int(n) for split, n in s.execute(query)}


def episodes_page(s: Session, split: str, *, limit: int, offset: int = 0) -> list[EpisodeRecord]:
    """Episodes of ``split``, newest first."""
    query = (
        select(Episode)
        .where(Episode.split == split)
        .order_by(Episode.created_at.desc(), Episode.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return [EpisodeRecord.model_validate(row) for row in s.scalars(query)]


def grades_of_episodes(s: Session, ids: list[str]) -> dict[str, list[GradeRecord]]:
    """The grades of each of ``ids`` (every stack version's), by episode; by version and component within one."""
    found: dict[str, list[GradeRecord]] = {i: [] for i in ids}
    for chunk in in_chunks(ids):
        query = select(Grade).where(Grade.episode_id.in_(chunk)).order_by(Grade.version, Grade.component)
        for row in s.scalars(query):
            found[row.episode_id].append(GradeRecord.model_validate(row))
    return found


def reviews_of_episodes(s: Session, ids: list[str]) -> dict[str, ReviewRecord]:
    """The review of each of ``ids`` that was queued for one."""
    found: dict[str, ReviewRecord] = {}
    for chunk in in_chunks(ids):
        for row in s.scalars(select(Review).where(Review.episode_id.in_(chunk))):
            found[row.episode_id] = ReviewRecord.model_validate(row)
    return found


def review_counts(s: Session) -> tuple[int, int]:
    """Episodes queued for review, and how many of them are labelled."""
    queued, labelled = s.execute(select(func.count(), func.count(Review.labelled_at))).one()
    return int(queued), int(labelled)
