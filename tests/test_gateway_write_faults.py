"""Write-behind through a real PostgreSQL server's faults (issue #37, item 11): the server stopped for 5 s while
agents run episodes, then (after a short outage whose calls are lost) killed for good. Every call an agent was
answered is in the store, or its episode is marked: refused by the gateway (a 409 naming the call) and, once the
database answers again, abandoned there with its lost calls counted. Nothing hangs: the agents' requests end in
an answer (never a 500: a 503 with Retry-After while the database is away) and the server's shutdown is bounded.

The agents are asyncio tasks that prepare and record calls as the chat route does (the engine's reply is written
here, as in tests/test_gateway_write_behind.py) and post their outcomes over real HTTP. The server is a cluster
of this test's own (tests/postgres.py), stopped with ``pg_ctl -m immediate`` (connections dropped, as a crash
drops them), with ``synchronous_commit`` on, so that what a commit answered survives it."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import threading
import time
from collections import Counter

import httpx
import pytest
import test_gateway_write_behind
from postgres import SETTINGS, PostgresServer, find_bindir
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from test_gateway_write_behind import Agent, new_episode

from flywheel.gateway.recorder import Gateway, GatewayBusyError, WriteLimits
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import EpisodeConflictError, EpisodeStatus, Store, episodes

tokenizer = test_gateway_write_behind.tokenizer  # the fixture: the embedded model's tokenizer, no model loaded
AGENTS = 32
TURNS = 3
# a request unanswered this long hangs: the gateway's own waits end long before (wait_s, retry_s <= 20 s here), so
# this is generous, for a CI machine that stands still a while (a process stalled ~30 s there once)
ANSWER_S = 90
HELD = 4  # episodes open in the gateway when the database stops (their next calls are answered during the outage)


class Agents:
    """``AGENTS`` agents running episodes of ``TURNS`` calls until stopped; what each was answered, and the HTTP
    statuses they got."""

    def __init__(self, gateway: Gateway, tokenizer, root: str):
        self.gateway, self.tokenizer, self.root = gateway, tokenizer, root
        self.answered: list[tuple[str, int]] = []  # (episode, turn) of every call answered
        self.finished: set[str] = set()  # episodes whose finish was a 200
        self.statuses: Counter[int | str] = Counter()
        self.refusals: Counter[str] = Counter()  # what prepare raised, by kind
        self.stop = asyncio.Event()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.root, timeout=ANSWER_S) as http:
            await asyncio.gather(*(self._agent(http, i) for i in range(AGENTS)))

    async def _post(self, http: httpx.AsyncClient, path: str, body: dict) -> httpx.Response | None:
        """The request, again after each 503's Retry-After (capped at 1 s here) until answered or stopped."""
        while not self.stop.is_set():
            try:
                response = await http.post(path, json=body)
            except httpx.TimeoutException:  # no answer in ANSWER_S: a hang, counted so the assertion shows which
                if not any(isinstance(status, str) for status in self.statuses):
                    faulthandler.dump_traceback()  # the first: where every thread (the server's too) stands now
                self.statuses[f"no answer to {path.split('/')[-1]}"] += 1
                return None
            self.statuses[response.status_code] += 1
            if response.status_code != 503:
                return response
            await asyncio.sleep(min(1.0, float(response.headers["Retry-After"])))
        return None

    async def _agent(self, http: httpx.AsyncClient, i: int) -> None:
        await asyncio.sleep(i * TURNS * 0.2 / AGENTS)  # staggered: at any time, most are in an episode's calls
        while not self.stop.is_set():
            created = await self._post(http, "/episodes", {"task_id": f"t{i}"})
            if created is None:
                return
            assert created.status_code == 201, created.text
            agent = Agent(self.gateway, self.tokenizer, created.json()["id"])
            try:
                for _ in range(TURNS):
                    splice = await agent.prepare()
                    await asyncio.sleep(0.2)  # being generated (most of an agent's time, as with a real engine)
                    await agent.answer(splice)
                    self.answered.append((agent.episode_id, agent.turns))
            except (GatewayBusyError, DBAPIError, EpisodeConflictError) as exc:
                self.refusals[type(exc).__name__] += 1  # full, the database away, or the episode lost a call
                await asyncio.sleep(0.2)
                continue
            finish = await self._post(http, f"/episodes/{agent.episode_id}/finish", {"reward": 1})
            if finish is not None and finish.status_code == 200:
                self.finished.add(agent.episode_id)


class LoopWatch:
    """How long this event loop (the agents') went without turning at most; after ``STALL_S`` s without, every
    thread's stack goes to stderr (faulthandler's own thread, which needs no GIL). A request with no answer is then
    told apart: the server hung, or this process stood still (a CI failure once showed 29 creates unanswered in a
    34 s test)."""

    STALL_S = 10

    def __init__(self) -> None:
        self.longest = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                faulthandler.dump_traceback_later(self.STALL_S)
                started = loop.time()
                await asyncio.sleep(0.1)
                self.longest = max(self.longest, loop.time() - started - 0.1)
        finally:
            faulthandler.cancel_dump_traceback_later()


def accounted(store: Store, gateway: Gateway, answered: list[tuple[str, int]]) -> dict[str, int]:
    """Each answered call: in the store, or its episode marked (refused by the gateway; in the store abandoned
    with its lost calls counted, unless ``gateway.unmarked_calls`` still holds it)."""
    found: Counter[str] = Counter()
    by_episode: dict[str, set[int]] = {}
    for episode_id, turn in answered:
        by_episode.setdefault(episode_id, set()).add(turn)
    with store.session() as s:
        for episode_id, turns in by_episode.items():
            recorded = {c.response["id"] for c in episodes.calls(s, episode_id)}
            episode = episodes.get_episode(s, episode_id)
            for turn in turns:
                if f"chatcmpl-{episode_id}-{turn}" in recorded:
                    found["recorded"] += 1
                    continue
                with pytest.raises(EpisodeConflictError, match="lost a call"):
                    gateway.refuse_lost(episode_id)
                assert episode.status == EpisodeStatus.abandoned and episode.meta[episodes.LOST_CALLS] >= 1, episode
                found["lost and marked"] += 1
    return dict(found)


@pytest.mark.timeout(300)
async def test_write_behind_rides_out_a_postgresql_restart_and_marks_what_it_loses_when_it_is_gone(tokenizer):
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql): the write-behind faults were not tried")
    # a commit is durable once answered (the other tests' servers answer before: a crash loses their last commits)
    server = PostgresServer(bindir, tuple(s for s in SETTINGS if s != "synchronous_commit=off"))
    server.start()
    store = Store(server.create_database("faults"))
    gateway = Gateway(store, redactor=None, limits=WriteLimits(retry_s=20, wait_s=10))
    app = BackgroundServer(create_app(ModelRegistry(), gateway)).start()
    root = app.base_url.removesuffix("/v1")
    watch = LoopWatch()
    watching = asyncio.ensure_future(watch.run())
    try:
        # 1. Stopped for 5 s under AGENTS agents: the writer retries past the outage, nothing is lost.
        # HELD episodes are open in the gateway when the server stops, whatever the agents' timing (on a slow CI
        # machine every agent once stood in a finish or a create, which need the database, for the whole outage):
        # their calls during the outage must be answered from what the gateway holds.
        held = [Agent(gateway, tokenizer, await asyncio.to_thread(new_episode, store)) for _ in range(HELD)]
        for agent in held:
            await agent.turn()
            await gateway.settled(agent.episode_id)
        agents = Agents(gateway, tokenizer, root)
        running = asyncio.ensure_future(agents.run())
        await asyncio.sleep(2)
        # pg_ctl in a worker thread: the agents go on meanwhile (a blocked loop would fire their timeouts late)
        await asyncio.to_thread(server.kill)
        before = len(agents.answered)
        for agent in held:
            await asyncio.wait_for(agent.turn(), 5)  # no query: the episode's outputs are in memory
        await asyncio.sleep(5)
        during = len(agents.answered) - before
        await asyncio.to_thread(server.resume)
        await asyncio.sleep(3)
        agents.stop.set()
        await asyncio.wait_for(running, ANSWER_S + 30)
        await asyncio.wait_for(gateway.settled(), 30)
        agents.answered += [(agent.episode_id, turn) for agent in held for turn in (1, 2)]
        assert gateway.lost_calls == 0 and gateway.late_calls == 0
        assert accounted(store, gateway, agents.answered) == {"recorded": len(agents.answered)}
        assert set(agents.statuses) <= {200, 201, 503}, (agents.statuses, f"this loop stood {watch.longest:.1f} s")
        with store.session() as s:
            assert all(episodes.get_episode(s, e).status == EpisodeStatus.finished for e in agents.finished)
        print(f"restart: {len(agents.answered)} calls answered ({during} while it was stopped), {agents.statuses}")

        # 2. An outage longer than the writer's retries: the call is lost; its episode is refused at once and marked
        # in the store once the database is back.
        gateway.limits = WriteLimits(retry_s=0.5, wait_s=5)
        with store.session() as s:
            episode_id = episodes.create_episode(s, "short").id
        agent = Agent(gateway, tokenizer, episode_id)
        await agent.turn()
        await gateway.settled(episode_id)
        await asyncio.to_thread(server.kill)
        await agent.turn()  # answered from the episode the gateway holds
        await asyncio.wait_for(gateway.settled(episode_id), 10)
        assert gateway.lost_calls == 1 and gateway.unmarked_calls == 1
        async with httpx.AsyncClient(base_url=root, timeout=30) as http:
            refused = await http.post(f"/episodes/{episode_id}/finish", json={"reward": 1})
            assert refused.status_code == 409 and f"chatcmpl-{episode_id}-2" in refused.json()["error"]["message"]
        await asyncio.to_thread(server.resume)
        deadline = time.monotonic() + 20
        while gateway.unmarked_calls and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert gateway.unmarked_calls == 0
        assert accounted(store, gateway, [(episode_id, 1), (episode_id, 2)]) == {"recorded": 1, "lost and marked": 1}

        # 3. Killed for good under AGENTS agents: calls answered after it are lost and refused; no request and not
        # the server's shutdown hangs.
        gateway.limits = WriteLimits(retry_s=1, wait_s=2)
        with store.session() as s:
            last = Agent(gateway, tokenizer, episodes.create_episode(s, "last").id)
        await last.turn()
        agents = Agents(gateway, tokenizer, root)
        running = asyncio.ensure_future(agents.run())
        await asyncio.sleep(2)
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(4)
        agents.stop.set()
        await asyncio.wait_for(running, ANSWER_S + 30)  # every request was answered
        assert set(agents.statuses) <= {200, 201, 409, 503}, (agents.statuses, f"this loop stood {watch.longest:.1f} s")
        gateway.limits = WriteLimits(retry_s=4, wait_s=1)
        await last.turn()  # still being retried when the server stops: its shutdown waits retry_s + wait_s at most
        agents.answered += [(last.episode_id, 1), (last.episode_id, 2)]
        stopping = threading.Thread(target=app.stop)
        started = time.monotonic()
        stopping.start()
        stopping.join(30)
        assert not stopping.is_alive(), "the server's shutdown hangs"
        assert time.monotonic() - started < 4 + 1 + 2
        print(
            f"killed: {len(agents.answered)} calls answered, {gateway.lost_calls - 1} lost,"
            f" shutdown {time.monotonic() - started:.1f} s, {agents.statuses}, refused {dict(agents.refusals)}"
        )
        assert gateway.lost_calls > 1
        await asyncio.to_thread(
            server.resume
        )  # only to read what the store holds: the gateway is stopped (its writer marks what it lost)
        deadline = time.monotonic() + 20
        while gateway.unmarked_calls and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        found = accounted(store, gateway, agents.answered)
        assert sum(found.values()) == len(agents.answered) and found.get("lost and marked", 0) > 0, found
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        app.stop()
        store.close()
        server.stop()


async def test_a_database_that_refuses_a_request_is_a_500_that_says_why_and_is_logged(tmp_path, caplog):
    """Not a fault that passes (a 503 to retry): a schema that is not the server's (here its episodes table dropped
    behind its back, as a wrong migration or another program would) refuses every create. The agent is told what the
    database said, in OpenAI's error shape (not a bare "Internal Server Error"), and the server's log has the
    traceback."""
    store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
    app = BackgroundServer(create_app(ModelRegistry(), Gateway(store, redactor=None))).start()
    try:
        with store.session() as s:
            s.execute(text("DROP TABLE calls"))
            s.execute(text("DROP TABLE episodes"))
        async with httpx.AsyncClient(base_url=app.base_url.removesuffix("/v1"), timeout=30) as http:
            created = await http.post("/episodes", json={"task_id": "t"})
            read = await http.get("/episodes/e-unknown")
        for response in (created, read):
            error = response.json()["error"]
            assert response.status_code == 500 and error["code"] == "store_error", response.text
            assert (
                "OperationalError: no such table: episodes" in error["message"] and "will not help" in error["message"]
            )
            assert "Retry-After" not in response.headers
        logged = [r for r in caplog.records if "refused it" in r.getMessage()]
        assert len(logged) == 2 and "POST /episodes" in logged[0].getMessage() and logged[0].exc_info is not None
    finally:
        app.stop()
        store.close()
