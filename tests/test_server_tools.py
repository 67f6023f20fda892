"""Tool calls and streaming over HTTP, through the real openai SDK on the real embedded model: ``tool_choice``
("required" and a named function force a call by constrained decoding, "none" offers no tools), streamed tool
calls, ``n`` and logprobs, and an error in the middle of a stream."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer

MODEL = EMBEDDED_MODEL
CALCULATOR_PARAMS = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 30}},
    "required": ["expression"],
    "additionalProperties": False,
}
# a $ref into the schema's own $defs: the arguments' grammar must resolve it against the parameters' root
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
}
CALCULATOR = {
    "type": "function",
    "function": {"name": "calculator", "description": "Evaluate arithmetic.", "parameters": CALCULATOR_PARAMS},
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather.", "parameters": WEATHER_PARAMS},
}
SCHEMAS = {"calculator": CALCULATOR_PARAMS, "get_weather": WEATHER_PARAMS}
MESSAGES = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 17 * 23?"}]


def assert_valid_call(call, name: str | None = None) -> None:
    assert call.type == "function" and call.id
    assert call.function.name in SCHEMAS and (name is None or call.function.name == name)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_required_tool_choice_forces_a_call_valid_against_the_schema(client):
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[CALCULATOR, WEATHER], tool_choice="required",
        n=3, seed=11, temperature=1.0, max_tokens=80,
    )  # fmt: skip
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        assert_valid_call(choice.message.tool_calls[0])


async def test_a_named_function_is_the_one_called(client):
    """The question is arithmetic, the forced tool is the weather: the grammar, not the model, picks the name."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[CALCULATOR, WEATHER], tool_choice=choice, temperature=0, max_tokens=80
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    assert_valid_call(c.message.tool_calls[0], name="get_weather")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_call_cut_by_max_tokens_comes_back_as_the_call_it_was_writing(client, stream):
    """As OpenAI and vLLM answer it: the call with its arguments so far and finish reason "length", not the call's
    raw markup as content. 22 tokens reach the arguments' first characters, not their end."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[CALCULATOR, WEATHER], tool_choice=choice, temperature=0)
    r = await client.chat.completions.create(**kwargs, max_tokens=22, stream=stream)
    if stream:
        out, _ = await collect(r)
        content, calls, finish = out[0]["content"], list(out[0]["calls"].values()), out[0]["finish"][-1]
        calls = [(c["name"], c["arguments"]) for c in calls]
    else:
        c = r.choices[0]
        content, finish = c.message.content, c.finish_reason
        calls = [(tc.function.name, tc.function.arguments) for tc in c.message.tool_calls or []]
    assert finish == "length" and not content and len(calls) == 1, (content, calls)
    name, arguments = calls[0]
    assert name == "get_weather" and "<tool_call>" not in arguments
    full = await client.chat.completions.create(**kwargs, max_tokens=80)  # the same greedy call, not cut
    compact = json.dumps(json.loads(full.choices[0].message.tool_calls[0].function.arguments), separators=(",", ":"))
    assert arguments and compact.startswith(arguments) and compact != arguments, (arguments, compact)


async def test_parameters_llguidance_cannot_compile_still_give_a_call_with_an_object(client):
    """Tools are not checked under "auto", so forcing one must not fail on its schema: any JSON object instead."""
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "objekt"}}}
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[odd], tool_choice="required", temperature=0, max_tokens=60
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "odd"
    assert isinstance(json.loads(c.message.tool_calls[0].function.arguments), dict)


async def test_tool_choice_none_offers_no_tools(client):
    """ "none": the prompt is the one without tools (so the model has nothing to call), and the answer is content."""
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16)
    plain = await client.chat.completions.create(**kwargs)
    none = await client.chat.completions.create(**kwargs, tools=[CALCULATOR], tool_choice="none")
    auto = await client.chat.completions.create(**kwargs, tools=[CALCULATOR], tool_choice="auto")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


async def collect(stream) -> tuple[dict[int, dict], list]:
    """Per choice index: content, tool calls (assembled from their deltas), finish reasons, logprob entries."""
    out: dict[int, dict] = {}
    usage = []
    async for chunk in stream:
        if chunk.usage:
            usage.append(chunk.usage)
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "calls": {}, "finish": [], "logprobs": []})
            o["content"] += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = o["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                o["finish"].append(c.finish_reason)
            if c.logprobs and c.logprobs.content:
                o["logprobs"] += c.logprobs.content
    return out, usage


async def test_streamed_tool_call_arrives_as_a_tool_calls_delta(client):
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=[CALCULATOR, WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    whole = await client.chat.completions.create(**kwargs)
    out, _ = await collect(await client.chat.completions.create(**kwargs, stream=True))
    assert list(out) == [0] and out[0]["finish"] == ["tool_calls"]
    (call,) = out[0]["calls"].values()
    expected = whole.choices[0].message.tool_calls[0].function
    assert call["id"] and (call["name"], call["arguments"]) == (expected.name, expected.arguments)
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


async def test_streaming_n_choices_each_index_complete(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], n=3, seed=3, max_tokens=20)
    whole = await client.chat.completions.create(**kwargs)
    out, usage = await collect(
        await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert sorted(out) == [0, 1, 2]
    for choice in whole.choices:
        streamed = out[choice.index]
        assert streamed["content"] == choice.message.content
        assert streamed["finish"] == [choice.finish_reason]  # exactly one finish per index
    assert usage[0].completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("tools", [None, "required"], ids=["text", "forced-tool-call"])
async def test_streaming_logprobs_one_entry_per_token(client, tools):
    kwargs = dict(model=MODEL, messages=MESSAGES, n=2, seed=5, max_tokens=40, logprobs=True, top_logprobs=2)
    if tools:
        kwargs |= dict(tools=[CALCULATOR], tool_choice=tools)
    whole = await client.chat.completions.create(**kwargs)
    out, _ = await collect(await client.chat.completions.create(**kwargs, stream=True))
    for choice in whole.choices:
        streamed = out[choice.index]["logprobs"]
        assert len(streamed) == len(choice.token_ids) == len(choice.logprobs.content)
        assert [t.logprob for t in streamed] == [t.logprob for t in choice.logprobs.content]
        # top 2, fewer where the grammar allows only one token (forced tokens of the call)
        assert [len(t.top_logprobs) for t in streamed] == [len(t.top_logprobs) for t in choice.logprobs.content]
        assert all(1 <= len(t.top_logprobs) <= 2 for t in streamed) and max(len(t.top_logprobs) for t in streamed) == 2


async def test_an_engine_closed_mid_stream_ends_the_stream_with_an_in_band_error():
    """A real fault, not a mock: the engine behind the server is closed while a stream is in flight. The 200 and
    the first chunks are sent already, so the stream must carry the error and end (the SDK raises it), not hang.
    An engine of its own: closing the session's would end every other test."""
    hf_model, tokenizer, _ = load_model(EMBEDDED_MODEL)
    engine = InferenceEngine(hf_model, tokenizer)
    registry = ModelRegistry()
    registry.add(MODEL, engine)
    server = BackgroundServer(create_app(registry)).start()
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        received = 0

        async def read() -> None:
            nonlocal received
            async for chunk in stream:
                received += sum(bool(c.delta.content) for c in chunk.choices)
                if received == 3:
                    await asyncio.to_thread(engine.close)

        with pytest.raises(openai.APIError) as caught:
            await asyncio.wait_for(read(), timeout=120)
        assert received >= 3, "the error should come mid-stream, after tokens were sent"
        assert "clos" in caught.value.message.lower()
    finally:
        engine.close()
        server.stop()
