"""Opening a store: the database URL, the engine's connection settings, and migrations to the latest schema."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import JSON, Engine, String, Table, create_engine, event, inspect, make_url, text
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from flywheel.home import default_home

T = TypeVar("T")
MIGRATIONS = Path(__file__).parent / "migrations"
_migrating = threading.Lock()  # two stores opened at once in one process migrate one after the other
IN_CHUNK = 500  # ids per IN (...) query
MIGRATIONS_LOCK = 0x466C7977686565  # PostgreSQL's advisory lock that migrations hold ("Flywhee")


def default_url(home: Path | None = None) -> str:
    """``FLYWHEEL_DB`` if set, else SQLite in ``home`` (default ``FLYWHEEL_HOME``): ``flywheel.db``."""
    return os.environ.get("FLYWHEEL_DB") or f"sqlite:///{(home or default_home()) / 'flywheel.db'}"


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    _switch_to_wal(cursor)  # readers (a dashboard, an export) never block the writer
    # Every commit is on disk when it returns: in WAL mode, FULL syncs the WAL at each commit, so a committed row (an
    # audit event, a deployment's move, a finished episode) survives a power loss as well as a crash (NORMAL synced
    # only at checkpoints: a power loss could take the last commits back). It costs a sync per commit, which the
    # gateway's group commit shares among the calls of a batch. A disk that lies about syncing keeps no promise.
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")  # another process writing: wait for it rather than fail
    cursor.close()


def _switch_to_wal(cursor: sqlite3.Cursor, wait_s: float = 30.0) -> None:
    """``PRAGMA journal_mode=WAL``, waiting up to ``wait_s`` (as long as busy_timeout) for the database's write lock.
    A database not yet in WAL mode (a new one) is switched under that lock, and while another connection holds it
    (another process switching it too), SQLite answers SQLITE_BUSY at once instead of calling its busy handler: a
    process opening a new store together with others failed with "database is locked". Once the database is in WAL
    mode (it stays so), the pragma takes no lock."""
    deadline = time.monotonic() + wait_s
    pause = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    engine = create_engine(
        _with_driver(url),
        pool_pre_ping=True,  # a connection the server (or a restart) closed is replaced, not handed out
        # a gateway's store calls run in worker threads (asyncio.to_thread: at most 32 at once), one connection
        # each; 16 stay open, up to 48 more while a burst lasts (64 agents at once wait for none)
        pool_size=16,
        max_overflow=48,
    )
    if engine.dialect.name == "postgresql":
        event.listen(engine, "connect", _postgresql_utc)
    return engine


def _postgresql_utc(dbapi_connection, _record) -> None:
    """Timestamps read back in UTC, whatever the server's ``TimeZone`` (the same instant, labelled alike)."""
    autocommit, dbapi_connection.autocommit = dbapi_connection.autocommit, True  # else a rollback undoes the SET
    dbapi_connection.execute("SET TIME ZONE 'UTC'")
    dbapi_connection.autocommit = autocommit


def _with_driver(url: str) -> str:
    """``postgresql://`` as a user writes it is psycopg 3 (SQLAlchemy's default is psycopg2, not installed);
    a URL that names a driver (``postgresql+psycopg2://``) keeps it."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return url


def _bad_number(value: Any, path: str = "") -> str | None:
    """Where ``value`` (a JSON value) holds NaN or an infinity, and which: ``"nan at ['a'][0]"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} at {path or 'the top'}"
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return next((found for k, v in children if (found := _bad_number(v, f"{path}[{k!r}]"))), None)


def _storable(session: Session, _context: Any, _instances: Any) -> None:
    """Before each flush: refuse, alike on both databases, what one of them cannot hold, as a ``ValueError`` (a 400
    at the API, not a 500) that names the column: text with a NUL character (PostgreSQL's text cannot hold one) and
    NaN or an infinity in JSON (JSON has none: PostgreSQL refuses it, SQLite would keep what no reader parses)."""
    for row in (*session.new, *session.dirty):
        state = inspect(row)
        for attribute in state.mapper.column_attrs:
            kind = attribute.columns[0].type
            if not isinstance(kind, String | JSON):
                continue
            for value in state.attrs[attribute.key].history.added:  # what this flush writes
                _check_value(f"{state.mapper.local_table.name}.{attribute.key}", kind, value)


def storable(table: Table, row: dict[str, Any]) -> None:
    """The same refusal for a row written without the ORM (a bulk insert, which no flush checks)."""
    for column in table.columns:
        if column.key in row and isinstance(column.type, String | JSON):
            _check_value(f"{table.name}.{column.key}", column.type, row[column.key])


def _check_value(where: str, kind: String | JSON, value: Any) -> None:
    if isinstance(value, str) and "\x00" in value:
        raise ValueError(f"{where} cannot be stored: it contains a NUL character (\\u0000)")
    if isinstance(kind, JSON) and value is not None:
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            raise ValueError(
                f"{where} cannot be stored: it holds {_bad_number(value)}; JSON has no NaN or infinity"
                " (send a finite number or null)"
            ) from None


def in_chunks(ids: list[str]) -> Iterator[list[str]]:
    """``ids`` in slices of at most IN_CHUNK, one ``IN (...)`` query each (databases bound a statement's parameters)."""
    return (ids[i : i + IN_CHUNK] for i in range(0, len(ids), IN_CHUNK))


def write_lock(s: Session) -> None:
    """On SQLite, take the database's write lock now, before this unit of work reads what it will change
    (PostgreSQL locks the rows instead). Python's sqlite3 would begin the transaction only at the first write."""
    connection = s.connection()
    if connection.dialect.name == "sqlite" and not connection.connection.dbapi_connection.in_transaction:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def upgrade(engine: Engine) -> None:
    """Apply every migration the database has not seen (a new database gets the whole schema)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with _migrating, engine.begin() as connection:
        # processes (gateways on several machines) opening one new database at once: one migrates, the others wait
        # for it, then find nothing to do (each would create the tables, and all but one fail)
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATIONS_LOCK})
        elif connection.dialect.name == "sqlite":  # the write lock; and Python's sqlite3 runs DDL outside a transaction
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


class StoreUnavailableError(RuntimeError):
    """The store's database could not be opened: a malformed URL, a driver not installed, a server that does not
    answer, a refused login, a database that does not exist."""


def shown_url(url: str) -> str:
    """The URL with its password hidden, fit to print or log."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(not a database URL)"


class Store:
    """A database with the latest schema. ``session()`` gives a unit of work that commits on success."""

    def __init__(self, url: str | None = None):
        self.url = url or default_url()
        try:
            self.engine = _engine(self.url)
        except (ArgumentError, ImportError) as exc:  # ImportError: SQLAlchemy's dialect or its driver is missing
            raise StoreUnavailableError(
                f"Cannot open the store at {shown_url(self.url)}: {exc} (URLs look like sqlite:///path/flywheel.db"
                " or postgresql://user:password@host:5432/database)"
            ) from exc
        try:
            upgrade(self.engine)
        except OperationalError as exc:  # the server, the login or the database (its message says which)
            self.engine.dispose()
            reason = "; ".join(line.strip() for line in str(exc.orig or exc).splitlines() if line.strip())
            raise StoreUnavailableError(f"Cannot open the store at {shown_url(self.url)}: {reason}") from exc
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        event.listen(self._sessions, "before_flush", _storable)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(session, *args, **kwargs)`` as one unit of work, in a worker thread (async callers' way in)."""

        def unit() -> T:
            with self.session() as session:
                return fn(session, *args, **kwargs)

        return await asyncio.to_thread(unit)

    def close(self) -> None:
        self.engine.dispose()
