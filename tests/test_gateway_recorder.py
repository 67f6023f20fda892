"""The gateway's call writer: calls that finish together are committed in one transaction (group commit), each
call is refused alone when its episode closed meanwhile, and no read through the gateway misses a call that was
answered (calls are written behind their answers: reads wait for them). The store-level tests run on SQLite and
PostgreSQL; none loads a model but the last, which uses the session's."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import openai
from sqlalchemy import event

from flywheel.gateway.client import EpisodeClient
from flywheel.gateway.recorder import Gateway
from flywheel.gateway.splice import Splice
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.store import CallRecord, EpisodeConflictError, Store, UnknownEpisodeError, episodes


def fields(n: int) -> dict:
    """A recorded call's columns (a one-token reply; ``n`` tells the calls apart)."""
    choice = {"index": 0, "message": {"role": "assistant", "content": f"reply {n}"}, "finish_reason": "stop"}
    return dict(
        prefix_call=None, prefix_choice=None, prefix_message=None, retokenized_turns=0, reward=None, model="m",
        step=None, request={"messages": [{"role": "user", "content": f"question {n}"}]},
        response={"choices": [choice | {"prompt_token_ids": [1, 2], "token_ids": [n]}]}, prompt_tokens=2,
        completion_tokens=1, latency_ms=1.0,
    )  # fmt: skip


def test_a_batch_records_its_calls_in_order_and_refuses_only_those_it_cannot_record(db_url: str):
    store = Store(db_url)
    with store.session() as s:
        a, closed, b = (episodes.create_episode(s, "t").id for _ in range(3))
    with store.session() as s:
        episodes.set_outcome(s, closed, reward=1.0, finish=True)
    with store.session() as s:
        nan = fields(6) | {"response": {"choices": [], "x": float("nan")}}
        outcomes = episodes.add_calls(
            s, [(a, fields(1)), (closed, fields(2)), (b, fields(3)), ("ep_nope", fields(4)), (b, nan)]
        )
        outcomes += episodes.add_calls(s, [(a, fields(5))])
    first, refused, second, unknown, unstorable, third = outcomes
    assert isinstance(refused, EpisodeConflictError) and "finished: it takes no more calls" in str(refused)
    assert isinstance(unknown, UnknownEpisodeError) and unknown.episode_id == "ep_nope"
    assert isinstance(unstorable, ValueError) and "calls.response cannot be stored: it holds nan" in str(unstorable)
    assert isinstance(first, CallRecord) and isinstance(second, CallRecord) and isinstance(third, CallRecord)
    assert first.id < second.id < third.id  # the order given is the calls' order
    with store.session() as s:
        assert [c.response["choices"][0]["token_ids"] for c in episodes.calls(s, a)] == [[1], [5]]
        assert [c.id for c in episodes.calls(s, b)] == [second.id] and episodes.calls(s, closed) == []
    store.close()


async def test_calls_queued_together_commit_as_one_and_a_closed_episode_refuses_only_its_own(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
    # no redaction: the writer reads no split, each batch is one commit; answers after the commit: each call's
    # refusal is its caller's
    gateway = Gateway(store, redactor=None, write_behind=False)
    with store.session() as s:
        first, a, closed, b = (episodes.create_episode(s, "t").id for _ in range(4))
    with store.session() as s:  # closed meanwhile: after its call was prepared, before it was recorded
        episodes.set_outcome(s, closed, reward=0.0, finish=True)
    commits, inserting = [], threading.Event()
    event.listen(store.engine, "commit", lambda _: commits.append(time.perf_counter()))
    writes = ("BEGIN IMMEDIATE", "INSERT")  # the write lock taken before the insert, or the insert
    event.listen(store.engine, "before_cursor_execute", lambda *a: a[2].startswith(writes) and inserting.set())

    def record(episode_id: str, n: int):
        call = {k: v for k, v in fields(n).items() if k in ("model", "step", "request", "response", "latency_ms")}
        return asyncio.ensure_future(gateway.record(episode_id, Splice([1, 2]), {n}, **call))

    other_writer = sqlite3.connect(tmp_path / "flywheel.db", isolation_level=None)
    other_writer.execute("BEGIN IMMEDIATE")  # another process writes: the gateway's first batch waits for it
    pending = [record(first, 1)]
    assert await asyncio.to_thread(inserting.wait, 30)  # that batch is waiting for the database
    pending += [record(a, 2), record(closed, 3), record(b, 4)]
    await asyncio.sleep(0)  # each of them is queued now, behind the first batch
    other_writer.execute("ROLLBACK")
    outcomes = await asyncio.gather(*pending, return_exceptions=True)
    assert len(commits) == 2  # the first call's batch, then the three queued together, in one transaction
    assert [o for i, o in enumerate(outcomes) if i != 2] == [None, None, None]  # committed
    assert isinstance(outcomes[2], EpisodeConflictError)  # the app's handler makes it a 409 for that call alone
    with store.session() as s:
        assert [len(episodes.calls(s, e)) for e in (first, a, closed, b)] == [1, 1, 0, 1]
        assert episodes.calls(s, a)[0].id < episodes.calls(s, b)[0].id  # in the order they were queued
    other_writer.close()
    store.close()


async def test_no_read_through_the_gateway_misses_a_call_that_was_answered(backend):
    """The writer's commits are slowed down (50 ms each): an answer leaves before its commit, and the episode's
    calls read through the gateway right after it must hold it all the same (the read waits for it)."""
    store = backend.gateway.store
    root = backend.base_url.removesuffix("/v1")

    def slow_commit(_) -> None:
        if threading.current_thread().name == "flywheel-call-writer":
            time.sleep(0.05)

    event.listen(store.engine, "commit", slow_commit)
    try:
        async with EpisodeClient(root) as episode_client:

            async def agent(i: int) -> None:
                episode = await episode_client.create("durable")
                client = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
                for turn in range(2):
                    reply = await client.chat.completions.create(
                        model=EMBEDDED_MODEL, messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=1
                    )
                    calls = await episode_client.calls(episode.id)  # at once: the answer is here, so its call must be
                    assert len(calls) == turn + 1
                    assert calls[-1]["response"]["id"] == reply.id

            await asyncio.gather(*(agent(i) for i in range(8)))
    finally:
        event.remove(store.engine, "commit", slow_commit)
