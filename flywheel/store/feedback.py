"""Outcome feedback on an episode that arrives after it (a ticket resolved or reopened, a user's rating, a KPI):
appended, never replacing the reward the episode was finished with, accepted whatever the episode's state.

A feedback row has a ``kind`` (``resolved``, ``rating``, ``kpi/refund_rate``: any short name), a finite ``value``,
and optionally a note, its source and a ``key``: the sender's own id for it, which makes posting it again harmless
(the same key with the same content changes nothing; with other content it is an ``EpisodeConflictError``).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session

from flywheel.store.episodes import EpisodeConflictError, Timestamp, _episode
from flywheel.store.schema import Feedback


class FeedbackRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    episode_id: str
    kind: str
    value: float
    note: str | None
    source: str | None
    key: str | None
    created_at: Timestamp


def add_feedback(
    s: Session,
    episode_id: str,
    *,
    kind: str,
    value: float,
    note: str | None = None,
    source: str | None = None,
    key: str | None = None,
) -> tuple[FeedbackRecord, bool]:
    """Append feedback to an episode; ``(record, created)``: not created when its key was already posted."""
    if not math.isfinite(value):
        raise ValueError(f"the feedback's value was {value}; it must be a finite number")
    _episode(s, episode_id, lock=True)  # unknown: UnknownEpisodeError; the lock orders two posts of one key
    if key is not None:
        found = s.scalars(select(Feedback).where(Feedback.episode_id == episode_id, Feedback.key == key)).first()
        if found is not None:
            if (found.kind, found.value, found.note, found.source) != (kind, float(value), note, source):
                raise EpisodeConflictError(
                    f"Feedback {key!r} of episode {episode_id!r} was already posted with other content "
                    f"({found.kind}={found.value})."
                )
            return FeedbackRecord.model_validate(found), False
    row = Feedback(
        episode_id=episode_id, kind=kind, value=float(value), note=note, source=source, key=key,
        created_at=datetime.now(UTC),
    )  # fmt: skip
    s.add(row)
    s.flush()
    return FeedbackRecord.model_validate(row), True


def feedback_of(s: Session, episode_id: str) -> list[FeedbackRecord]:
    """An episode's feedback, in the order it arrived."""
    _episode(s, episode_id)
    query = select(Feedback).where(Feedback.episode_id == episode_id).order_by(Feedback.id)
    return [FeedbackRecord.model_validate(row) for row in s.scalars(query)]
