"""The audit trail (flywheel/store/audit.py) on SQLite and PostgreSQL: the chain verifies; a row changed, deleted
or inserted afterwards with raw SQL (not through ``audit.append``) is found at its id; appends from several threads
at once keep one chain. No model: store only."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from sqlalchemy import insert, select, text

from flywheel.store import Store, audit
from flywheel.store.schema import AuditEvent, AuditHead

from helpers import at_once


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def append(store: Store, n: int) -> list[audit.AuditEventRecord]:
    with store.session() as s:
        return [
            audit.append(
                s, actor="ana", action="test", subject=f"thing-{i}", reason=f"because {i}",
                details={"i": i, "share": 0.1 * i, "nested": {"b": [1, 2], "a": "é ✓"}},
            )
            for i in range(1, n + 1)
        ]  # fmt: skip


def verify(store: Store) -> audit.AuditReport:
    with store.session() as s:
        return audit.verify(s)


def sql(store: Store, statement: str, **params) -> None:
    with store.session() as s:
        s.execute(text(statement), params)


def test_the_chain_verifies_and_links_each_event_to_the_one_before(store):
    assert verify(store).ok and verify(store).count == 0  # an empty chain
    events = append(store, 5)
    report = verify(store)
    assert report.ok and report.count == 5 and report.bad_id is None, report
    assert events[0].prev_hash == audit.GENESIS
    assert [e.prev_hash for e in events[1:]] == [e.hash for e in events[:-1]]
    with store.session() as s:
        read = audit.events(s)
        assert read == events  # what was hashed is what the database gives back (time zone, JSON, unicode)
        assert audit.events(s, limit=2) == events[-2:]
        assert audit.events(s, subject="thing-3") == [events[2]]
        head = s.get(AuditHead, 1)
        assert head is not None and (head.count, head.hash) == (5, events[-1].hash)


def test_bad_details_are_refused_and_nothing_is_written(store):
    with store.session() as s:
        with pytest.raises(ValueError, match="not JSON"):
            audit.append(s, actor="ana", action="test", subject="x", details={"when": datetime.now(UTC)})
        with pytest.raises(ValueError, match="not JSON"):
            audit.append(s, actor="ana", action="test", subject="x", details={"v": float("nan")})
        with pytest.raises(ValueError, match="actor is empty"):
            audit.append(s, actor="", action="test", subject="x")
        with pytest.raises(ValueError, match="at most 2000"):
            audit.append(s, actor="ana", action="test", subject="x", reason="y" * 2001)
    report = verify(store)
    assert report.ok and report.count == 0


@pytest.mark.parametrize("column", ["reason", "actor", "at", "details"])
def test_a_changed_field_is_found_at_its_row(store, column):
    append(store, 4)
    value = {
        "reason": "nothing happened",
        "actor": "mallory",
        "at": datetime(2020, 1, 1, tzinfo=UTC),
        "details": '{"i": 2, "share": 0.9}',
    }[column]
    with store.session() as s:  # through the table, not audit.append: as someone with the database's password
        s.execute(AuditEvent.__table__.update().where(AuditEvent.id == 2).values({column: value}))
    report = verify(store)
    assert not report.ok and report.bad_id == 2 and report.count == 1, report
    assert "row 2 was changed" in report.message


def test_a_row_rewritten_with_a_new_hash_is_found_at_its_row(store):
    append(store, 4)
    with store.session() as s:  # a careful forger: the new contents' hash too
        row = s.scalars(select(AuditEvent).where(AuditEvent.id == 2)).one()
        row.reason = "nothing happened"
        row.hash = audit.digest(row)
    report = verify(store)
    assert not report.ok and report.bad_id == 2, report
    assert "row 2 was rewritten" in report.message


@pytest.mark.parametrize(("deleted", "found"), [((3,), 3), ((2, 3), 2), ((1,), 1), ((5,), 5), ((4, 5), 4)])
def test_a_deleted_row_is_found(store, deleted, found):
    append(store, 5)
    for row_id in deleted:
        sql(store, "DELETE FROM audit_events WHERE id = :id", id=row_id)
    report = verify(store)
    assert not report.ok and report.bad_id == found, report
    assert f"row {found}" in report.message or f"rows {found}.." in report.message, report
    assert "deleted" in report.message


def forged(store: Store, row_id: int, prev_hash: str, *, rehash: bool) -> None:
    """Insert an event with raw SQL (not through audit.append) that claims to follow ``prev_hash``."""
    row = AuditEvent(
        at=datetime.now(UTC), actor="mallory", action="deploy", subject="calc@production", reason=None,
        details={"step": 0}, prev_hash=prev_hash,
    )  # fmt: skip
    row.hash = audit.digest(row) if rehash else "f" * 64
    fields = {c.name: getattr(row, c.name) for c in AuditEvent.__table__.columns if c.name != "id"}
    with store.session() as s:
        s.execute(insert(AuditEvent).values(id=row_id, **fields))


@pytest.mark.parametrize("rehash", [True, False])
def test_a_row_inserted_in_the_middle_is_found_at_its_id(store, rehash):
    events = append(store, 4)
    sql(store, "UPDATE audit_events SET id = id + 10 WHERE id >= 3")  # room after row 2
    forged(store, 3, events[1].hash, rehash=rehash)
    report = verify(store)
    assert not report.ok and report.bad_id == 3, report
    assert ("row 3 was inserted" if rehash else "row 3 was changed (or inserted)") in report.message


def test_a_row_appended_past_the_head_is_found(store):
    events = append(store, 3)
    forged(store, 4, events[-1].hash, rehash=True)  # a well-formed link, but no append moved the head
    report = verify(store)
    assert not report.ok and report.bad_id == 4 and "past the chain's head" in report.message, report


def test_concurrent_appends_from_several_threads_keep_one_chain(store):
    """Each thread appends in its own units of work at the same time: every event follows exactly one other (no
    two share a predecessor: no fork), and the chain verifies."""
    threads, each = 6, 8

    def work(t: int) -> None:
        for i in range(each):
            with store.session() as s:
                s.execute(select(AuditEvent.id).limit(1)).all()  # a read first, as a real unit of work does
                audit.append(s, actor=f"thread-{t}", action="test", subject=f"t{t}-{i}")

    _, errors = at_once(threads, work)
    assert not errors, errors
    with store.session() as s:
        events = audit.events(s)
    assert len(events) == threads * each
    assert len({e.prev_hash for e in events}) == len(events)  # no fork
    report = verify(store)
    assert report.ok and report.count == threads * each, report


@pytest.mark.parametrize("fresh", [True, False], ids=["first-read", "after-a-read"])
def test_verify_reads_one_snapshot_while_another_thread_appends(store, fresh):
    """``verify`` reads the head and then the rows: an append committed in between is not tampering. One thread
    appends as fast as it can while another verifies again and again, first thing in its unit of work or after a
    read; every report is OK (each saw the chain as it was at one moment: a head and exactly its rows)."""
    appended, reports, done = [], [], threading.Event()

    def work(i: int) -> None:
        if i == 0:
            while not done.is_set():
                appended.extend(append(store, 1))
            return
        try:
            for _ in range(40):
                with store.session() as s:
                    if not fresh:
                        s.execute(select(AuditEvent.id).limit(1)).all()
                    reports.append(audit.verify(s))
        finally:
            done.set()

    _, errors = at_once(2, work)
    assert not errors, errors
    broken = [r for r in reports if not r.ok]
    assert not broken, (
        f"{len(broken)} of {len(reports)} verifies saw tampering while {len(appended)} events were appended: {broken[0]}"
    )
    assert len(appended) > 10 and reports[-1].count <= len(appended)
