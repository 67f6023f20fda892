"""Load through the gateway: 64 concurrent agents on a real loopback server (bounded: two calls each), with the
real openai SDK. Nothing is lost and every recorded completion holds exactly the ids the agent received."""

from __future__ import annotations

import asyncio

import openai

from flywheel.gateway.client import EpisodeClient
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.types import sampled_tokens

AGENTS = 64


async def test_64_concurrent_agents_lose_no_call_or_episode_and_every_id_is_recorded(backend):
    root = backend.base_url.removesuffix("/v1")
    received: dict[str, list] = {}

    async def agent(i: int, episodes: EpisodeClient) -> str:
        episode = await episodes.create("load", metadata={"agent": i})
        client = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": f"Reply with one word: yes or no. Is {i} even?"}]
        first = await client.chat.completions.create(
            model=EMBEDDED_MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=i
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]
        second = await client.chat.completions.create(
            model=EMBEDDED_MODEL, messages=messages, max_tokens=4, temperature=1.0, seed=i, stream=i % 2 == 1
        )
        if i % 2:  # streamed: the final chunk of each choice carries its sampled ids
            finals = [c for chunk in [c async for c in second] for c in chunk.choices if c.finish_reason]
            second_ids = sampled_tokens(finals[0])
        else:
            second_ids = sampled_tokens(second.choices[0])
        received[episode.id] = [sampled_tokens(first.choices[0]), second_ids]
        await episodes.finish(episode.id, float(i % 2))
        return episode.id

    async with EpisodeClient(root, timeout=300) as episodes:
        ids = await asyncio.wait_for(asyncio.gather(*(agent(i, episodes) for i in range(AGENTS))), timeout=900)
        assert len(set(ids)) == AGENTS
        finished = await episodes.list(task_id="load", status="finished", limit=1000)
        assert sorted(e.id for e in finished) == sorted(ids)  # no episode lost
        spliced = 0
        for episode_id in ids:
            calls = await episodes.calls(episode_id)
            assert len(calls) == 2  # no call lost, none recorded twice
            for call, got in zip(calls, received[episode_id], strict=True):
                stored = call["response"]["choices"][0]
                assert stored["token_ids"] == got.completion_ids and stored["prompt_token_ids"] == got.prompt_ids
            spliced += calls[1]["prefix_call"] == calls[0]["id"]
        # a reply cut by max_tokens has no end-of-turn token: its history is re-rendered (counted), not spliced;
        # replies that ended are continued exactly
        ended = sum(1 for episode_id in ids if received[episode_id][0].completion_ids[-1] in backend_eos(backend))
        assert spliced == ended and ended >= AGENTS // 4, (spliced, ended)


def backend_eos(backend) -> set[int]:
    return set(backend.engine(EMBEDDED_MODEL).eos_ids)
