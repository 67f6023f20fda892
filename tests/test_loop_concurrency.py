"""The gateway writing production episodes while the loop trains, on SQLite and on PostgreSQL (issue #25's
concurrency check): simulated users (tests/users.py: the openai SDK and the episode API over real HTTP, several at
once) run production episodes with calls and feedback through a backend's gateway while the loop, on the same
backend and database, takes them in, trains a step and sends its candidate through the gate. Everything a user was
answered is stored once, no user and not the loop saw a database error (SQLite's "database is locked", PostgreSQL's
serialization failures and deadlocks), and the audit chain verifies."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from test_loop import write_config
from users import Users, differences

from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.loop.driver import Loop, LoopConfig
from flywheel.store import audit, deployments


@pytest.mark.slow  # a backend of its own (two model loads), a training step and a gate evaluation per database
@pytest.mark.timeout(900)
async def test_users_write_production_episodes_while_the_loop_trains_and_gates(db_url, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_DB", db_url)  # the backend's gateway and its runs' history both
    backend = LocalBackend(path=tmp_path / "home")
    config = LoopConfig.load(write_config(tmp_path)).model_copy(
        update={"name": "busy-agent", "steps": 1, "candidate_every": 1, "runners": 2}
    )
    stop = threading.Event()
    try:
        await backend.load(EMBEDDED_MODEL)  # what the users' calls name (and the first candidate meets)
        users = Users(backend.base_url.removesuffix("/v1"), lambda: EMBEDDED_MODEL, users=4)
        traffic = asyncio.create_task(users.run(stop))
        await users.until_finished(4)
        started = time.monotonic()
        loop = Loop(config, backend, actor="test")
        try:
            report = await loop.run()
        finally:
            stop.set()
            await traffic
        earlier = users.finished_before(started)
        store = backend.gateway.store
        assert users.errors == []
        assert backend.gateway.lost_calls == 0  # a write that failed behind its answer: the user never sees it
        assert report.steps == [1] and len(report.candidates) == 1, report
        assert report.candidates[0].deployed == "busy-agent@production", report.candidates[0].decision.checks
        assert earlier and earlier <= loop.pool.keys() and report.intake >= len(earlier)  # intake saw them
        after = len(users.sent) - len(earlier)
        assert after > 0, "no episode ran while the loop did: not a concurrency test"
        assert differences(store, users) == []
        with store.session() as s:
            assert deployments.get(s, "busy-agent@production").step == 1
            assert audit.verify(s).ok
        calls = sum(e.calls for e in users.sent.values())
        print(json.dumps({"database": db_url.partition(":")[0], "episodes": len(users.sent), "calls": calls,
                          "while_the_loop_ran": after, "intake": report.intake,
                          "loop_seconds": round(time.monotonic() - started)}))  # fmt: skip
    finally:
        stop.set()
        await backend.close()
