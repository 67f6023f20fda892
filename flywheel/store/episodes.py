"""Episodes and the calls recorded in them: create, record, reward, finish or abandon, read.

Functions take a ``Session`` (one unit of work: ``with store.session() as s``) and return plain records, so a
caller never holds a live database row. Outcomes are idempotent: posting the same reward or finishing twice with
the same outcome changes nothing; a different outcome for a closed episode is an ``EpisodeConflictError``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from flywheel.gateway.schemas import EpisodeRecord, EpisodeStatus, Timestamp
from flywheel.store.db import storable, write_lock
from flywheel.store.schema import Call, Episode

CALLS = Call.__table__
LOST_CALLS = "flywheel_lost_calls"  # meta: how many calls it lost (answered, never recorded)


class UnknownEpisodeError(LookupError):
    def __init__(self, episode_id: str):
        super().__init__(f"No episode with id {episode_id!r}.")
        self.episode_id = episode_id


class EpisodeConflictError(RuntimeError):
    """An outcome for an episode that already has another one (finished or abandoned)."""


class CallRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    episode_id: str
    model: str
    step: int | None
    request: dict[str, Any]
    response: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    prefix_call: int | None
    prefix_choice: int | None
    prefix_message: int | None
    retokenized_turns: int
    reward: float | None
    created_at: Timestamp
    upstream: str | None = None  # the upstream that answered it, if not the local engine
    text_only: bool = False  # no token ids recorded: not for RL
    deployment: str | None = None  # the alias it was asked as (calc@production), if any: step is what it meant


def _now() -> datetime:
    return datetime.now(UTC)


def _finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{what} was {value}; rewards must be finite numbers")
    return float(value)


def new_episode_id() -> str:
    """128 random bits: knowing an episode's URL is what lets an agent call through it."""
    return "ep_" + secrets.token_urlsafe(16)


def create_episode(
    s: Session, task_id: str, *, split: str = "train", model: str | None = None, meta: dict[str, Any] | None = None
) -> EpisodeRecord:
    row = Episode(
        id=new_episode_id(), task_id=task_id, split=split, model=model, status=EpisodeStatus.open, reward=None,
        metrics={}, meta=dict(meta or {}), created_at=_now(), finished_at=None,
    )  # fmt: skip
    s.add(row)
    s.flush()
    return EpisodeRecord.model_validate(row)


def _episode(s: Session, episode_id: str, *, lock: bool = False) -> Episode:
    """The episode's row; with ``lock``, locked until the unit of work ends and read afresh (not the copy this
    session read before), for a unit of work that reads it and then writes it: on SQLite the database's write lock
    is taken before the read (Python's sqlite3 runs a SELECT outside any transaction, so what it read could change
    before the write), on PostgreSQL the row is locked (``FOR UPDATE``)."""
    query = select(Episode).where(Episode.id == episode_id)
    if lock:
        write_lock(s)
        query = query.with_for_update().execution_options(populate_existing=True)
    row = s.scalars(query).one_or_none()
    if row is None:
        raise UnknownEpisodeError(episode_id)
    return row


def get_episode(s: Session, episode_id: str) -> EpisodeRecord:
    return EpisodeRecord.model_validate(_episode(s, episode_id))


def splits_of(s: Session, episode_ids: Iterable[str]) -> dict[str, str]:
    """The split of each of these episodes that exists."""
    return dict(s.execute(select(Episode.id, Episode.split).where(Episode.id.in_(list(episode_ids)))).all())


def list_episodes(
    s: Session,
    *,
    task_id: str | None = None,
    split: str | None = None,
    status: EpisodeStatus | None = None,
    limit: int = 100,
    offset: int = 0,
) -> list[EpisodeRecord]:
    query = select(Episode).order_by(Episode.created_at, Episode.id).limit(limit).offset(offset)
    if task_id is not None:
        query = query.where(Episode.task_id == task_id)
    if split is not None:
        query = query.where(Episode.split == split)
    if status is not None:
        query = query.where(Episode.status == status)
    return [EpisodeRecord.model_validate(row) for row in s.scalars(query)]


def check_open(s: Session, episode_id: str) -> EpisodeRecord:
    """The episode, if calls may still be recorded in it."""
    episode = get_episode(s, episode_id)
    if episode.status != EpisodeStatus.open:
        raise EpisodeConflictError(f"Episode {episode_id!r} is {episode.status.value}: it takes no more calls.")
    return episode


def add_call(s: Session, episode_id: str, **fields: Any) -> CallRecord:
    """Record a call (``fields``: the columns of ``Call`` but id, episode_id, created_at) in an open episode."""
    (outcome,) = add_calls(s, [(episode_id, fields)])
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def add_calls(
    s: Session, calls: Sequence[tuple[str, dict[str, Any]]]
) -> list[CallRecord | UnknownEpisodeError | EpisodeConflictError | ValueError]:
    """Record calls (each an episode id and ``add_call``'s fields) in one insert, ids in the order given; for each,
    its record, or the error that refused it (its episode unknown or closed, or a value no database can hold:
    the others are recorded all the same). The episodes' rows are locked until the unit of work ends (on SQLite,
    the database's write lock, taken before their status is read), so an episode finished meanwhile (by another
    process too) either waits for these calls or refuses them. One bulk insert, not the ORM's unit of work, which
    takes several times as long per row."""
    write_lock(s)
    wanted = sorted({episode_id for episode_id, _ in calls})  # one order: writers lock rows without a deadlock
    query = select(Episode.id, Episode.status).where(Episode.id.in_(wanted)).order_by(Episode.id).with_for_update()
    status = dict(s.execute(query).all())
    refused: dict[int, UnknownEpisodeError | EpisodeConflictError | ValueError] = {}
    rows: list[dict[str, Any]] = []
    for i, (episode_id, fields) in enumerate(calls):
        if episode_id not in status:
            refused[i] = UnknownEpisodeError(episode_id)
        elif status[episode_id] != EpisodeStatus.open:
            refused[i] = EpisodeConflictError(
                f"Episode {episode_id!r} is {status[episode_id]}: it takes no more calls."
            )
        else:
            row = {"episode_id": episode_id, "created_at": _now(), **fields}
            try:
                storable(CALLS, row)
                rows.append(row)
            except ValueError as exc:
                refused[i] = exc
    ids = s.scalars(insert(CALLS).returning(CALLS.c.id, sort_by_parameter_order=True), rows).all() if rows else []
    records = iter(CallRecord.model_validate({"id": id_, **row}) for id_, row in zip(ids, rows, strict=True))
    return [refused[i] if i in refused else next(records) for i in range(len(calls))]


def calls(s: Session, episode_id: str) -> list[CallRecord]:
    _episode(s, episode_id)
    query = select(Call).where(Call.episode_id == episode_id).order_by(Call.id)
    return [CallRecord.model_validate(row) for row in s.scalars(query)]


def set_outcome(
    s: Session,
    episode_id: str,
    *,
    reward: float | None = None,
    metrics: dict[str, Any] | None = None,
    call_rewards: dict[int, float] | None = None,
    finish: bool = False,
) -> EpisodeRecord:
    """Record an episode's reward, metrics and per-call rewards, and finish it if ``finish``. While it is open,
    a later value replaces an earlier one. Once it is finished, the same outcome again is accepted and changes
    nothing (a retried request); any other is a conflict."""
    row = _episode(s, episode_id, lock=True)
    reward = None if reward is None else _finite(reward, "reward")
    call_rewards = {int(k): _finite(v, f"the reward of call {k}") for k, v in (call_rewards or {}).items()}
    owned = {c.id: c for c in s.scalars(select(Call).where(Call.episode_id == episode_id, Call.id.in_(call_rewards)))}
    if unknown := sorted(set(call_rewards) - set(owned)):
        raise ValueError(f"call ids {unknown} are not calls of episode {episode_id!r}")
    if row.status != EpisodeStatus.open:
        same = (
            row.status == EpisodeStatus.finished
            and (reward is None or reward == row.reward)
            and all(row.metrics.get(k) == v for k, v in (metrics or {}).items())
            and all(owned[k].reward == v for k, v in call_rewards.items())
        )
        if not same:
            raise EpisodeConflictError(
                f"Episode {episode_id!r} is already {row.status}"
                + (f" with reward {row.reward}" if row.status == EpisodeStatus.finished else "")
                + (f" ({row.meta['abandoned_because']})" if row.meta.get("abandoned_because") else "")
                + ": its outcome cannot change."
            )
        return EpisodeRecord.model_validate(row)
    if reward is not None:
        row.reward = reward
    if metrics:
        row.metrics = {**row.metrics, **metrics}
    for call_id, value in call_rewards.items():
        owned[call_id].reward = value
    if finish:
        if row.reward is None:
            raise ValueError(f"Episode {episode_id!r} has no reward yet: finish it with one")
        row.status, row.finished_at = EpisodeStatus.finished, _now()
    s.flush()
    return EpisodeRecord.model_validate(row)


def abandon(s: Session, episode_id: str, reason: str | None = None) -> EpisodeRecord:
    """Close an episode without an outcome (it never trains); abandoning twice is accepted."""
    row = _episode(s, episode_id, lock=True)
    if row.status == EpisodeStatus.finished:
        raise EpisodeConflictError(f"Episode {episode_id!r} is already finished: it cannot be abandoned.")
    if row.status == EpisodeStatus.open:
        row.status, row.finished_at = EpisodeStatus.abandoned, _now()
        if reason:
            row.meta = {**row.meta, "abandoned_because": reason}
    s.flush()
    return EpisodeRecord.model_validate(row)


def lose_call(s: Session, episode_id: str, reason: str) -> EpisodeRecord:
    """Note that an episode lost a call: one its agent was answered, that is not in the store (its write failed
    after the answer, or its gateway stopped before writing it). An open episode is abandoned with ``reason``, so
    that it never trains with a call missing (its finish is then a conflict that names ``reason``); a finished one
    keeps its outcome (it was committed before the call could be: the call came after it, as a late call does);
    ``meta[LOST_CALLS]`` counts its lost calls."""
    row = _episode(s, episode_id, lock=True)
    meta = {**row.meta, LOST_CALLS: int(row.meta.get(LOST_CALLS, 0)) + 1}
    if row.status == EpisodeStatus.open:
        row.status, row.finished_at = EpisodeStatus.abandoned, _now()
        meta["abandoned_because"] = reason
    row.meta = meta
    s.flush()
    return EpisodeRecord.model_validate(row)
