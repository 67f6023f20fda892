"""The rollout queue: tasks the training side enqueues, and the attempts that runners claim, run and report on.

A task (its id is the group key: the episodes it produces carry it) has ``group_size`` attempts. An attempt is
``queued``; ``leased`` to a runner, with the episode created for it when it was claimed and a lease expiry;
``finished`` (its episode finished with a reward); or ``failed`` (its tries ran out, or ``cancel`` ended its task).
A lease *is* its episode: heartbeats, results and failures name the episode, and one for an episode the attempt no
longer runs in is a ``LeaseLostError`` that changes nothing. A lease past its expiry is over: its episode is
abandoned and the attempt requeued with one more try counted, or failed at ``max_tries``. So a task never has more
than ``group_size`` finished episodes, whatever runners die, stall or answer late.

Atomicity: on PostgreSQL the rows a unit of work changes are locked (``FOR UPDATE``; a claim skips the rows other
claims hold). SQLite has one writer: a unit of work that changes the queue takes the write lock before it reads
(``BEGIN IMMEDIATE``), so what it read is still true when it writes.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel
from sqlalchemy import case, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from flywheel.gateway.schemas import (
    MAX_GROUP_SIZE,
    AttemptRecord,
    AttemptStatus,
    EpisodeRecord,
    EpisodeStatus,
    TaskRecord,
    TaskStatus,
)
from flywheel.store import episodes
from flywheel.store.db import write_lock
from flywheel.store.schema import Attempt, Episode, Task

LEASE_EXPIRED = "lease expired"


class UnknownTaskError(LookupError):
    def __init__(self, task_id: str):
        super().__init__(f"No task with id {task_id!r}.")


class UnknownAttemptError(LookupError):
    def __init__(self, attempt_id: str):
        super().__init__(f"No attempt with id {attempt_id!r}.")


class TaskConflictError(RuntimeError):
    """A task id that already names another group."""


class LeaseLostError(RuntimeError):
    """A heartbeat, result or failure for a lease that is no longer the attempt's: nothing was changed."""


class Claim(BaseModel):
    """A claimed attempt and what its runner needs: the task's payload and the episode to run it in (the queue
    sends it as a ``Lease``)."""

    attempt: AttemptRecord
    payload: dict[str, Any]
    model: str | None
    split: str
    episode: EpisodeRecord


def _now() -> datetime:
    return datetime.now(UTC)


def new_attempt_id() -> str:
    return "at_" + secrets.token_urlsafe(16)


def _tasks_query():
    """Tasks with their attempts counted by state, and the expression of the task's status."""

    def count(state: AttemptStatus):
        return func.coalesce(func.sum(case((Attempt.status == state.value, 1), else_=0)), 0).label(state.value)

    counts = select(Attempt.task_id, *(count(state) for state in AttemptStatus)).group_by(Attempt.task_id).subquery()
    status = case(
        (counts.c.finished >= Task.group_size, TaskStatus.complete.value),
        (counts.c.queued + counts.c.leased > 0, TaskStatus.open.value),
        else_=TaskStatus.failed.value,
    )
    columns = [counts.c[state.value] for state in AttemptStatus]
    return select(Task, status, *columns).join(counts, counts.c.task_id == Task.id), status


def _task_record(row: Any) -> TaskRecord:
    task, status, *counts = row
    return TaskRecord(
        id=task.id, payload=task.payload, group_size=task.group_size, split=task.split, model=task.model,
        max_tries=task.max_tries, created_at=task.created_at, status=status,
        counts=dict(zip(AttemptStatus, counts, strict=True)),
    )  # fmt: skip


def _task(s: Session, task_id: str) -> TaskRecord:
    query, _ = _tasks_query()
    row = s.execute(query.where(Task.id == task_id)).one_or_none()
    if row is None:
        raise UnknownTaskError(task_id)
    return _task_record(row)


def enqueue(
    s: Session,
    task_id: str,
    payload: dict[str, Any],
    *,
    group_size: int,
    split: str = "train",
    model: str | None = None,
    max_tries: int = 3,
) -> tuple[TaskRecord, bool]:
    """Queue a task's ``group_size`` attempts; returns the task and whether it is new. The same task again is
    accepted and changes nothing (a retried request); a task id that names another group is a conflict."""
    if not 1 <= group_size <= MAX_GROUP_SIZE:
        raise ValueError(f"group_size was {group_size}; it must be from 1 to {MAX_GROUP_SIZE}")
    if max_tries < 1:
        raise ValueError(f"max_tries was {max_tries}; an attempt needs at least 1 try")
    write_lock(s)
    wanted = {"payload": payload, "group_size": group_size, "split": split, "model": model, "max_tries": max_tries}
    existing = s.get(Task, task_id)
    if existing is None:
        if s.scalars(select(Episode.id).where(Episode.task_id == task_id).limit(1)).first() is not None:
            raise TaskConflictError(
                f"Episodes with task id {task_id!r} exist already: a queued task's group holds its attempts' episodes"
                " only; give it another id."
            )
        now = _now()
        try:
            # the task before its attempts (their foreign key), in a savepoint: on PostgreSQL, an enqueue of the same
            # id in another transaction may insert it first (this insert waits for that one to commit, then fails)
            with s.begin_nested():
                s.add(Task(id=task_id, created_at=now, **wanted))
        except IntegrityError:
            existing = s.get(Task, task_id)
            if existing is None:  # not that race: another constraint failed
                raise
    if existing is not None:
        if differs := [name for name, value in wanted.items() if getattr(existing, name) != value]:
            raise TaskConflictError(
                f"Task {task_id!r} is already queued with another {', '.join(differs)}: a task id names one group;"
                " give the new one another id."
            )
        return _task(s, task_id), False
    for index in range(group_size):
        attempt = Attempt(
            id=new_attempt_id(), task_id=task_id, index=index, status=AttemptStatus.queued, tries=0, runner=None,
            episode_id=None, lease_seconds=None, lease_expires_at=None, error=None, created_at=now, finished_at=None,
        )  # fmt: skip
        s.add(attempt)
    s.flush()
    return _task(s, task_id), True


def _end_try(s: Session, row: Attempt, reason: str, now: datetime) -> None:
    """End the attempt's try without a result: its episode abandoned, the attempt requeued, or failed once its tries
    are used up. An episode that its runner finished through the episode API is the attempt's result."""
    # a finish waits, or went first
    episode = episodes._episode(s, row.episode_id, lock=True) if row.episode_id else None
    row.lease_expires_at = None
    if episode is not None and episode.status == EpisodeStatus.finished:
        row.status, row.finished_at = AttemptStatus.finished, now
        return
    if episode is not None:
        episodes.abandon(s, episode.id, reason)  # an episode abandoned already stays as it is
    task = s.get(Task, row.task_id)
    assert task is not None  # attempts go with their task (a foreign key)
    row.tries += 1
    row.error, row.runner = reason[:2000], None
    if row.tries >= task.max_tries:
        row.status, row.finished_at = AttemptStatus.failed, now
    else:
        row.status = AttemptStatus.queued


def cancel(s: Session, prefix: str, reason: str) -> list[str]:
    """Cancel the open tasks whose id starts with ``prefix`` (a training side that will not read their groups: a
    restarted loop): their queued and leased attempts fail with ``reason``, a leased one's episode is abandoned (one
    its runner finished already is the attempt's result). A runner's late heartbeat or result for one of them is a
    ``LeaseLostError`` that changes nothing. Returns the tasks' ids, oldest first."""
    if not prefix:
        raise ValueError("cancel needs a task id prefix: an empty one would name every task")
    now = _now()
    write_lock(s)
    _expire_due(s, now)
    query = (
        select(Attempt)
        .where(Attempt.status.in_([AttemptStatus.queued, AttemptStatus.leased]))
        .where(Attempt.task_id.startswith(prefix, autoescape=True))
        .order_by(Attempt.created_at, Attempt.task_id, Attempt.index)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    cancelled: dict[str, None] = {}
    for row in s.scalars(query).all():
        cancelled[row.task_id] = None
        leased = row.episode_id if row.status == AttemptStatus.leased else None
        episode = episodes._episode(s, leased, lock=True) if leased else None
        row.lease_expires_at, row.finished_at = None, now
        if episode is not None and episode.status == EpisodeStatus.finished:
            row.status = AttemptStatus.finished
            continue
        if episode is not None:
            episodes.abandon(s, episode.id, reason)
        row.status, row.error, row.runner = AttemptStatus.failed, reason[:2000], None
    s.flush()
    return list(cancelled)


def _expire_due(s: Session, now: datetime, attempt_id: str | None = None) -> None:
    query = select(Attempt).where(Attempt.status == AttemptStatus.leased, Attempt.lease_expires_at <= now)
    if attempt_id is not None:
        query = query.where(Attempt.id == attempt_id)
    for row in s.scalars(query.with_for_update(skip_locked=True).execution_options(populate_existing=True)).all():
        _end_try(s, row, LEASE_EXPIRED, now)


def expire_leases(s: Session) -> None:
    """Requeue (or fail) every attempt whose lease ran out. Without a lease due it only reads (and locks nothing)."""
    now = _now()
    due = select(Attempt.id).where(Attempt.status == AttemptStatus.leased, Attempt.lease_expires_at <= now)
    if s.scalars(due.limit(1)).first() is not None:
        write_lock(s)
        _expire_due(s, now)


def get_task(s: Session, task_id: str) -> tuple[TaskRecord, list[AttemptRecord]]:
    """The task, its counts and its attempts, as of now (leases due are expired first)."""
    expire_leases(s)
    task = _task(s, task_id)
    rows = s.scalars(select(Attempt).where(Attempt.task_id == task_id).order_by(Attempt.index))
    return task, [AttemptRecord.model_validate(row) for row in rows]


def list_tasks(s: Session, *, status: TaskStatus | None = None, limit: int = 100, offset: int = 0) -> list[TaskRecord]:
    """Tasks, oldest first, as of now (leases due are expired first)."""
    expire_leases(s)
    query, status_of = _tasks_query()
    if status is not None:
        query = query.where(status_of == status.value)
    query = query.order_by(Task.created_at, Task.id).limit(limit).offset(offset)
    return [_task_record(row) for row in s.execute(query)]


def claim(s: Session, runner: str, lease_seconds: float) -> Claim | None:
    """Lease the oldest queued attempt to ``runner`` for ``lease_seconds``, with a new episode for it to run in;
    None when nothing is queued. Leases due are expired first, so their attempts may be the ones claimed."""
    if not lease_seconds > 0:
        raise ValueError(f"lease_seconds was {lease_seconds}; a lease lasts a positive number of seconds")
    now = _now()
    write_lock(s)
    _expire_due(s, now)
    oldest = (
        select(Attempt)
        .where(Attempt.status == AttemptStatus.queued)
        .order_by(Attempt.created_at, Attempt.task_id, Attempt.index)
        .limit(1)
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    )
    row = s.scalars(oldest).first()
    if row is None:
        return None
    task = s.get(Task, row.task_id)
    assert task is not None
    meta = {"task_id": task.id, "attempt_id": row.id, "try": row.tries + 1}
    episode = episodes.create_episode(s, task.id, split=task.split, model=task.model, meta=meta)
    row.status, row.runner, row.episode_id = AttemptStatus.leased, runner, episode.id
    row.lease_seconds, row.lease_expires_at = lease_seconds, now + timedelta(seconds=lease_seconds)
    s.flush()
    attempt = AttemptRecord.model_validate(row)
    return Claim(attempt=attempt, payload=task.payload, model=task.model, split=task.split, episode=episode)


def _attempt(s: Session, attempt_id: str) -> Attempt:
    """The attempt's row, locked for this unit of work."""
    write_lock(s)
    query = select(Attempt).where(Attempt.id == attempt_id).with_for_update()
    row = s.scalars(query.execution_options(populate_existing=True)).one_or_none()
    if row is None:
        raise UnknownAttemptError(attempt_id)
    return row


def _check_lease(s: Session, row: Attempt, episode_id: str, now: datetime) -> None:
    """That the attempt (locked) is leased for ``episode_id`` now; a lease past its expiry is ended first."""
    _expire_due(s, now, row.id)
    if row.status == AttemptStatus.leased and row.episode_id == episode_id:
        return
    ended = (
        f" after {row.tries} {'try' if row.tries == 1 else 'tries'} that ended without a result (the last: {row.error})"
        if row.tries
        else f" ({row.error})"
        if row.error
        else ""
    )
    raise LeaseLostError(
        f"Attempt {row.id!r} holds no lease for episode {episode_id!r}: it is {row.status}{ended}. Nothing was changed."
    )  # the episode it runs in now is not named: an episode id lets its holder call through it


def heartbeat(s: Session, attempt_id: str, episode_id: str, lease_seconds: float | None = None) -> AttemptRecord:
    """Extend a live lease by ``lease_seconds`` from now (by default, as long as it was claimed for)."""
    if lease_seconds is not None and not lease_seconds > 0:
        raise ValueError(f"lease_seconds was {lease_seconds}; a lease lasts a positive number of seconds")
    now = _now()
    row = _attempt(s, attempt_id)
    _check_lease(s, row, episode_id, now)
    seconds = lease_seconds or row.lease_seconds
    assert seconds is not None  # a leased attempt has its lease's length
    row.lease_seconds, row.lease_expires_at = seconds, now + timedelta(seconds=seconds)
    s.flush()
    return AttemptRecord.model_validate(row)


def complete(
    s: Session,
    attempt_id: str,
    episode_id: str,
    *,
    reward: float,
    metrics: dict[str, Any] | None = None,
    call_rewards: dict[int, float] | None = None,
) -> tuple[AttemptRecord, EpisodeRecord]:
    """Finish the leased attempt's episode with its outcome, and the attempt. The same result again is accepted and
    changes nothing; another outcome for it then is an ``EpisodeConflictError``."""
    now = _now()
    row = _attempt(s, attempt_id)
    retried = row.status == AttemptStatus.finished and row.episode_id == episode_id
    if not retried:
        _check_lease(s, row, episode_id, now)
    episode = episodes.set_outcome(
        s, episode_id, reward=reward, metrics=metrics, call_rewards=call_rewards, finish=True
    )
    if not retried:
        row.status, row.finished_at, row.lease_expires_at = AttemptStatus.finished, now, None
    s.flush()
    return AttemptRecord.model_validate(row), episode


def fail(s: Session, attempt_id: str, episode_id: str, reason: str) -> tuple[AttemptRecord, EpisodeRecord]:
    """End the leased attempt's try without a result: its episode abandoned with ``reason``, the attempt requeued
    (one more try counted) or failed once its tries are used up."""
    now = _now()
    row = _attempt(s, attempt_id)
    _check_lease(s, row, episode_id, now)
    _end_try(s, row, reason, now)
    s.flush()
    return AttemptRecord.model_validate(row), episodes.get_episode(s, episode_id)
