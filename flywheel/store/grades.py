"""Grader stacks and the grades they gave. A stack version is stored once, its spec under its content hash; the
first version of a name, and every new one, is an audit event (a new grader is a policy change); every grade names
the version that gave it, so scores of different versions are never mixed up.

The store does not grade: callers (the loop, ``flywheel graders regress``) score with ``flywheel.graders.stack`` and
record here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session

from flywheel.store import audit
from flywheel.store.episodes import EpisodeRecord, EpisodeStatus, Timestamp, _episode
from flywheel.store.schema import Episode, Grade, GraderStackVersion, Task


class UnknownStackError(LookupError):
    def __init__(self, version: str):
        super().__init__(f"No grader stack version {version!r} is stored (register it first).")
        self.version = version


class StackRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    version: str
    name: str
    spec: dict[str, Any]
    created_at: Timestamp


class GradeRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    episode_id: str
    version: str
    component: str  # reward | safety | holdout/<name>
    grader: str
    score: float
    details: dict[str, Any]
    created_at: Timestamp


def register_stack(s: Session, name: str, version: str, spec: dict[str, Any], *, actor: str) -> StackRecord:
    """Store a stack version (once; registering it again changes nothing) and audit it as a policy change."""
    if (row := s.get(GraderStackVersion, version)) is not None:
        return StackRecord.model_validate(row)
    previous = s.scalars(
        select(GraderStackVersion.version)
        .where(GraderStackVersion.name == name)
        .order_by(GraderStackVersion.created_at.desc())
        .limit(1)
    ).first()
    row = GraderStackVersion(version=version, name=name, spec=spec, created_at=datetime.now(UTC))
    s.add(row)
    audit.append(
        s,
        actor=actor,
        action="graders.version",
        subject=f"graders:{name}",
        reason="first version" if previous is None else f"replaces {previous}",
        details={"version": version, "previous": previous},
    )
    s.flush()
    return StackRecord.model_validate(row)


def get_stack(s: Session, version: str) -> StackRecord:
    row = s.get(GraderStackVersion, version)
    if row is None:
        raise UnknownStackError(version)
    return StackRecord.model_validate(row)


def stack_versions(s: Session, name: str) -> list[StackRecord]:
    """A stack's versions, oldest first."""
    query = select(GraderStackVersion).where(GraderStackVersion.name == name).order_by(GraderStackVersion.created_at)
    return [StackRecord.model_validate(row) for row in s.scalars(query)]


def record_grades(
    s: Session, episode_id: str, version: str, grades: dict[str, tuple[str, float, dict[str, Any]]]
) -> None:
    """Store an episode's grades by one stack version: component -> (grader name, score, details). Grading again
    with the same version replaces its earlier grades (a model grader may answer differently)."""
    _episode(s, episode_id)
    get_stack(s, version)
    existing = {
        g.component: g for g in s.scalars(select(Grade).where(Grade.episode_id == episode_id, Grade.version == version))
    }
    now = datetime.now(UTC)
    for component, (grader, score, details) in grades.items():
        if (row := existing.get(component)) is not None:
            row.grader, row.score, row.details, row.created_at = grader, score, details, now
        else:
            s.add(Grade(episode_id=episode_id, version=version, component=component, grader=grader, score=score,
                        details=details, created_at=now))  # fmt: skip
    s.flush()


def grades_of(s: Session, episode_id: str, version: str | None = None) -> list[GradeRecord]:
    query = select(Grade).where(Grade.episode_id == episode_id).order_by(Grade.version, Grade.component)
    if version is not None:
        query = query.where(Grade.version == version)
    return [GradeRecord.model_validate(row) for row in s.scalars(query)]


def recent_finished(s: Session, *, split: str | None = None, limit: int = 1000) -> list[EpisodeRecord]:
    """The last ``limit`` finished episodes (of ``split``), oldest first: what a re-grading looks at."""
    query = select(Episode).where(Episode.status == EpisodeStatus.finished)
    if split is not None:
        query = query.where(Episode.split == split)
    rows = s.scalars(query.order_by(Episode.created_at.desc(), Episode.id.desc()).limit(limit)).all()
    return [EpisodeRecord.model_validate(row) for row in reversed(rows)]


def item_of(s: Session, episode_id: str) -> dict[str, Any]:
    """What an episode's agent was given, for graders' ``{{item.*}}``: its queued task's payload, else the
    ``item`` its creator put in its metadata, else nothing."""
    episode = _episode(s, episode_id)
    task = s.get(Task, episode.task_id)
    if task is not None:
        return dict(task.payload)
    item = episode.meta.get("item")
    return dict(item) if isinstance(item, dict) else {}
