"""The gateway on PostgreSQL: a real loopback server over the session's engine (no second model) whose store is a
database on the tests' real PostgreSQL server; the episode API and the rollout queue through HTTP, as runners and the
training side use them. (The other gateway tests run on SQLite; the store's own tests run on both.)"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from flywheel.gateway.client import GatewayError, QueueClient
from flywheel.gateway.recorder import Gateway
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store

QUESTION = "What is 2 + 2? Answer with a number."


@pytest.fixture
def gateway(engine, pg_url: str):
    registry = ModelRegistry()
    registry.add(EMBEDDED_MODEL, engine)
    store = Store(pg_url)
    server = BackgroundServer(create_app(registry, Gateway(store))).start()
    yield server
    server.stop()
    store.close()


async def one_call(base_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(
        model=EMBEDDED_MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=3, temperature=0
    )
    assert reply.choices[0].message.content is not None


async def test_episodes_and_the_rollout_queue_on_postgresql(gateway: BackgroundServer):
    root = gateway.base_url.removesuffix("/v1")
    async with QueueClient(root) as queue:
        # the episode API: a call recorded with its token ids, an outcome, the trajectory that trains
        episode = await queue.create("pg-episode", metadata={"source": "ünï", "nested": {"k": [1, None]}})
        await one_call(f"{root}/episodes/{episode.id}/v1")
        (call,) = await queue.calls(episode.id)
        assert call["response"]["choices"][0]["token_ids"] and call["completion_tokens"] >= 1
        finished = await queue.finish(episode.id, 0.5, metrics={"turns": 1}, call_rewards={call["id"]: 0.25})
        assert finished.status == "finished" and finished.meta == {"source": "ünï", "nested": {"k": [1, None]}}
        assert (await queue.finish(episode.id, 0.5)).reward == 0.5  # retried: the same outcome, accepted
        with pytest.raises(GatewayError) as closed:
            await queue.finish(episode.id, 1.0)
        assert closed.value.status == 409
        assert (await queue.trajectory(episode.id)).reward == 0.5

        # two identical enqueues at the same instant: one task (201 and 200), never a 500
        body = {"task_id": "pg-task", "payload": {"question": QUESTION}, "group_size": 2, "max_tries": 2}
        async with httpx.AsyncClient(base_url=root) as http:
            answers = await asyncio.gather(*(http.post("/tasks", json=body) for _ in range(3)))
        assert sorted(a.status_code for a in answers) == [200, 200, 201], [a.text for a in answers]

        # claims with leases: the first one expires, its late result is refused, the attempt is run again
        first = await queue.claim("runner-a", lease_seconds=1)
        second = await queue.claim("runner-b", lease_seconds=60)
        assert first is not None and second is not None and first.id != second.id
        assert await queue.claim("runner-c") is None  # both attempts are leased
        await one_call(first.base_url)
        await asyncio.sleep(1.5)  # past the first lease
        again = await queue.claim("runner-c", lease_seconds=60)
        assert again is not None and again.id == first.id and again.tries == 1 and again.episode_id != first.episode_id
        with pytest.raises(GatewayError) as late:
            await queue.complete(first.id, first.episode_id, 1.0)
        assert late.value.status == 409
        assert (await queue.get(first.episode_id)).status == "abandoned"
        for lease in (second, again):
            await one_call(lease.base_url)
            assert (await queue.complete(lease.id, lease.episode_id, 1.0)).status == "finished"

        task = await queue.task("pg-task")
        assert task.complete and task.counts == {"queued": 0, "leased": 0, "finished": 2, "failed": 0}
        (group,) = await queue.wait_groups(["pg-task"], max_wait=10)
        assert len(group.trajectories) == 2 and {t.reward for t in group.trajectories} == {1.0}

        # what PostgreSQL cannot hold (NaN and infinities in JSON, NUL in text) is a 400 naming it, never a 500
        open_one = (await queue.create("pg-bad")).id
        bad = [
            ("/episodes", '{"task_id": "pg-bad", "metadata": {"x": NaN}}'),
            ("/episodes", '{"task_id": "pg-\\u0000"}'),
            ("/tasks", '{"task_id": "pg-inf", "payload": {"x": [Infinity]}, "group_size": 1}'),
            (f"/episodes/{open_one}/reward", '{"reward": 1, "metrics": {"x": NaN}}'),
        ]
        async with httpx.AsyncClient(base_url=root, headers={"content-type": "application/json"}) as http:
            for path, body in bad:
                answer = await http.post(path, content=body)
                assert answer.status_code == 400 and "cannot be stored" in answer.json()["error"]["message"], (
                    answer.text
                )
        assert [e.id for e in await queue.list(task_id="pg-bad")] == [open_one]
        assert (await queue.get(open_one)).reward is None
