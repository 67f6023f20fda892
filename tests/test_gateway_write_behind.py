"""The gateway writes calls behind their answers (write-behind) without losing correctness: a call is answered
once queued; the episode's next call is spliced onto it in memory and linked to its committed id; the episode's
outcome, its reads and the server's shutdown wait for its queued calls; a call that cannot be written after it was
answered abandons its episode (a 409 naming it, counted in /gateway/stats); a reply lost with its gateway (killed
before the commit) is re-tokenized context for the restarted one; without write-behind, a call is answered once
committed. The writer is held back by
another connection's write lock (a real SQLite lock, as another process would hold it). No model is loaded: the
prompts are the embedded model's tokenizer's, the replies written here."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from flywheel.gateway.recorder import Gateway, GatewayBusyError, WriteLimits
from flywheel.gateway.splice import Splice, tokenizer_key
from flywheel.inference.loading import EMBEDDED_MODEL, resolve_model
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import EpisodeConflictError, EpisodeStatus, Store, episodes

USER = {"role": "user", "content": "Name a colour."}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_MODEL).path)


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:
    store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
    yield store
    store.close()


class Lock:
    """Another connection's write lock on the store's SQLite file: the gateway's writer waits for it."""

    def __init__(self, store: Store):
        self.connection = sqlite3.connect(store.url.split("///", 1)[1], isolation_level=None)

    def __enter__(self) -> sqlite3.Connection:
        self.connection.execute("BEGIN IMMEDIATE")
        return self.connection

    def __exit__(self, *exc: object) -> None:
        self.connection.execute("COMMIT")
        self.connection.close()


class Agent:
    """One episode's conversation: each turn is prepared and recorded as the chat route does it."""

    def __init__(self, gateway: Gateway, tokenizer: PreTrainedTokenizerBase, episode_id: str):
        self.gateway, self.tokenizer, self.episode_id = gateway, tokenizer, episode_id
        self.eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
        self.messages: list[dict] = [USER]
        self.turns = 0

    async def turn(self) -> Splice:
        return await self.answer(await self.prepare())

    async def prepare(self) -> Splice:
        """The call's prompt: from here until it is recorded, the call is in flight (being generated)."""
        return await self.gateway.prepare(self.episode_id, self.messages, None, self.tokenizer, self.eos)

    async def answer(self, splice: Splice, **extra: Any) -> Splice:
        """The call's reply (``Colour <turn>.``), recorded; ``extra``: more fields of its response."""
        self.turns += 1
        reply = f"Colour {self.turns}."
        completion = [*self.tokenizer.encode(reply, add_special_tokens=False), *self.eos]
        choice = {
            "index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop",
            "prompt_token_ids": splice.prompt, "token_ids": completion, "tokenizer": tokenizer_key(self.tokenizer),
        }  # fmt: skip
        response = {"id": f"chatcmpl-{self.episode_id}-{self.turns}", "choices": [choice], "usage": {}, **extra}
        request = {"messages": list(self.messages)}
        await self.gateway.record(
            self.episode_id, splice, self.eos, model="m", step=None, request=request, response=response, latency_ms=1
        )
        self.messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another."}]
        return splice


def new_episode(store: Store) -> str:
    with store.session() as s:
        return episodes.create_episode(s, "t").id


def calls(store: Store, episode_id: str) -> list[episodes.CallRecord]:
    with store.session() as s:
        return episodes.calls(s, episode_id)


async def test_a_call_is_answered_before_its_commit_and_the_next_is_spliced_onto_it(store, tokenizer):
    gateway = Gateway(store, redactor=None)
    agent = Agent(gateway, tokenizer, new_episode(store))
    await agent.turn()
    await gateway.settled(agent.episode_id)
    assert len(calls(store, agent.episode_id)) == 1
    with Lock(store):  # the writer cannot commit: both calls are answered all the same, queued in one batch
        second = await asyncio.wait_for(agent.turn(), 20)
        third = await asyncio.wait_for(agent.turn(), 20)  # spliced onto the second's output, not committed yet
        assert third.prefix_call is not None and third.prefix_call < 0  # its provisional id
        settled = asyncio.ensure_future(gateway.settled(agent.episode_id))
        await asyncio.sleep(0.2)
        assert not settled.done()  # what reads the episode waits for its queued calls
        assert len(calls(store, agent.episode_id)) == 1
    await asyncio.wait_for(settled, 20)
    first, second_call, third_call = calls(store, agent.episode_id)
    assert second.prefix_call == first.id and second_call.prefix_call == first.id
    assert third_call.prefix_call == second_call.id  # the provisional id, resolved in the batch that wrote both
    assert third_call.prefix_message == 3 and third_call.retokenized_turns == 0
    assert third_call.request["messages"][3]["content"] == "Colour 2."


async def test_outcome_and_exports_wait_for_queued_calls_and_shutdown_drains_them(store, tokenizer):
    gateway = Gateway(store, redactor=None)
    server = BackgroundServer(create_app(ModelRegistry(), gateway)).start()
    root = server.base_url.removesuffix("/v1")
    agent = Agent(gateway, tokenizer, new_episode(store))
    other = Agent(gateway, tokenizer, new_episode(store))
    await agent.turn()
    await other.turn()
    await gateway.settled()
    try:
        async with httpx.AsyncClient(base_url=root, timeout=60) as http:
            with Lock(store) as lock:
                await agent.turn()
                listed = asyncio.ensure_future(http.get(f"/episodes/{agent.episode_id}/calls"))
                finished = asyncio.ensure_future(http.post(f"/episodes/{agent.episode_id}/finish", json={"reward": 1}))
                await asyncio.sleep(0.3)
                assert not listed.done() and not finished.done()  # both wait for the queued call
                await other.turn()  # queued behind the lock: the server's shutdown must write it
                lock.execute("COMMIT")  # let the first reads through, then hold the writer back again
                assert len((await listed).json()["data"]) == 2
                assert (await finished).status_code == 200
                trajectory = await http.get(f"/episodes/{agent.episode_id}/trajectory")
                assert trajectory.status_code == 200 and trajectory.json()["metrics"]["calls"] == 2
                lock.execute("BEGIN IMMEDIATE")
                await other.turn()
                stopping = threading.Thread(target=server.stop)
                stopping.start()
                await asyncio.sleep(0.3)
            stopping.join(30)  # the lock is released: the server drains its queue, then exits
            assert not stopping.is_alive()
        assert len(calls(store, other.episode_id)) == 3  # written before the server's stop returned
    finally:
        server.stop()


async def test_a_call_arriving_after_its_episode_closed_is_counted_and_dropped(store, tokenizer):
    """Another process finishes the episode while its call is queued (a straggler): the call is dropped and counted
    (``late_calls``), and the finished outcome stands: the episode stays finished with its reward and trains (a
    late call used to abandon it, and its group lost a member after its task completed)."""
    gateway = Gateway(store, redactor=None)
    server = BackgroundServer(create_app(ModelRegistry(), gateway)).start()
    root = server.base_url.removesuffix("/v1")
    agent = Agent(gateway, tokenizer, new_episode(store))
    await agent.turn()
    await gateway.settled(agent.episode_id)
    try:
        with Lock(store) as other_process:
            await agent.turn()  # answered; queued behind the other process's transaction, which finishes it
            other_process.execute(
                "UPDATE episodes SET status = 'finished', reward = 1 WHERE id = ?", (agent.episode_id,)
            )
        await gateway.settled(agent.episode_id)
        with store.session() as s:
            episode = episodes.get_episode(s, agent.episode_id)
        assert episode.status == EpisodeStatus.finished and episode.reward == 1
        assert episodes.LOST_CALLS not in episode.meta and len(calls(store, agent.episode_id)) == 1
        assert (gateway.late_calls, gateway.lost_calls) == (1, 0)
        async with httpx.AsyncClient(base_url=root, timeout=60) as http:
            again = await http.post(f"/episodes/{agent.episode_id}/finish", json={"reward": 1})
            assert again.status_code == 200  # the same outcome again: accepted, nothing changed
            groups = await http.get("/groups", params={"task_id": "t"})
            assert groups.status_code == 200 and len(groups.json()["trajectories"]) == 1
        with pytest.raises(EpisodeConflictError, match="finished"):
            await agent.turn()  # refused before it runs: the episode is closed
    finally:
        server.stop()


async def test_a_call_that_cannot_be_written_after_its_answer_abandons_its_open_episode(store, tokenizer):
    """A call answered and then refused by the store (here: its response holds a NaN, which JSON has not) is lost: its episode, still open, is abandoned; its finish is a 409 naming the call, its next call is
    refused, and the lost call is counted."""
    gateway = Gateway(store, redactor=None)
    server = BackgroundServer(create_app(ModelRegistry(), gateway)).start()
    root = server.base_url.removesuffix("/v1")
    agent = Agent(gateway, tokenizer, new_episode(store))
    await agent.turn()
    await agent.answer(await agent.prepare(), score=float("nan"))
    await gateway.settled(agent.episode_id)
    try:
        with store.session() as s:
            episode = episodes.get_episode(s, agent.episode_id)
        lost = f"chatcmpl-{agent.episode_id}-2"
        assert episode.status == EpisodeStatus.abandoned and episode.meta[episodes.LOST_CALLS] == 1
        assert lost in episode.meta["abandoned_because"]
        async with httpx.AsyncClient(base_url=root, timeout=60) as http:
            refused = await http.post(f"/episodes/{agent.episode_id}/finish", json={"reward": 1})
            assert refused.status_code == 409 and lost in refused.json()["error"]["message"]
            assert (await http.get("/gateway/stats")).json()["lost_calls"] == 1
            groups = await http.get("/groups", params={"task_id": "t"})
            assert groups.status_code == 200 and groups.json()["trajectories"] == []  # it never trains
        with pytest.raises(EpisodeConflictError, match="lost a call"):
            await agent.turn()
    finally:
        server.stop()


async def test_finish_waits_for_the_calls_still_being_generated(store, tokenizer):
    """An episode's finish (and abandon) waits for its calls in the engine, not only for those queued for writing:
    the call prepared before the finish arrived is in the finished episode. A call that never ends in a record (its
    request failed, its client went away: its prompt dropped) holds nothing up."""
    gateway = Gateway(store, redactor=None)
    server = BackgroundServer(create_app(ModelRegistry(), gateway)).start()
    root = server.base_url.removesuffix("/v1")
    agent, other = Agent(gateway, tokenizer, new_episode(store)), Agent(gateway, tokenizer, new_episode(store))
    await agent.turn()
    await other.turn()
    try:
        async with httpx.AsyncClient(base_url=root, timeout=60) as http:
            generating = await agent.prepare()
            finished = asyncio.ensure_future(http.post(f"/episodes/{agent.episode_id}/finish", json={"reward": 1}))
            await asyncio.sleep(0.5)
            assert not finished.done()  # the call is still being generated
            await agent.answer(generating)
            assert (await asyncio.wait_for(finished, 20)).status_code == 200
            assert len(calls(store, agent.episode_id)) == 2 and gateway.late_calls == 0
            failed = await other.prepare()
            del failed  # the engine raised, say: nothing to record
            abandoned = await asyncio.wait_for(http.post(f"/episodes/{other.episode_id}/abandon", json={}), 20)
            assert abandoned.status_code == 200
    finally:
        server.stop()


async def test_with_the_database_gone_a_lost_call_is_refused_in_memory(store, tokenizer):
    """The store loses its tables while a call is queued: neither the call nor the episode's abandonment can be
    written; this gateway still refuses the episode's outcome and its next call, and counts the lost call."""
    gateway = Gateway(store, redactor=None)
    agent = Agent(gateway, tokenizer, new_episode(store))
    await agent.turn()
    await gateway.settled(agent.episode_id)
    with Lock(store) as other:
        await agent.turn()
        other.execute("DROP TABLE calls")
        other.execute("DROP TABLE episodes")
    await gateway.settled(agent.episode_id)
    assert gateway.lost_calls == 1
    with pytest.raises(EpisodeConflictError, match=f"chatcmpl-{agent.episode_id}-2.*could not be recorded"):
        gateway.refuse_lost(agent.episode_id)
    with pytest.raises(EpisodeConflictError, match="lost a call"):
        await agent.turn()


async def test_a_reply_lost_with_its_gateway_is_re_tokenized_context_for_the_restarted_one(store, tokenizer):
    """A gateway answered a call and was killed before writing it (here: its episode's calls stay as the store
    has them, and a new Gateway on the same store is the restarted one). The agent's next call re-sends that
    reply: it matches no recorded output, so it is fed as re-tokenized context (counted), spliced after the
    recorded first call; the episode goes on and trains on the actions that were recorded."""
    episode_id = new_episode(store)
    before = Agent(Gateway(store, redactor=None), tokenizer, episode_id)
    await before.turn()
    await before.gateway.settled(episode_id)
    before.turns += 1  # the second call's reply, answered and never written
    before.messages += [{"role": "assistant", "content": "Colour 2."}, {"role": "user", "content": "Another."}]
    restarted = Gateway(store, redactor=None)
    after = Agent(restarted, tokenizer, episode_id)
    after.messages = before.messages
    await after.turn()
    await restarted.settled(episode_id)
    first, third = calls(store, episode_id)
    assert third.prefix_call == first.id and third.retokenized_turns == 1
    assert third.request["messages"][3]["content"] == "Colour 2."
    with store.session() as s:
        assert episodes.get_episode(s, episode_id).status == EpisodeStatus.open
    assert restarted.lost_calls == 0


async def test_without_write_behind_a_call_is_answered_once_committed(store, tokenizer):
    """For replicas on one database that do not route an episode to one replica: the answer waits for the commit,
    so whichever replica the next call or the outcome reaches finds the call recorded."""
    gateway = Gateway(store, redactor=None, write_behind=False)
    agent = Agent(gateway, tokenizer, new_episode(store))
    with Lock(store) as lock:
        answered = asyncio.ensure_future(agent.turn())
        await asyncio.sleep(0.3)
        assert not answered.done()  # the writer cannot commit: no answer yet
        lock.execute("COMMIT")
        lock.execute("BEGIN")  # (the context manager commits again on exit)
    await asyncio.wait_for(answered, 20)
    assert len(calls(store, agent.episode_id)) == 1


async def test_a_restarted_gateway_continues_an_episode_whose_replies_are_all_recorded(store, tokenizer):
    """The same restart with nothing lost: the episode read back from the store, history re-serialised
    (whitespace) and a few-shot example sent with the first call: spliced onto the recorded output."""
    episode_id = new_episode(store)
    shot = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    before = Agent(Gateway(store, redactor=None), tokenizer, episode_id)
    before.messages = [*shot, USER]
    await before.turn()
    await before.gateway.settled(episode_id)
    after = Agent(Gateway(store, redactor=None), tokenizer, episode_id)
    after.messages = [m | {"content": m["content"] + "  "} for m in before.messages]
    await after.turn()
    await after.gateway.settled(episode_id)
    recorded = calls(store, episode_id)
    assert len(recorded) == 2 and recorded[1].retokenized_turns == 0  # spliced onto the first call's output


async def test_an_episode_whose_calls_may_be_redacted_waits_for_them_before_its_next_call(store, tokenizer):
    """A production episode's calls are redacted by the writer (and then keep no token ids): what its next call
    may be spliced onto is known only once they are written, so its prompt waits for them."""
    gateway = Gateway(store)  # redacts production episodes
    with store.session() as s:
        episode_id = episodes.create_episode(s, "t", split="production").id
    agent = Agent(gateway, tokenizer, episode_id)
    await agent.turn()
    await gateway.settled(episode_id)
    with Lock(store):
        await asyncio.wait_for(agent.turn(), 20)  # answered before its commit
        third = asyncio.ensure_future(agent.turn())
        await asyncio.sleep(0.2)
        assert not third.done()  # its prompt waits for the second call's record
    splice = await asyncio.wait_for(third, 20)
    await gateway.settled(episode_id)
    first, second, _ = calls(store, episode_id)
    assert splice.prefix_call == second.id  # nothing was redacted: spliced onto the committed call's output


async def test_a_waiter_that_gives_up_leaves_the_call_to_be_written_for_the_others(store, tokenizer):
    """A request waiting for an episode's queued calls is cancelled (its client went away): the calls are still
    written, and whoever else waits for them is told."""
    gateway = Gateway(store, redactor=None)
    agent = Agent(gateway, tokenizer, new_episode(store))
    await agent.turn()
    await gateway.settled(agent.episode_id)
    with Lock(store):
        await agent.turn()
        given_up, waiting = (asyncio.ensure_future(gateway.settled(agent.episode_id)) for _ in range(2))
        await asyncio.sleep(0.1)
        given_up.cancel()
    await asyncio.wait_for(waiting, 20)
    assert len(calls(store, agent.episode_id)) == 2
    await agent.turn()  # the writer is alive: the next call is written too
    await gateway.settled(agent.episode_id)
    assert len(calls(store, agent.episode_id)) == 3


async def test_a_full_queue_refuses_calls_before_they_run_and_a_wait_that_lasts_too_long_is_a_503(store, tokenizer):
    """The writer is held back (another connection's write lock): at most ``max_queued`` calls are held, one more is
    refused before it runs (the agent is told to retry); an outcome whose calls are not written within ``wait_s``
    is a 503 with Retry-After, nothing changed. Once the lock goes, the calls are written and the finish passes."""
    gateway = Gateway(store, redactor=None, limits=WriteLimits(max_queued=2, wait_s=0.5))
    server = BackgroundServer(create_app(ModelRegistry(), gateway)).start()
    root = server.base_url.removesuffix("/v1")
    agent = Agent(gateway, tokenizer, new_episode(store))
    try:
        async with httpx.AsyncClient(base_url=root, timeout=60) as http:
            with Lock(store):
                await agent.turn()
                await agent.turn()
                with pytest.raises(GatewayBusyError, match="holds 2 calls not yet written"):
                    await agent.prepare()
                busy = await http.post(f"/episodes/{agent.episode_id}/finish", json={"reward": 1})
                assert busy.status_code == 503 and int(busy.headers["Retry-After"]) >= 1
                assert busy.json()["error"]["code"] == "gateway_busy"
            await gateway.settled(agent.episode_id)
            assert len(calls(store, agent.episode_id)) == 2
            done = await http.post(f"/episodes/{agent.episode_id}/finish", json={"reward": 1})
            assert done.status_code == 200 and done.json()["status"] == "finished"
    finally:
        server.stop()


def test_write_limits_come_from_the_environment_and_bad_ones_are_named(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_WRITE_RETRY_S", "2.5")
    monkeypatch.setenv("FLYWHEEL_WRITE_MAX_QUEUED", "7")
    assert WriteLimits.from_env() == WriteLimits(retry_s=2.5, max_queued=7)
    monkeypatch.setenv("FLYWHEEL_WRITE_WAIT_S", "soon")
    with pytest.raises(ValueError, match="FLYWHEEL_WRITE_WAIT_S was 'soon'"):
        WriteLimits.from_env()
    with pytest.raises(ValueError, match="max_queued >= 1"):
        WriteLimits(max_queued=0)
