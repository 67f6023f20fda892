"""The HTTP API on a real loopback port, through the real openai SDK (and raw httpx for malformed bodies)."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from flywheel.inference.loading import EMBEDDED_MODEL

MODEL = EMBEDDED_MODEL
MESSAGES = [{"role": "user", "content": "List the days of the week."}]


async def test_models_lists_the_served_model(client):
    models = await client.models.list()
    assert MODEL in [m.id for m in models.data]


async def test_chat_completion_non_streaming(client):
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16, logprobs=True, top_logprobs=2
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(choice.token_ids) == len(choice.logprobs.content)
    assert r.usage.prompt_tokens == len(choice.prompt_token_ids)
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content).startswith(choice.message.content[:10])


async def test_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, seed=1)
    whole = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


async def test_n_choices_and_stop(client):
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=8, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    stopped = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, stop=["Tuesday"]
    )
    assert "Tuesday" not in stopped.choices[0].message.content


async def test_concurrent_clients_are_batched(client, engine):
    async def one(i):
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=24
        )
        return r.choices[0].message.content

    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, len(engine._running))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    outs = await asyncio.gather(*(one(i) for i in range(8)))
    watcher.cancel()
    assert all(outs)
    assert peak > 1, "concurrent requests should decode in one batch"


async def test_tools_are_accepted_and_answer_is_consistent(client):
    tool = {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
    r = await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "What is 17 * 23?"},
        ],
        tools=[tool],
        max_tokens=48,
        temperature=0,
    )
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        assert all(tc.function.name for tc in c.message.tool_calls)
    else:
        assert c.message.content is not None and c.finish_reason in ("stop", "length")


async def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        await client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert err.value.body["code"] == "model_not_found"
    assert "no-such-model" in err.value.body["message"] and MODEL in err.value.body["message"]


async def test_context_overflow_is_400_and_says_the_limit(client, engine):
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=engine.context_length + 1)
    assert err.value.body["code"] == "context_length_exceeded"
    assert str(engine.context_length) in err.value.body["message"]


async def test_context_overflow_says_the_largest_max_tokens_that_fits(client, engine):
    """ART's scripts written for big models ask max_completion_tokens=8000: refused as OpenAI and vLLM refuse it (not
    clipped), the message naming the context, the prompt's tokens and the largest max_tokens that fits."""
    prompt = (await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=engine.context_length
        )
    message = err.value.body["message"]
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "messages"
    assert f"maximum context length is {engine.context_length} tokens" in message
    assert f"({prompt} in the messages, {engine.context_length} in the completion)" in message
    assert f"At most {engine.context_length - prompt} completion tokens fit" in message and "max_tokens" in message
    # messages that alone fill the context (refused before any prefill): no max_tokens fits, say by how much to cut
    long = [{"role": "user", "content": "day " * engine.context_length}]
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=long)
    message = err.value.body["message"]
    assert err.value.body["code"] == "context_length_exceeded"
    tokens = int(re.search(r"\((\d+) in the messages, 1 in the completion\)", message).group(1))
    assert (
        f"The messages alone fill the context: shorten them by at least {tokens - engine.context_length + 1} "
        in message
    )


@pytest.mark.parametrize(
    "body, where",
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0"),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "5"}]}, "messages.0"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": 5}, "temperature"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ],
)
async def test_malformed_requests_are_400_with_the_place(backend, body, where):
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{backend.base_url}/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(where)


async def test_non_json_body_is_400(backend):
    async with httpx.AsyncClient() as http:
        r = await http.post(
            f"{backend.base_url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_server_keeps_serving_after_errors(client):
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert r.choices[0].message.content
