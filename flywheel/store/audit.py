"""The audit trail: append-only events (when, which actor, what action on which subject, why, with what details),
hash-chained so that a row changed, deleted or inserted afterwards is found by ``verify``.

An event's ``hash`` is SHA-256 over a canonical JSON (sorted keys, no spaces, UTF-8) of its fields (``at``,
``actor``, ``action``, ``subject``, ``reason``, ``details``) and ``prev_hash``, the hash of the event before it
(64 zeros for the first). The id is where a row sits (its order), not part of what is hashed: the chain is.

Appends are serialised by the one row of ``audit_head`` (the chain's length and last hash): an append locks it
(``FOR UPDATE`` on PostgreSQL; on SQLite the database's write lock, taken before the head is read), so two writers
never both extend the same event and the chain never forks. The head also lets ``verify`` see a cut-off tail. An
event is written in the caller's unit of work: with the change it records (a deployment switch), or not at all.

The chain alone vouches for nothing against someone who can write the database: they can cut the tail and move the
head back, or edit an event and re-chain every hash after it. Two things kept outside the database anchor it:

- The audit key (``FLYWHEEL_AUDIT_KEY``, or a file named by ``FLYWHEEL_AUDIT_KEY_FILE``; never stored): with it set,
  each event stores ``mac``, HMAC-SHA256 over its hash. A hash chains over every event before it, so one valid MAC
  vouches for the whole chain up to its event; without the key an edited event cannot get a valid MAC again.
  ``verify`` with the key wants a valid MAC on every event that has one and on the last event.
- The anchor file (``FLYWHEEL_AUDIT_ANCHOR``, else ``audit-anchor.jsonl`` next to a SQLite database, or in
  ``FLYWHEEL_HOME`` for a server's): after each unit of work that appended commits, a line per event appended
  (the database, the event's count and id, its hash), appended to the file and synced. Written after the commit:
  a line for an event that was then rolled back would read as a cut tail; a process that dies in between leaves
  the file behind the chain, which verifies (the chain extends it). ``verify`` wants every anchored event, with
  its hash, on the chain. Lines are per database; the file (or copies an external witness keeps) is what must be
  out of the database writer's reach.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from psycopg.pq import TransactionStatus
from pydantic import BaseModel, ConfigDict
from sqlalchemy import Connection, Engine, event, func, select
from sqlalchemy.orm import Session, SessionTransaction

from flywheel.home import default_home
from flywheel.store.db import write_lock
from flywheel.store.episodes import Timestamp
from flywheel.store.schema import AuditEvent, AuditHead

GENESIS = "0" * 64  # the prev_hash of the first event
LIMITS = {"actor": 256, "action": 64, "subject": 300, "reason": 2000}  # the columns' lengths
KEY_ENV, KEY_FILE_ENV, ANCHOR_ENV = "FLYWHEEL_AUDIT_KEY", "FLYWHEEL_AUDIT_KEY_FILE", "FLYWHEEL_AUDIT_ANCHOR"
MIN_KEY_BYTES = 16
ANCHOR_NAME = "audit-anchor.jsonl"
_PENDING = "flywheel.audit.anchor"  # in Session.info: the anchor lines this session's commit writes

log = logging.getLogger(__name__)


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
    mac: str | None  # with the audit key set


class AuditReport(BaseModel):
    """What ``verify`` found: ``ok`` with the chain's length, or the first row that is wrong and how."""

    ok: bool
    count: int  # events checked
    bad_id: int | None = None  # the changed or inserted row, or the first one missing
    message: str


class AuditKeyError(ValueError):
    """The audit key is set but unusable: too short, its file unreadable, or set twice."""


class AuditAnchorError(ValueError):
    """The anchor file cannot be read, or a line of it is not an anchor line."""


def _checked(key: bytes, what: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise AuditKeyError(f"{what} is {len(key)} bytes long; an audit key needs at least {MIN_KEY_BYTES}")
    return key


def read_key(path: Path) -> bytes:
    """The audit key in a key file: its bytes, less a trailing newline."""
    try:
        key = path.read_bytes().rstrip(b"\r\n")
    except OSError as exc:
        raise AuditKeyError(f"cannot read the audit key file {path}: {exc.strerror or exc}") from None
    return _checked(key, f"the audit key in {path}")


def configured_key() -> bytes | None:
    """The audit key this process appends and verifies with: ``FLYWHEEL_AUDIT_KEY`` (the key itself) or
    ``FLYWHEEL_AUDIT_KEY_FILE`` (a file holding it); None when neither is set."""
    value, path = os.environ.get(KEY_ENV), os.environ.get(KEY_FILE_ENV)
    if value and path:
        raise AuditKeyError(f"both {KEY_ENV} and {KEY_FILE_ENV} are set: set only one")
    if path:
        return read_key(Path(path))
    return _checked(value.encode(), KEY_ENV) if value else None


def mac(key: bytes, event_hash: str) -> str:
    """An event's MAC: HMAC-SHA256 over its hash (which chains over every event before it)."""
    return hmac.new(key, event_hash.encode(), hashlib.sha256).hexdigest()


def database(bind: Engine | Connection) -> str | None:
    """The database as anchor lines name it: a SQLite file's absolute path, a server's URL without its password;
    None for an in-memory SQLite database (nothing outlives it to anchor it)."""
    url = bind.engine.url
    if url.get_backend_name() == "sqlite":
        return str(Path(url.database).resolve()) if url.database and url.database != ":memory:" else None
    return url.render_as_string(hide_password=True)


def anchor_file(bind: Engine | Connection) -> Path | None:
    """Where this database's events are anchored: ``FLYWHEEL_AUDIT_ANCHOR``, else ``audit-anchor.jsonl`` next to a
    SQLite database (``FLYWHEEL_HOME``'s for the default store), else in ``FLYWHEEL_HOME``."""
    name = database(bind)
    if name is None:
        return None
    if configured := os.environ.get(ANCHOR_ENV):
        return Path(configured)
    return (Path(name).parent if bind.engine.url.get_backend_name() == "sqlite" else default_home()) / ANCHOR_NAME


@dataclass(frozen=True)
class Witness:
    """What ``verify`` checks the chain against besides itself, both kept outside the database: the audit key
    (the events' MACs) and the anchor file. ``Witness()`` checks the chain alone."""

    key: bytes | None = None
    anchor: Path | None = None

    @classmethod
    def configured(
        cls, bind: Engine | Connection, *, key_file: Path | None = None, anchor: Path | None = None
    ) -> Witness:
        """The key and the anchor file this process appends with (its environment), or those named here."""
        return cls(
            key=read_key(key_file) if key_file is not None else configured_key(),
            anchor=anchor if anchor is not None else anchor_file(bind),
        )


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
    key = configured_key()
    head = lock(s)
    row = AuditEvent(
        at=datetime.now(UTC), actor=actor, action=action, subject=subject, reason=reason or None,
        details=stored, prev_hash=head.hash,
    )  # fmt: skip
    row.hash = digest(row)
    row.mac = mac(key, row.hash) if key is not None else None
    s.add(row)
    head.count, head.hash = head.count + 1, row.hash
    s.flush()
    _anchor_on_commit(s, head.count, row)
    return AuditEventRecord.model_validate(row)


def _anchor_on_commit(s: Session, count: int, row: AuditEvent) -> None:
    """Have the commit of this unit of work write the event's anchor line (and drop it if the unit of work, or the
    savepoint it was appended in, rolls back)."""
    bind = s.get_bind()
    path = anchor_file(bind)
    if path is None:
        return
    pending = s.info.get(_PENDING)
    if pending is None:
        pending = s.info[_PENDING] = []
        event.listen(s, "after_commit", _write_anchor_lines)
        event.listen(s, "after_soft_rollback", _drop_anchor_lines)
    line = canonical({"database": database(bind), "count": count, "id": row.id, "hash": row.hash})
    pending.append((s.get_nested_transaction() or s.get_transaction(), path, line))


def _drop_anchor_lines(s: Session, rolled_back: SessionTransaction) -> None:
    def within(transaction: SessionTransaction | None) -> bool:
        while transaction is not None and transaction is not rolled_back:
            transaction = transaction.parent
        return transaction is not None

    s.info[_PENDING] = [entry for entry in s.info[_PENDING] if not within(entry[0])]


def _write_anchor_lines(s: Session) -> None:
    """After a commit (the outermost one: a savepoint's release is no commit), append its events' lines and sync.
    A failure is logged, not raised: the events are committed, and ``verify`` takes an anchor file that is behind."""
    if s.get_nested_transaction() is not None:
        return
    pending, s.info[_PENDING] = s.info[_PENDING], []
    by_file: dict[Path, list[str]] = {}
    for _, path, line in pending:
        by_file.setdefault(path, []).append(line + "\n")
    for path, lines in by_file.items():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, "".join(lines).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("the audit anchor file %s was not written (%s): it is %d events behind", path, exc, len(lines))


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


def count_events(s: Session, *, actions: tuple[str, ...], subject_prefix: str, after: int = 0) -> int:
    """How many events of ``actions`` on a subject starting with ``subject_prefix`` follow event ``after``."""
    query = select(func.count()).where(
        AuditEvent.action.in_(actions),
        AuditEvent.subject.startswith(subject_prefix, autoescape=True),
        AuditEvent.id > after,
    )
    return int(s.scalar(query) or 0)


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


def _anchored(anchor: Path, name: str | None) -> dict[int, tuple[int, str]]:
    """This database's lines in the anchor file: event count -> (row id, hash), the latest line for each count."""
    try:
        text = anchor.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise AuditAnchorError(f"cannot read the audit anchor file {anchor}: {exc.strerror or exc}") from None
    found: dict[int, tuple[int, str]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if entry["database"] == name:
                found[int(entry["count"])] = (int(entry["id"]), str(entry["hash"]))
        except (ValueError, TypeError, KeyError):
            raise AuditAnchorError(
                f"line {number} of the audit anchor file {anchor} is not an anchor line"
                ' ({"database": ..., "count": N, "id": N, "hash": ...})'
            ) from None
    return found


def _events(first: int, last: int) -> str:
    return f"event {first} was" if first == last else f"events {first}..{last} were"


def verify(s: Session, witness: Witness | None = None) -> AuditReport:
    """Walk the chain in order and report the first row that is not what was appended: one whose contents do not
    give its hash (changed, or inserted without the right hash), one that the next row skips (inserted), the ids
    missing where the chain breaks at a gap (deleted), a row rewritten with a new hash (the next one does not
    follow it), or a tail cut off or added past the head. Then, against ``witness`` (default: this process's key
    and anchor file), a row whose MAC is wrong or missing, and an anchored event the chain no longer has with its
    hash. The anchor file is read first, then the head and the rows in one snapshot (``snapshot``): a line is
    written after its event's commit, so every event it names is in the snapshot."""
    bind = s.get_bind()
    witness = witness if witness is not None else Witness.configured(bind)
    anchors = _anchored(witness.anchor, database(bind)) if witness.anchor is not None else {}
    snapshot(s)
    head = s.get(AuditHead, 1)
    assert head is not None  # the migration writes it
    count, previous, before_previous, past_head = 0, None, GENESIS, None
    seen: dict[int, tuple[int, str]] = {}  # the anchored counts' rows: id, hash
    bad_mac, unsigned_from = None, None  # with the key: the first row with a wrong MAC; the first with none since
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
        if count in anchors:
            seen[count] = (row.id, row.hash)
        if witness.key is not None:
            if row.mac is None:
                unsigned_from = unsigned_from or row.id
            else:
                unsigned_from = None
                if bad_mac is None and not hmac.compare_digest(row.mac, mac(witness.key, row.hash)):
                    bad_mac = row.id
    last = previous.hash if previous is not None else GENESIS
    if count < head.count:
        first_gone = 1 if previous is None else previous.id + 1
        return _bad(count, first_gone, f"the last {head.count - count} events were deleted (from row {first_gone})")
    if past_head is not None:
        return _bad(count, past_head, f"rows from row {past_head} were appended past the chain's head")
    if last != head.hash:
        assert previous is not None
        return _bad(count, previous.id, f"row {previous.id} was rewritten with a new hash: the head does not end there")
    if bad_mac is not None:
        return _bad(
            count, bad_mac, f"row {bad_mac} was changed and re-chained without the audit key: its MAC does not match"
        )
    if unsigned_from is not None:
        assert previous is not None
        rows = (
            f"row {unsigned_from} carries" if unsigned_from == previous.id else f"rows from row {unsigned_from} carry"
        )
        return _bad(
            count, unsigned_from, f"{rows} no MAC: appended without the audit key (every process that appends needs"
            " it, once one has it) or rewritten and re-chained without it; no signed event after them vouches for them",
        )  # fmt: skip
    if (wrong := _against_anchors(count, previous, anchors, seen, witness.anchor)) is not None:
        return wrong
    said = f"OK: {count} events, the chain verifies; its head: event {count}, {last}"
    if witness.anchor is not None:
        said += (
            f"; anchored up to event {max(anchors)} in {witness.anchor}"
            if anchors
            else f"; not anchored (no line for this database in {witness.anchor})"
        )
    said += "; MACs checked" if witness.key is not None else "; MACs not checked (no audit key)"
    return AuditReport(ok=True, count=count, message=said)


def _against_anchors(
    count: int,
    last_row: AuditEvent | None,
    anchors: dict[int, tuple[int, str]],
    seen: dict[int, tuple[int, str]],
    anchor: Path | None,
) -> AuditReport | None:
    """The first anchored event the chain no longer has as anchored: rewritten (its hash differs), or cut off (the
    chain ends before it). An anchor file behind the chain is no finding."""
    matched = 0  # the last anchored count found with its hash
    for position in sorted(anchors):
        if position > count:
            first_gone = anchors[count + 1][0] if count + 1 in anchors else (last_row.id + 1 if last_row else 1)
            return _bad(
                count, first_gone, f"{_events(count + 1, max(anchors))} deleted: the chain ends at event {count}, and"
                f" {anchor} anchors event {max(anchors)} (row {anchors[max(anchors)][0]})",
            )  # fmt: skip
        row_id, found = seen[position]
        if found != anchors[position][1]:
            if matched == position - 1:
                what = f"row {row_id} was rewritten: it is event {position}"
            else:
                what = f"the chain was rewritten in events {matched + 1}..{position}: row {row_id} is event {position}"
            return _bad(count, row_id, f"{what}, whose hash in {anchor} is {anchors[position][1]}, not {found}")
        matched = position
    return None
