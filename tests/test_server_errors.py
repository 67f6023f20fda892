"""Bad requests get a 400 that names the field at fault, never a 500: raw httpx bodies against the real server
(the openai SDK would refuse to send some of them), and one through the SDK while another request decodes."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend

MODEL = EMBEDDED_MODEL
MESSAGES = [{"role": "user", "content": "Say hi."}]
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


def body(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}


@pytest.mark.parametrize(
    ("request_body", "param", "fragment"),
    [
        (body(top_p=0), "top_p", "greater than 0"),
        (body(top_p=-0.5), "top_p", "greater than 0"),
        (body(n=0), "n", "greater than or equal to 1"),
        (body(n=129), "n", "less than or equal to 128"),
        (body(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
        (body(top_logprobs=2), "top_logprobs", "'logprobs': true"),  # as OpenAI: top_logprobs needs logprobs
        (body(max_completion_tokens=0), "max_completion_tokens", "greater than or equal to 1"),
        (body(stop=5), "stop", "a string or a list of strings"),
        (body(stop=["ok", 7]), "stop", "a string or a list of strings"),
        (body(seed=2**70), "seed", "less than or equal to"),
        (
            body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
            "messages.0.content",
            "part 0 is a text part without a string 'text'",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}]),
            "messages.0.content",
            "part 1",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages.0.content",
            "only text parts",
        ),
        (
            body(messages=[*MESSAGES, {"role": "assistant", "tool_calls": [{"function": "calculator"}]}]),
            "messages.1.tool_calls.0.function",
            "valid dictionary",
        ),
        (
            body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "weather"}}),
            "tool_choice",
            "'weather' is not one of the tools: calculator",
        ),
        (body(tools=[TOOL], tool_choice="sometimes"), "tool_choice", "'none', 'auto', 'required'"),
        (body(tools=[TOOL], tool_choice={"type": "function"}), "tool_choice", "'none', 'auto', 'required'"),
        (body(tool_choice="required"), "tool_choice", "needs 'tools'"),
        (
            body(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
            "tools",
            "parameters must be a JSON schema object",
        ),
        # issue #37, item 19: sampling parameters the engine does not implement were accepted and ignored
        (body(frequency_penalty=0.5), "frequency_penalty", "not implemented by this server's engine (only null or 0"),
        (body(presence_penalty=-1.0), "presence_penalty", "not implemented"),
        (body(logit_bias={"1": 100}), "logit_bias", "only null or {}"),
        (body(top_k=40), "top_k", "only null or 0 or -1"),
        (body(min_p=0.05), "min_p", "not implemented"),
        (body(repetition_penalty=1.1), "repetition_penalty", "only null or 1"),
        (body(guided_json={"type": "object"}), "guided_json", "not implemented"),
    ],
)
async def test_bad_field_is_400_naming_it(backend: LocalBackend, request_body, param, fragment):
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{backend.base_url}/chat/completions", json=request_body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and param in error["message"]
    assert fragment in error["message"]


async def test_a_bad_request_never_fails_another_one_decoding(backend: LocalBackend):
    """A seed the sampler cannot take used to reach the engine and fail its whole step, ending every request that
    was decoding with it. It is a 400 now, and the request that was streaming finishes."""
    client = openai.AsyncOpenAI(base_url=backend.base_url, api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, stream=True, extra_body={"ignore_eos": True}
    )
    finish, bad = None, None
    async for chunk in stream:
        for c in chunk.choices:
            if c.delta.content and bad is None:  # decoding now: send the bad one alongside
                bad = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=2**64))
            finish = c.finish_reason or finish
    assert finish == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        await bad
    assert caught.value.body["param"] == "seed"


async def test_unimplemented_sampling_parameters_pass_only_at_neutral_values(backend: LocalBackend):
    """Issue #37, item 19: what asks for nothing (the values a client that does not use them may send) is answered;
    anything else is the openai SDK's BadRequestError naming the parameter, never a reply drawn otherwise than asked."""
    client = openai.AsyncOpenAI(base_url=backend.base_url, api_key="unused", max_retries=0)
    neutral = {"top_k": -1, "min_p": 0, "logit_bias": None, "repetition_penalty": 1.0}
    reply = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, frequency_penalty=0, presence_penalty=0.0, extra_body=neutral
    )
    assert reply.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, presence_penalty=0.6)
    assert refused.value.body["param"] == "presence_penalty" and "presence_penalty" in refused.value.message
