"""The audit trail (flywheel/store/audit.py) on SQLite and PostgreSQL: the chain verifies; a row changed, deleted
or inserted afterwards with raw SQL (not through ``audit.append``) is found at its id; appends from several threads
at once keep one chain; what the chain alone cannot show (a tail cut with the head moved back, an event edited and
re-chained) is found against what is kept outside the database, the anchor file and the key. No model: store only."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import insert, select, text
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.store import Store, audit
from flywheel.store.schema import AuditEvent, AuditHead

from helpers import at_once, at_revision

KEY = "a key no one with the database has"


@pytest.fixture(autouse=True)
def anchor(tmp_path, monkeypatch) -> Path:
    """Each test's anchor file (the default would be next to a SQLite database, or in ``FLYWHEEL_HOME``); no key
    unless the test sets one."""
    path = tmp_path / "anchor" / "audit-anchor.jsonl"
    monkeypatch.setenv("FLYWHEEL_AUDIT_ANCHOR", str(path))
    monkeypatch.delenv("FLYWHEEL_AUDIT_KEY", raising=False)
    monkeypatch.delenv("FLYWHEEL_AUDIT_KEY_FILE", raising=False)
    return path


@pytest.fixture
def keyed(monkeypatch) -> bytes:
    """The audit key set for this test's appends (and verifies)."""
    monkeypatch.setenv("FLYWHEEL_AUDIT_KEY", KEY)
    return KEY.encode()


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


def verify(store: Store, witness: audit.Witness | None = None) -> audit.AuditReport:
    with store.session() as s:
        return audit.verify(s, witness)


CHAIN_ONLY = audit.Witness()  # what verify checked before the anchor and the key: the chain alone


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
        deadline = time.monotonic() + 30
        try:
            while (len(reports) < 40 or len(appended) < 20) and time.monotonic() < deadline:
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
    assert len(appended) >= 20 and reports[-1].count <= len(appended)


def rechain(store: Store, row_id: int, **changes) -> None:
    """The careful forger with the database's password: change row ``row_id``, then give it and every row after it
    the hash (and ``prev_hash``) its new contents give, and move the head to the new end. Only the key's MACs are
    beyond reach: they stay as they were (or go, if ``changes`` says ``mac=None`` for the rewritten rows)."""
    strip = "mac" in changes and changes.pop("mac") is None
    with store.session() as s:
        rows = s.scalars(select(AuditEvent).order_by(AuditEvent.id)).all()
        previous = audit.GENESIS
        for row in rows:
            if row.id == row_id:
                for name, value in changes.items():
                    setattr(row, name, value)
            if row.id >= row_id:
                row.prev_hash = previous
                row.hash = audit.digest(row)
                if strip:
                    row.mac = None
            previous = row.hash
        head = s.get(AuditHead, 1)
        assert head is not None
        head.hash = previous


def cut(store: Store, events: list[audit.AuditEventRecord], keep: int) -> None:
    """Delete every event after the first ``keep`` and move the head back to the last one kept."""
    sql(store, "DELETE FROM audit_events WHERE id > :id", id=events[keep - 1].id)
    sql(store, "UPDATE audit_head SET count = :n, hash = :h", n=keep, h=events[keep - 1].hash)


def deployment_events(store: Store) -> list[audit.AuditEventRecord]:
    """A deploy, a promotion, a rollback (row 3) and two deploys after it."""
    moves = [("deploy", "calc@canary"), ("promote", "calc@production"), ("rollback", "calc@production")]
    moves += [("deploy", "calc@canary"), ("deploy", "calc@canary")]
    events = []
    for step, (action, subject) in enumerate(moves, start=1):
        with store.session() as s:
            events.append(audit.append(s, actor="ana", action=action, subject=subject, details={"step": step}))
    return events


def anchored(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_red_team_a_tail_cut_with_the_head_moved_back_is_found_by_the_anchor(store, anchor):
    events = deployment_events(store)
    cut(store, events, keep=3)
    assert verify(store, CHAIN_ONLY).ok  # the chain alone cannot tell: it ends where its head says
    report = verify(store)
    assert not report.ok and report.bad_id == events[3].id and report.count == 3, report
    assert "events 4..5 were deleted" in report.message and str(anchor) in report.message, report


def test_red_team_a_rollback_edited_into_a_promote_and_rechained_is_found_by_the_key_and_by_the_anchor(
    store, anchor, keyed
):
    events = deployment_events(store)
    rechain(store, events[2].id, action="promote")
    assert verify(store, CHAIN_ONLY).ok  # re-chained: the chain alone verifies
    by_key = verify(store, audit.Witness(key=keyed))
    assert not by_key.ok and by_key.bad_id == events[2].id, by_key
    assert f"row {events[2].id} was changed and re-chained without the audit key" in by_key.message, by_key
    by_anchor = verify(store, audit.Witness(anchor=anchor))
    assert not by_anchor.ok and by_anchor.bad_id == events[2].id, by_anchor
    assert f"row {events[2].id} was rewritten" in by_anchor.message and "event 3" in by_anchor.message, by_anchor
    assert not verify(store).ok  # as configured: both


def test_red_team_macs_stripped_or_an_event_forged_past_the_head_are_found_by_the_key(store, anchor, keyed):
    events = deployment_events(store)
    assert verify(store).ok and all(e.mac is not None for e in events)
    with store.session() as s:  # a forged event that extends the chain and moves the head: it has no MAC to give
        head = audit.lock(s)
        row = AuditEvent(
            at=datetime.now(UTC), actor="ana", action="promote", subject="calc@production", reason=None,
            details={"step": 9}, prev_hash=head.hash,
        )  # fmt: skip
        row.hash = audit.digest(row)
        s.add(row)
        head.count, head.hash = head.count + 1, row.hash
    assert verify(store, audit.Witness(anchor=anchor)).ok  # the anchor cannot tell it from an append
    report = verify(store, audit.Witness(key=keyed))
    assert not report.ok and report.bad_id == events[-1].id + 1 and "carries no MAC" in report.message, report
    sql(store, "DELETE FROM audit_events WHERE id > :id", id=events[-1].id)
    sql(store, "UPDATE audit_head SET count = 5, hash = :h", h=events[-1].hash)
    rechain(store, events[1].id, reason="nothing to see", mac=None)  # MACs stripped from row 2 on
    report = verify(store, audit.Witness(key=keyed))
    assert not report.ok and report.bad_id == events[1].id and "carry no MAC" in report.message, report


def test_the_anchor_is_written_after_each_commit_and_one_behind_still_verifies(store, anchor):
    with pytest.raises(RuntimeError), store.session() as s:
        audit.append(s, actor="ana", action="test", subject="rolled back")
        raise RuntimeError("the unit of work fails after the append")
    assert not anchor.exists()  # nothing committed, nothing anchored
    events = append(store, 3)
    lines = anchored(anchor)
    assert [(line["count"], line["id"], line["hash"]) for line in lines] == [
        (i + 1, e.id, e.hash) for i, e in enumerate(events)
    ]
    assert len({line["database"] for line in lines}) == 1
    report = verify(store)
    assert report.ok and "anchored up to event 3" in report.message and events[-1].hash in report.message, report
    # the process died between its commit and its anchor line (what that leaves: the file without the last line)
    anchor.write_text("".join(json.dumps(line) + "\n" for line in lines[:-1]))
    report = verify(store)
    assert report.ok and "anchored up to event 2" in report.message, report
    cut(store, events, keep=2)  # what an anchor one behind cannot show: the unanchored event cut
    assert verify(store).ok
    cut(store, events, keep=1)
    report = verify(store)
    assert not report.ok and report.bad_id == events[1].id and "event 2 was deleted" in report.message, report


def test_another_databases_anchor_lines_are_not_this_ones(store, anchor, tmp_path):
    append(store, 2)
    other = Store(f"sqlite:///{tmp_path / 'other.db'}")
    try:
        with other.session() as s:
            audit.append(s, actor="bo", action="test", subject="elsewhere")
        with other.session() as s:
            assert audit.verify(s).ok
    finally:
        other.close()
    assert len({line["database"] for line in anchored(anchor)}) == 2
    report = verify(store)
    assert report.ok and "anchored up to event 2" in report.message, report


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"FLYWHEEL_AUDIT_KEY": "short"}, "FLYWHEEL_AUDIT_KEY is 5 bytes long; an audit key needs at least 16"),
        ({"FLYWHEEL_AUDIT_KEY_FILE": "{tmp}/no-such-key"}, "cannot read the audit key file {tmp}/no-such-key"),
        ({"FLYWHEEL_AUDIT_KEY": KEY, "FLYWHEEL_AUDIT_KEY_FILE": "{tmp}/k"}, "set only one"),
    ],
)
def test_a_bad_audit_key_is_refused_and_nothing_is_written(store, monkeypatch, tmp_path, env, says):
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    with pytest.raises(audit.AuditKeyError, match=re.escape(says.format(tmp=tmp_path))):
        append(store, 1)
    assert verify(store, CHAIN_ONLY).count == 0


def test_a_key_file_signs_like_the_key(store, monkeypatch, tmp_path):
    (tmp_path / "audit.key").write_text(KEY + "\n")
    monkeypatch.setenv("FLYWHEEL_AUDIT_KEY_FILE", str(tmp_path / "audit.key"))
    events = append(store, 2)
    assert verify(store, audit.Witness(key=KEY.encode())).ok
    assert all(e.mac == audit.mac(KEY.encode(), e.hash) for e in events)


def test_events_stored_before_the_key_are_vouched_for_by_the_first_signed_event(db_url, monkeypatch):
    """A database from before MACs (migration 0011) keeps verifying; with the key set, its unsigned end is reported
    until an event is appended with the key: that event's MAC covers every event before it (its hash chains over
    theirs)."""
    rows, previous = [], audit.GENESIS
    for i in (1, 2):
        row = AuditEvent(
            at=datetime(2026, 11, 1, i, tzinfo=UTC), actor="ana", action="deploy", subject="calc@production",
            reason=None, details={"step": i}, prev_hash=previous,
        )  # fmt: skip
        row.hash = previous = audit.digest(row)
        rows.append({"at": row.at, "actor": row.actor, "action": row.action, "subject": row.subject,
                     "details": json.dumps(row.details), "prev_hash": row.prev_hash, "hash": row.hash})  # fmt: skip
    at_revision(db_url, "0010", [
        ("INSERT INTO audit_events (at, actor, action, subject, reason, details, prev_hash, hash) VALUES "
         "(:at, :actor, :action, :subject, NULL, :details, :prev_hash, :hash)", rows),
        ("UPDATE audit_head SET count = 2, hash = :hash", [{"hash": previous}]),
    ])  # fmt: skip
    store = Store(db_url)  # migrated
    try:
        assert verify(store).ok and verify(store).count == 2
        monkeypatch.setenv("FLYWHEEL_AUDIT_KEY", KEY)
        report = verify(store)
        assert not report.ok and report.bad_id == 1 and "rows from row 1 carry no MAC" in report.message, report
        append(store, 1)
        report = verify(store)
        assert report.ok and report.count == 3 and "MACs checked" in report.message, report
    finally:
        store.close()


def test_flywheel_audit_verify_checks_the_anchor_and_the_key_file(store, anchor, tmp_path, monkeypatch):
    (tmp_path / "audit.key").write_text(KEY)
    monkeypatch.setenv("FLYWHEEL_AUDIT_KEY_FILE", str(tmp_path / "audit.key"))
    events = deployment_events(store)
    monkeypatch.delenv("FLYWHEEL_AUDIT_KEY_FILE")
    monkeypatch.delenv("FLYWHEEL_AUDIT_ANCHOR")  # named on the command line instead
    runner = CliRunner()

    def cli(*args: str):
        return runner.invoke(app, ["audit", "verify", "--db", store.url, *args], env={"COLUMNS": "300"})

    result = cli("--anchor", str(anchor), "--key-file", str(tmp_path / "audit.key"))
    assert result.exit_code == 0 and "OK: 5 events" in result.output and "MACs checked" in result.output, result.output
    rechain(store, events[2].id, action="promote")
    result = cli("--anchor", str(tmp_path / "elsewhere.jsonl"))  # no line for it there, no key: cannot tell
    assert result.exit_code == 0 and "not anchored" in result.output, result.output
    result = cli("--anchor", str(anchor))
    assert result.exit_code == 1 and f"row {events[2].id} was rewritten" in result.output, result.output
    result = cli("--anchor", str(tmp_path / "elsewhere.jsonl"), "--key-file", str(tmp_path / "audit.key"))
    assert result.exit_code == 1 and "re-chained without the audit key" in result.output, result.output
    result = cli("--key-file", str(tmp_path / "missing.key"))
    assert result.exit_code == 2 and "cannot read the audit key file" in result.output, result.output


def test_an_event_in_a_savepoint_is_anchored_when_the_unit_of_work_commits_and_only_if_it_is_kept(store, anchor):
    with store.session() as s:
        audit.append(s, actor="ana", action="test", subject="before")
        with s.begin_nested():  # released: its event commits with the unit of work, not before
            audit.append(s, actor="ana", action="test", subject="kept")
        assert not anchor.exists()
        with pytest.raises(RuntimeError), s.begin_nested():
            audit.append(s, actor="ana", action="test", subject="rolled back")
            raise RuntimeError("the savepoint rolls back")
        audit.append(s, actor="ana", action="test", subject="after")
    with store.session() as s:
        events = audit.events(s)
    assert [e.subject for e in events] == ["before", "kept", "after"]
    assert [(line["count"], line["hash"]) for line in anchored(anchor)] == [
        (i + 1, e.hash) for i, e in enumerate(events)
    ]
    assert verify(store).ok


def test_a_witness_that_kept_some_heads_only_bounds_where_the_chain_was_rewritten(store, anchor, tmp_path):
    events = deployment_events(store)
    witness = tmp_path / "witness.jsonl"  # the heads someone outside kept: events 1 and 5
    witness.write_text("".join(f"{line}\n" for line in anchor.read_text().splitlines()[::4]))
    rechain(store, events[2].id, action="promote")
    report = verify(store, audit.Witness(anchor=witness))
    assert not report.ok and report.bad_id == events[4].id, report
    assert f"the chain was rewritten in events 2..5: row {events[4].id} is event 5" in report.message, report
