"""The gateway: episodes recorded at the API boundary, with the real model, a real loopback server, the real
openai SDK and httpx, and a real SQLite store."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from flywheel.gateway.client import EpisodeClient, GatewayError
from flywheel.gateway.splice import Output, output_key, splice_prompt, tokenizer_key
from flywheel.inference.chat import render_prompt
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.store import Store, episodes
from flywheel.train.batch import trajectory_sequences
from flywheel.types import sampled_tokens

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}, "precision": {"type": "integer"}},
            "required": ["expression", "precision"],
            # no other keys: a greedy 135M model otherwise adds keys until max_tokens on some CPUs (bf16 rounding)
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is 12 * 7? Use the calculator."}]


def root(backend: LocalBackend) -> str:
    return backend.base_url.removesuffix("/v1")


@pytest.fixture
async def episode_client(backend: LocalBackend):
    async with EpisodeClient(root(backend)) as client:
        yield client


def agent(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def test_episode_url_records_each_call_with_the_ids_the_agent_received(backend, episode_client):
    episode = await episode_client.create("task-ids", metadata={"user": "u1"})
    assert episode.base_url.endswith(f"/episodes/{episode.id}/v1") and episode.status == "open"
    reply = await agent(episode.base_url).chat.completions.create(
        model=EMBEDDED_MODEL, messages=QUESTION, max_tokens=12, temperature=0.7, seed=1
    )
    received = sampled_tokens(reply.choices[0])
    assert received is not None and reply.choices[0].logprobs is None  # not asked for: not sent
    calls = await episode_client.calls(episode.id)
    assert len(calls) == 1
    call = calls[0]
    stored = call["response"]["choices"][0]
    assert stored["token_ids"] == received.completion_ids and stored["prompt_token_ids"] == received.prompt_ids
    assert stored["temperature"] == 0.7
    # log-probs are kept for training (TIS) even though the agent did not ask for them
    assert len(stored["logprobs"]["content"]) == len(received.completion_ids)
    assert all(math.isfinite(t["logprob"]) and t["logprob"] <= 0 for t in stored["logprobs"]["content"])
    assert call["request"]["messages"] == QUESTION and call["request"]["max_tokens"] == 12
    assert call["model"] == EMBEDDED_MODEL and call["step"] is None  # a base model: no checkpoint step
    assert call["prompt_tokens"] == len(received.prompt_ids)
    assert call["completion_tokens"] == len(received.completion_ids) and call["latency_ms"] > 0
    assert call["retokenized_turns"] == 0 and call["prefix_call"] is None


async def test_plain_routes_record_with_the_episode_header_and_streams_are_recorded(backend, episode_client):
    episode = await episode_client.create("task-header")
    client = agent(backend.base_url)
    await client.chat.completions.create(
        model=EMBEDDED_MODEL, messages=QUESTION, max_tokens=6, extra_headers={"X-Flywheel-Episode": episode.id}
    )
    stream = await agent(episode.base_url).chat.completions.create(
        model=EMBEDDED_MODEL, messages=QUESTION, max_tokens=6, n=2, temperature=1.0, stream=True
    )
    chunks = [chunk async for chunk in stream]
    streamed = {c.index: c for chunk in chunks for c in chunk.choices if c.finish_reason}
    await client.chat.completions.create(model=EMBEDDED_MODEL, messages=QUESTION, max_tokens=4)  # no header
    calls = await episode_client.calls(episode.id)
    assert len(calls) == 2  # the call without the header is not part of the episode
    recorded = {c["index"]: c for c in calls[1]["response"]["choices"]}
    assert sorted(recorded) == [0, 1]
    for index, final in streamed.items():  # the final chunk carries the sampled ids; the record has the same
        assert recorded[index]["token_ids"] == sampled_tokens(final).completion_ids
        assert len(recorded[index]["logprobs"]["content"]) == len(recorded[index]["token_ids"])


def spelled_out(tokenizer, text: str) -> list[int]:
    """``text`` as ids the tokenizer would never choose itself: one id per character."""
    return [tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(tokenizer.encode(ch))[0]) for ch in text]


def test_a_prompt_continues_the_ids_sampled_not_the_history_re_tokenized(tokenizer):
    """A reply the model drew in a non-canonical spelling: the next prompt holds those exact ids, where rendering
    the re-sent history from text would not."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = render_prompt(tokenizer, QUESTION)
    completion = spelled_out(tokenizer, "It is 84.") + [eos]
    assert tokenizer.decode(completion, skip_special_tokens=True) == "It is 84."
    reply = {"role": "assistant", "content": "It is 84."}
    output = Output(7, 0, output_key(QUESTION, None, reply), prompt + completion, True, tokenizer_key(tokenizer))
    history = [*QUESTION, reply, {"role": "user", "content": "And 12 * 8?"}]
    spliced = splice_prompt(tokenizer, history, None, [output])
    assert spliced.prompt[: len(output.ids)] == output.ids
    assert (spliced.prefix_call, spliced.prefix_choice, spliced.prefix_message) == (7, 0, 1)
    assert spliced.retokenized_turns == 0
    # the rest is the template's rendering after the reply's end-of-turn token
    rendered = render_prompt(tokenizer, history)
    assert rendered != spliced.prompt and tokenizer.decode(spliced.prompt) == tokenizer.decode(rendered)
    # an edited reply is not the one sampled: rendered from text, and counted
    edited = [*QUESTION, {"role": "assistant", "content": "It is 85."}, history[-1]]
    fallback = splice_prompt(tokenizer, edited, None, [output])
    assert fallback.prompt == render_prompt(tokenizer, edited) and fallback.retokenized_turns == 1
    assert fallback.prefix_call is None
    # so is one that stopped before its end-of-turn token (max_tokens): it cannot be continued exactly
    cut = Output(7, 0, output.key, prompt + completion[:-1], ended=False)
    assert splice_prompt(tokenizer, history, None, [cut]).retokenized_turns == 1


def reserialised(message) -> dict:
    """The assistant turn as a client that parses and re-dumps tool arguments sends it back (LangChain and the
    OpenAI Agents SDK do): other key order, other spacing, a new content of None."""
    calls = [
        {
            "id": c.id,
            "type": "function",
            "function": {
                "name": c.function.name,
                "arguments": json.dumps(dict(reversed(json.loads(c.function.arguments).items())), indent=1),
            },
        }
        for c in message.tool_calls
    ]
    return {"role": "assistant", "content": None, "tool_calls": calls}


async def test_a_tool_using_episode_trains_on_exactly_the_sampled_tokens(backend, episode_client, tokenizer):
    episode = await episode_client.create("task-tools")
    client = agent(episode.base_url)
    first = await client.chat.completions.create(
        model=EMBEDDED_MODEL, messages=QUESTION, tools=[CALC], max_tokens=150, temperature=0,
        tool_choice={"type": "function", "function": {"name": "calc"}},
    )  # fmt: skip
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    history = [
        *QUESTION,
        reserialised(first.choices[0].message),
        {"role": "tool", "tool_call_id": call.id, "content": "84"},
    ]
    second = await client.chat.completions.create(model=EMBEDDED_MODEL, messages=history, tools=[CALC], max_tokens=8)
    a, b = sampled_tokens(first.choices[0]), sampled_tokens(second.choices[0])
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == a.prompt_ids + a.completion_ids
    calls = await episode_client.calls(episode.id)
    assert [c["prefix_call"] for c in calls] == [None, calls[0]["id"]]
    assert [c["retokenized_turns"] for c in calls] == [0, 0] and calls[1]["prefix_message"] == 1

    await episode_client.finish(episode.id, 1.0, metrics={"solved": True}, call_rewards={calls[0]["id"]: 0.5})
    trajectory = await episode_client.trajectory(episode.id)
    assert trajectory.reward == 1.0 and trajectory.metrics["solved"] is True and trajectory.metrics["calls"] == 2
    assert trajectory.metadata["task_id"] == "task-tools" and not trajectory.additional_histories
    sequences = trajectory_sequences(trajectory, tokenizer)
    assert len(sequences) == 1  # the second call continues the first token for token: one sequence
    trained = [t for t, on in zip(sequences[0].tokens, sequences[0].trained) if on]
    assert trained == a.completion_ids + b.completion_ids  # only what was sampled trains, nothing re-tokenized
    sampler = [x for x, on in zip(sequences[0].sampler_logprobs, sequences[0].trained) if on]
    # the forced call's log-probs are the grammar-masked distribution's: not compared by TIS (issue #37 item 13)
    assert all(math.isnan(x) for x in sampler[: len(a.completion_ids)])
    assert not any(math.isnan(x) for x in sampler[len(a.completion_ids) :])
    rows = (await episode_client.transitions(episode.id)).splitlines()
    assert [json.loads(r)["reward"] for r in rows] == [0.5, 1.0]  # the call's own reward, then the outcome


async def test_an_edited_history_splits_into_sequences_and_is_counted(backend, episode_client, tokenizer):
    episode = await episode_client.create("task-edited")
    client = agent(episode.base_url)
    first = await client.chat.completions.create(model=EMBEDDED_MODEL, messages=QUESTION, max_tokens=8)
    edited = {"role": "assistant", "content": (first.choices[0].message.content or "") + " (edited)"}
    await client.chat.completions.create(
        model=EMBEDDED_MODEL, messages=[*QUESTION, edited, {"role": "user", "content": "Sure?"}], max_tokens=8
    )
    calls = await episode_client.calls(episode.id)
    assert calls[1]["retokenized_turns"] == 1 and calls[1]["prefix_call"] is None
    await episode_client.finish(episode.id, 0.0)
    trajectory = await episode_client.trajectory(episode.id)
    assert trajectory.metrics["retokenized_turns"] == 1
    assert len(trajectory.additional_histories) == 1  # the edited history is a chain of its own
    sequences = trajectory_sequences(trajectory, tokenizer)
    assert len(sequences) == 2  # each call trains in a sequence of its own
    trained = [[t for t, on in zip(s.tokens, s.trained) if on] for s in sequences]
    assert sorted(map(len, trained)) == sorted(c["completion_tokens"] for c in calls)


async def test_outcomes_are_idempotent_and_closed_episodes_refuse_changes(backend, episode_client):
    episode = await episode_client.create("task-outcome")
    await agent(episode.base_url).chat.completions.create(model=EMBEDDED_MODEL, messages=QUESTION, max_tokens=2)
    await episode_client.reward(episode.id, 0.25)
    await episode_client.reward(episode.id, 0.5)  # while open, a later reward replaces the earlier one
    with pytest.raises(GatewayError) as no_reward:
        await episode_client.finish((await episode_client.create("task-outcome")).id)
    assert no_reward.value.status == 400 and "no reward" in str(no_reward.value)
    done = await episode_client.finish(episode.id, metrics={"turns": 1})
    assert done.status == "finished" and done.reward == 0.5 and done.finished_at is not None
    again = await episode_client.finish(episode.id, 0.5, metrics={"turns": 1})  # a retried request: accepted, no change
    assert again.finished_at == done.finished_at
    for attempt in (
        episode_client.finish(episode.id, 1.0),
        episode_client.reward(episode.id, 0.0),
        episode_client.abandon(episode.id),
    ):
        with pytest.raises(GatewayError) as conflict:
            await attempt
        assert conflict.value.status == 409
    with pytest.raises(openai.ConflictError, match="finished"):  # no more calls in a finished episode
        await agent(episode.base_url).chat.completions.create(model=EMBEDDED_MODEL, messages=QUESTION, max_tokens=2)
    assert len(await episode_client.calls(episode.id)) == 1
    assert [e.id for e in await episode_client.list(task_id="task-outcome", status="finished")] == [episode.id]

    dropped = await episode_client.create("task-outcome")
    assert (await episode_client.abandon(dropped.id, "user left")).status == "abandoned"
    assert (await episode_client.abandon(dropped.id)).meta["abandoned_because"] == "user left"  # twice: accepted
    with pytest.raises(GatewayError) as not_trainable:
        await episode_client.trajectory(dropped.id)
    assert not_trainable.value.status == 409 and "abandoned" in str(not_trainable.value)


async def test_bad_requests_get_clear_errors_never_a_500(backend, episode_client):
    url = root(backend)
    episode = await episode_client.create("task-bad")
    async with httpx.AsyncClient(base_url=url) as http:
        cases = [
            ("GET", "/episodes/ep_nope", None, 404),
            ("POST", "/episodes/ep_nope/finish", {"reward": 1}, 404),
            ("POST", "/episodes/ep_nope/v1/chat/completions", {"model": EMBEDDED_MODEL, "messages": QUESTION}, 404),
            ("POST", "/episodes", {"split": "train"}, 400),  # no task_id
            ("POST", "/episodes", {"task_id": "t", "colour": "red"}, 400),  # an unknown field
            ("POST", f"/episodes/{episode.id}/reward", {"reward": "high"}, 400),
            ("POST", f"/episodes/{episode.id}/reward", {"call_rewards": {"12345678": 1.0}}, 400),  # not its call
            ("GET", "/episodes?limit=0", None, 400),
        ]
        for method, path, body, status in cases:
            response = await http.request(method, path, json=body)
            assert response.status_code == status, (path, body, response.text)
            assert response.json()["error"]["message"], (path, response.text)
        nan = await http.post(
            f"/episodes/{episode.id}/reward", content=b'{"reward": NaN}', headers={"content-type": "application/json"}
        )
        assert nan.status_code == 400 and "finite" in nan.json()["error"]["message"]
        unknown_header = await http.post(
            "/v1/chat/completions",
            json={"model": EMBEDDED_MODEL, "messages": QUESTION},
            headers={"X-Flywheel-Episode": "ep_nope"},
        )
        assert unknown_header.status_code == 404 and unknown_header.json()["error"]["code"] == "episode_not_found"
        huge = await http.post("/episodes", content=b" " * (33 * 1024 * 1024))
        assert huge.status_code == 413 and "larger than" in huge.json()["error"]["message"]

        async def chunked():  # no declared length: counted as it arrives
            for _ in range(40):
                yield b" " * (1024 * 1024)

        streamed = await http.post("/episodes", content=chunked())
        assert streamed.status_code == 413
    assert (await episode_client.get(episode.id)).reward is None  # nothing changed


async def test_groups_from_the_gateway_train_and_survive_a_restart(backend, model, episode_client):
    """Episodes of two tasks, through the registered model's name: groups for ``model.train``; the store keeps
    them for a new process (a Store opened again on the same file)."""
    rewards = {"task-g1": [1.0, 0.0], "task-g2": [0.0, 1.0]}
    for task, values in rewards.items():
        for value in values:
            episode = await episode_client.create(task, model=model.name)
            await agent(episode.base_url).chat.completions.create(
                model=model.name, messages=QUESTION, max_tokens=6, temperature=1.0
            )
            await episode_client.finish(episode.id, value)
    groups = [await episode_client.group(task) for task in rewards]
    assert [sorted(t.reward for t in g) for g in groups] == [[0.0, 1.0], [0.0, 1.0]]
    calls = await episode_client.calls(groups[0].trajectories[0].metadata["episode_id"])
    before = await model.get_step()
    assert calls[0]["step"] == before  # the live weights' step answered
    await model.train(groups)
    assert await model.get_step() == before + 1

    again = Store(backend.gateway.store.url)
    try:
        with again.session() as s:
            found = episodes.list_episodes(s, task_id="task-g1")
            assert [e.reward for e in found] == rewards["task-g1"] and all(e.status == "finished" for e in found)
            assert len(episodes.calls(s, found[0].id)) == 1
    finally:
        again.close()
