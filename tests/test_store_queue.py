"""The rollout queue's store functions under concurrency, on SQLite and on a real PostgreSQL server: units of work
that race in threads of one process, each with its own connection, as a gateway's worker threads do."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from flywheel.store import Store, tasks

from helpers import at_once


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def test_identical_enqueues_at_once_make_one_task(store: Store):
    """The same task posted by several clients at the same instant (a retried request racing its original) is one
    task: one is new, the others are told it exists; never a duplicate key error (on PostgreSQL both inserts ran
    before the fix, and the second failed on the primary key)."""
    for round_ in range(12):
        task_id = f"twice-{round_}"

        def enqueue(_: int, task_id: str = task_id) -> bool:
            with store.session() as s:
                task, new = tasks.enqueue(s, task_id, {"q": round_}, group_size=3)
            assert task.id == task_id and task.group_size == 3
            return new

        results, errors = at_once(4, enqueue)
        assert errors == [] and sorted(results) == [False, False, False, True], (round_, errors, results)
        with store.session() as s:
            task, attempts = tasks.get_task(s, task_id)
        assert len(attempts) == 3 and task.counts[tasks.AttemptStatus.queued] == 3


def test_different_enqueues_of_one_id_at_once_are_one_task_and_conflicts(store: Store):
    """Two groups under one id at the same instant: one is queued, the others are a ``TaskConflictError`` (a 409),
    not a database error."""
    for round_ in range(6):
        task_id = f"clash-{round_}"

        def enqueue(i: int, task_id: str = task_id) -> bool:
            with store.session() as s:
                return tasks.enqueue(s, task_id, {"who": i}, group_size=2)[1]

        results, errors = at_once(3, enqueue)
        assert results == [True] and len(errors) == 2, (round_, results, errors)
        assert all(isinstance(e, tasks.TaskConflictError) for e in errors), errors


def test_concurrent_claims_never_lease_an_attempt_twice(store: Store):
    """Eight threads claim at once until the queue is empty: each attempt is leased exactly once (on SQLite the
    write lock is taken before the claim reads; on PostgreSQL the claimed row is locked and other claims skip it)."""
    with store.session() as s:
        tasks.enqueue(s, "many", {}, group_size=40)
    leased: Counter[str] = Counter()

    def claim_all(i: int) -> None:
        while True:
            with store.session() as s:
                lease = tasks.claim(s, f"r{i}", 30)
            if lease is None:
                return
            leased[lease.attempt.id] += 1
            with store.session() as s:
                tasks.complete(s, lease.attempt.id, lease.episode.id, reward=1.0)

    _, errors = at_once(8, claim_all)
    assert errors == [] and len(leased) == 40 and set(leased.values()) == {1}, (errors, leased)
    with store.session() as s:
        task, _ = tasks.get_task(s, "many")
        listed = {status: tasks.list_tasks(s, status=status) for status in tasks.TaskStatus}
    assert task.complete and task.counts[tasks.AttemptStatus.finished] == 40
    assert {status: [t.id for t in found] for status, found in listed.items()} == {
        "open": [],
        "complete": ["many"],
        "failed": [],
    }


def test_64_units_of_work_at_once_each_get_a_connection(pg_url: str):
    """64 agents' store calls in flight at once on PostgreSQL each hold a connection: the pool opens them (16 kept,
    48 more in a burst) instead of making the 16th wait (SQLAlchemy's default pool, 5 + 10, would: the barrier
    inside the units of work then times out)."""
    store = Store(pg_url)
    try:
        inside = threading.Barrier(64, timeout=20)

        def unit(_: int) -> int:
            with store.session() as s:
                tasks.list_tasks(s)
                inside.wait()  # all 64 hold their connection here together
                return 1

        results, errors = at_once(64, unit)
        assert errors == [] and sum(results) == 64, errors[:3]
    finally:
        store.close()
