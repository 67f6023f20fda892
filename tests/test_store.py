"""The store on each database it supports: SQLite (a file) and PostgreSQL (a real server that the tests start, see
tests/postgres.py), through its repository functions only. No model, no HTTP."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from datetime import UTC, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.store import Store, episodes, tasks
from flywheel.store.db import MIGRATIONS, StoreUnavailableError, _with_driver
from flywheel.store.schema import Base

from helpers import at_once


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def test_migrations_build_the_whole_schema_from_empty(db_url: str):
    """A new database gets every table of the models, at the latest revision; opening it again changes nothing."""
    for _ in range(2):
        store = Store(db_url)
        try:
            tables = set(inspect(store.engine).get_table_names())
            assert set(Base.metadata.tables) <= tables and "alembic_version" in tables
            with store.session() as s:
                (revision,) = s.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
            heads = sorted(p.name.split("_", 1)[0] for p in (MIGRATIONS / "versions").glob("[0-9]*.py"))
            assert revision == heads[-1]
        finally:
            store.close()


def test_the_migrations_build_exactly_the_models_tables(store: Store):
    """Alembic's comparison of the migrated database with the models finds nothing: no table, column, index or
    constraint that one has and the other has not (a model changed without its migration, or the other way)."""
    with store.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []


def test_json_and_time_zones_round_trip(store: Store):
    """JSON columns keep nested values, unicode, floats and nulls; timestamps come back as the same instant, in UTC
    (a server whose TimeZone is not UTC must not shift or relabel them)."""
    meta = {"nested": {"list": [1, 2.5, None, True, "ünï ✓"], "empty": {}}, "big": 2**53, "tiny": 1e-300}
    with store.session() as s:
        episode = episodes.create_episode(s, "json-task", meta=meta)
        request = {"messages": [{"role": "user", "content": 'quote " and \\ and \n'}], "temperature": 0.7}
        call = episodes.add_call(
            s, episode.id, model="m", step=None, request=request, response={"choices": []}, prompt_tokens=1,
            completion_tokens=2, latency_ms=3.5, prefix_call=None, prefix_choice=None, prefix_message=None,
            retokenized_turns=0, reward=None,
        )  # fmt: skip
    with store.session() as s:
        again = episodes.get_episode(s, episode.id)
        (call_again,) = episodes.calls(s, episode.id)
    assert again.meta == meta and call_again.request == request and call_again.response == {"choices": []}
    for written, read in ((episode.created_at, again.created_at), (call.created_at, call_again.created_at)):
        assert read == written and read.utcoffset() == timedelta(0), (written, read)
        assert read.tzinfo is not None and abs(read - written.astimezone(UTC)) < timedelta(microseconds=1)


@pytest.mark.parametrize(
    ("url", "engine_url"),
    [
        ("postgresql://u:p@db.example/flywheel", "postgresql+psycopg://u:p@db.example/flywheel"),
        ("postgres://u@db.example/flywheel", "postgresql+psycopg://u@db.example/flywheel"),
        ("postgresql+psycopg2://u@h/f", "postgresql+psycopg2://u@h/f"),  # a driver named stays
        ("sqlite:///x.db", "sqlite:///x.db"),
    ],
)
def test_a_postgresql_url_as_typed_uses_psycopg_3(url: str, engine_url: str):
    assert _with_driver(url) == engine_url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://u:secret@127.0.0.1:1/flywheel", "Connection refused"),  # nothing listens on port 1
        ("not a url", "not a database URL"),
        ("mysql://u:secret@h/d", "MySQLdb"),  # a driver that is not installed
    ],
)
def test_a_store_that_cannot_open_says_why_without_the_password(url: str, says: str):
    with pytest.raises(StoreUnavailableError, match="Cannot open the store at ") as refused:
        Store(url)
    assert says in str(refused.value) and "secret" not in str(refused.value)


def test_a_database_that_does_not_exist_is_named(postgres):
    with pytest.raises(StoreUnavailableError, match='database "missing" does not exist'):
        Store(postgres.url("missing"))


def test_serve_with_a_store_it_cannot_open_says_why_before_loading_the_model(monkeypatch, tmp_path):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps to COLUMNS
    done = CliRunner().invoke(app, ["serve", "--db", "postgresql://u:secret@127.0.0.1:1/flywheel", "--port", "1"])
    said = done.output
    assert done.exit_code == 2 and "Cannot open the store at postgresql://u:***@127.0.0.1:1/flywheel" in said, said
    assert done.exception is None or isinstance(done.exception, SystemExit), done.exception
    assert "secret" not in said and "Serving" not in said


def test_what_a_database_cannot_hold_is_refused_alike_on_both(store: Store):
    """NaN or an infinity in JSON (PostgreSQL refuses it: a 500 before; SQLite kept a value no reader could render)
    and a NUL character in text (PostgreSQL's text cannot hold one) are a ValueError naming the column and where,
    and nothing of that unit of work is written."""
    with store.session() as s:
        episode = episodes.create_episode(s, "kept")
    refused = [
        (lambda s: episodes.create_episode(s, "t", meta={"scores": [1.0, float("nan")]}), r"episodes\.meta .* nan at \['scores'\]\[1\]"),
        (lambda s: episodes.create_episode(s, "a\x00b"), r"episodes\.task_id .* NUL character"),
        (lambda s: episodes.set_outcome(s, episode.id, reward=1.0, metrics={"x": float("inf")}), r"episodes\.metrics .* inf at \['x'\]"),
        (lambda s: tasks.enqueue(s, "q", {"p": {"deep": float("-inf")}}, group_size=2), r"tasks\.payload .* -inf at \['p'\]\['deep'\]"),
        (lambda s: tasks.enqueue(s, "q", {}, group_size=1, model="m\x00"), r"tasks\.model .* NUL character"),
    ]  # fmt: skip
    for write, says in refused:
        with pytest.raises(ValueError, match=says), store.session() as s:
            write(s)
    with store.session() as s:
        assert [e.id for e in episodes.list_episodes(s)] == [episode.id] and tasks.list_tasks(s) == []
        assert episodes.get_episode(s, episode.id).metrics == {} and episodes.get_episode(s, episode.id).reward is None


def test_processes_opening_a_new_database_at_once_migrate_it_once(db_url: str, monkeypatch):
    """Gateways on several machines started together on a new database: before, each created the tables and all but
    one failed; now one migrates while the others wait, then find it done. Four threads stand for the processes:
    each opens a store of its own, without the lock that serialises migrations within one process."""
    # as if each were a process of its own
    monkeypatch.setattr("flywheel.store.db._migrating", contextlib.nullcontext())
    _, errors = at_once(4, lambda _: Store(db_url).close())
    assert errors == []
    test_migrations_build_the_whole_schema_from_empty(db_url)


def test_a_store_opened_while_another_process_switches_the_new_database_to_wal_waits_for_it(tmp_path):
    """Processes opening one new SQLite database at once sometimes failed with "database is locked": switching a
    database into WAL mode takes its write lock, and while another connection holds that lock on a database not yet
    in WAL mode, SQLite answers SQLITE_BUSY at once, without waiting its busy_timeout. Now the switch waits. The
    other process switching it is stood for by a connection holding the write lock of a new database still in
    rollback-journal mode, released a moment later."""
    path = tmp_path / "flywheel.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.3, other.execute, ["ROLLBACK"])
    release.start()
    try:
        Store(f"sqlite:///{path}").close()
    finally:
        release.join()
        other.close()
    with contextlib.closing(sqlite3.connect(path)) as check:
        assert check.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_sqlite_commit_is_on_disk_when_it_returns(tmp_path):
    """Every SQLite connection of a store runs in WAL mode with ``synchronous=FULL``: the WAL is synced at each
    commit, so a committed row (an audit event, a deployment's move, a recorded call) survives a power loss, not only
    a crash of the process (``NORMAL`` synced only at checkpoints). A power loss cannot be caused here: the test
    checks the settings every connection gets, the pooled ones included."""
    store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
    try:

        def settings(_: int) -> tuple[str, int]:
            with store.session() as s:
                connection = s.connection()
                mode = connection.exec_driver_sql("PRAGMA journal_mode").scalar_one()
                return mode, connection.exec_driver_sql("PRAGMA synchronous").scalar_one()

        results, errors = at_once(4, settings)
        assert errors == [] and results == [("wal", 2)] * 4  # 2: FULL
    finally:
        store.close()
