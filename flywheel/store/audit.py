"""The audit trail: append-only events (when, which actor, what action on which subject, why, with what details),
hash-chained so that a row changed, deleted or inserted afterwards is found by ``verify``.

An event's ``hash`` is SHA-256 over a canonical JSON (sorted keys, no spaces, UTF-8) of its fields (``at``,
``actor``, ``action``, ``subject``, ``reason``, ``details``) and ``prev_hash``, the hash of the event before it
(64 zeros for the first). The id is where a row sits (its order), not part of what is hashed: the chain is.

Appends are serialised by the one row of ``audit_head`` (the chain's length and last hash): an append locks it
(``FOR UPDATE`` on PostgreSQL; on SQLite the database's write lock, taken before the head is read), so two writers
never both extend the same event and the chain never forks. The head also lets ``verify`` see a cut-off tail. An
event is written in the caller's unit of work: with the change it records (a deployment switch), or not at all.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from psycopg.pq import TransactionStatus
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session

from flywheel.store.db import write_lock
from flywheel.store.episodes import Timestamp
from flywheel.store.schema import AuditEvent, AuditHead

GENESIS = "0" * 64  # the prev_hash of the first event
LIMITS = {"actor": 256, "action": 64, "subject": 300, "reason": 2000}  # the columns' lengths


class AuditEventRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    at: Timestamp
    actor: str
    action: str
    subject: str
    reason: str | None
    details: dict[str, Any]
    prev_hash: str
    hash: str


class AuditReport(BaseModel):
    """What ``verify`` found: ``ok`` with the chain's length, or the first row that is wrong and how."""

    ok: bool
    count: int  # events checked
    bad_id: int | None = None  # the changed or inserted row, or the first one missing
    message: str


def canonical(value: Any) -> str:
    """The JSON that hashes are taken over: sorted keys, no spaces, no NaN or infinity."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _at(value: datetime) -> str:
    utc = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)  # SQLite keeps no zone
    return utc.isoformat(timespec="microseconds")


def digest(row: AuditEvent) -> str:
    """The hash a row's fields and ``prev_hash`` give (what its ``hash`` must be)."""
    fields = {
        "at": _at(row.at),
        "actor": row.actor,
        "action": row.action,
        "subject": row.subject,
        "reason": row.reason,
        "details": row.details,
        "prev_hash": row.prev_hash,
    }
    return hashlib.sha256(canonical(fields).encode()).hexdigest()


def lock(s: Session) -> AuditHead:
    """Take the chain's head for this unit of work (until it commits or rolls back) and return it. A unit of work
    that reads what its event will record (a deployment's current step) calls this first, so that what it read is
    still true when the event is appended."""
    write_lock(s)  # on SQLite, before reading: Python's sqlite3 would begin the transaction only at the first write
    return s.scalars(select(AuditHead).where(AuditHead.id == 1).with_for_update()).one()


def append(
    s: Session,
    *,
    actor: str,
    action: str,
    subject: str,
    reason: str | None = None,
    details: dict[str, Any] | None = None,
) -> AuditEventRecord:
    """Append an event in this unit of work (it commits with it). ``details``: JSON (finite numbers)."""
    for field, value in (("actor", actor), ("action", action), ("subject", subject), ("reason", reason)):
        if value is not None and len(value) > LIMITS[field]:
            raise ValueError(f"the audit event's {field} is {len(value)} characters long; at most {LIMITS[field]}")
        if field != "reason" and not value:
            raise ValueError(f"the audit event's {field} is empty")
    try:
        stored = json.loads(canonical(details or {}))  # what the database gives back: hashed as it will be read
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the audit event's details are not JSON: {exc}") from None
    head = lock(s)
    row = AuditEvent(
        at=datetime.now(UTC), actor=actor, action=action, subject=subject, reason=reason or None,
        details=stored, prev_hash=head.hash,
    )  # fmt: skip
    row.hash = digest(row)
    s.add(row)
    head.count, head.hash = head.count + 1, row.hash
    s.flush()
    return AuditEventRecord.model_validate(row)


def events(
    s: Session, *, subject: str | None = None, actions: tuple[str, ...] | None = None, limit: int | None = None
) -> list[AuditEventRecord]:
    """Events in the chain's order (the last ``limit`` of them), optionally of one subject or some actions."""
    query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
    if subject is not None:
        query = query.where(AuditEvent.subject == subject)
    if actions is not None:
        query = query.where(AuditEvent.action.in_(actions))
    return [AuditEventRecord.model_validate(row) for row in reversed(s.scalars(query).all())]


def _bad(count: int, bad_id: int | None, message: str) -> AuditReport:
    return AuditReport(ok=False, count=count, bad_id=bad_id, message=message)


def snapshot(s: Session) -> None:
    """Make what this unit of work reads from now on agree with one moment of the chain: appends that other units of
    work commit meanwhile are not seen (else the head read first and the rows read after it disagree). PostgreSQL:
    a REPEATABLE READ transaction when nothing has been read in ``s`` yet, else a share lock on the head (appends
    wait until this unit of work ends). SQLite: a read transaction begun now (Python's sqlite3 would run each read
    on its own)."""
    connection = s.connection()
    raw = connection.connection.dbapi_connection
    if connection.dialect.name == "postgresql":
        if raw.info.transaction_status == TransactionStatus.IDLE:
            connection.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        else:
            s.execute(select(AuditHead.id).where(AuditHead.id == 1).with_for_update(read=True))
    elif connection.dialect.name == "sqlite" and not raw.in_transaction:
        connection.exec_driver_sql("BEGIN")


def verify(s: Session) -> AuditReport:
    """Walk the chain in order and report the first row that is not what was appended: one whose contents do not
    give its hash (changed, or inserted without the right hash), one that the next row skips (inserted), the ids
    missing where the chain breaks at a gap (deleted), a row rewritten with a new hash (the next one does not
    follow it), or a tail cut off or added past the head. The head and the rows are read in one snapshot
    (``snapshot``)."""
    snapshot(s)
    head = s.get(AuditHead, 1)
    assert head is not None  # the migration writes it
    count, previous, before_previous, past_head = 0, None, GENESIS, None
    for row in s.scalars(select(AuditEvent).order_by(AuditEvent.id)).yield_per(1000):
        if digest(row) != row.hash:
            return _bad(count, row.id, f"row {row.id} was changed (or inserted): its contents do not give its hash")
        if row.prev_hash != (previous.hash if previous is not None else GENESIS):
            if previous is not None and row.prev_hash == before_previous:
                return _bad(count, previous.id, f"row {previous.id} was inserted: row {row.id} follows the one before")
            first_gone = 1 if previous is None else previous.id + 1
            if row.id > first_gone:
                gone = f"row {first_gone}" if row.id == first_gone + 1 else f"rows {first_gone}..{row.id - 1}"
                return _bad(count, first_gone, f"{gone} deleted: row {row.id} does not follow the row before them")
            if previous is None:
                return _bad(count, row.id, f"rows before row {row.id} were deleted: it does not start the chain")
            return _bad(
                count, previous.id, f"row {previous.id} was rewritten with a new hash: row {row.id} does not follow it"
            )
        before_previous = previous.hash if previous is not None else GENESIS
        previous, count = row, count + 1
        if count == head.count + 1:
            past_head = row.id
    last = previous.hash if previous is not None else GENESIS
    if count < head.count:
        first_gone = 1 if previous is None else previous.id + 1
        return _bad(count, first_gone, f"the last {head.count - count} events were deleted (from row {first_gone})")
    if past_head is not None:
        return _bad(count, past_head, f"rows from row {past_head} were appended past the chain's head")
    if last != head.hash:
        assert previous is not None
        return _bad(count, previous.id, f"row {previous.id} was rewritten with a new hash: the head does not end there")
    return AuditReport(ok=True, count=count, message=f"OK: {count} events, the chain verifies")
