"""Constrained decoding (``response_format``, vLLM's ``guided_choice``) on the real embedded model, through the real
HTTP server, with the openai SDK and LiteLLM as clients."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import litellm
import openai
import pytest
from pydantic import BaseModel, Field

from flywheel.gateway.client import EpisodeClient
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend

MODEL = EMBEDDED_MODEL
MESSAGES = [{"role": "user", "content": "Describe a person called Ada as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


class Verdict(BaseModel):
    passed: bool
    confidence: float = Field(ge=0, le=1)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


async def test_json_schema_output_validates_for_every_choice(client, tokenizer):
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, seed=7, temperature=1.0, max_tokens=80,
        response_format=_schema_format(PERSON), logprobs=True, top_logprobs=3,
    )  # fmt: skip
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        # Logprobs are the constrained distribution's: once the object is closed, end-of-sequence is the only
        # token the grammar allows, so it has probability 1 (the unconstrained model never gives exactly that).
        assert choice.token_ids[-1] == tokenizer.eos_token_id
        assert choice.logprobs.content[-1].logprob == 0.0
        assert [t.logprob for t in choice.logprobs.content[-1].top_logprobs] == [0.0]
        assert all(
            t.logprob <= 0.0 and all(a.logprob > float("-inf") for a in t.top_logprobs) for t in choice.logprobs.content
        )


async def test_json_object_mode_and_streaming(client):
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60, response_format={"type": "json_object"}
    )
    content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # greedy on some CPUs (Intel AMX) a string runs on to max_tokens: cut inside the object, never outside it
        assert finish == "length" and content.lstrip().startswith("{"), content
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join([c.delta.content or "" async for chunk in stream for c in chunk.choices])
    assert text == r.choices[0].message.content


async def test_text_format_is_unconstrained(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    plain = await client.chat.completions.create(**kwargs)
    text = await client.chat.completions.create(**kwargs, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [({"type": "objekt"}, "objekt"), ({"type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}, "missing")],
)
async def test_a_schema_the_grammar_library_rejects_is_a_400_naming_it(client, schema, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format=_schema_format(schema)
        )
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "response_format"
    assert fragment in caught.value.body["message"]


async def test_malformed_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "yaml"})
    assert "response_format" in caught.value.body["message"]


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
async def test_litellm_passes_a_pydantic_response_format_through(backend: LocalBackend, provider):
    response = await litellm.acompletion(
        model=f"{provider}/{MODEL}",
        api_base=backend.base_url,
        api_key="unused",
        messages=[{"role": "user", "content": "Did the test pass? Answer as JSON."}],
        response_format=Verdict,
        temperature=0,
        max_tokens=40,
        max_retries=0,
    )
    verdict = Verdict.model_validate_json(response.choices[0].message.content)
    assert 0 <= verdict.confidence <= 1
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens > 0


SQUARES = ["A1", "B2", "C3", "the center square", ""]


QUESTIONS = [
    "Which tic-tac-toe square do you take first?",
    "Name a square of the board, then explain why at length.",
    "Write a poem about the sea.",  # a prompt the choices have nothing to do with
]


async def test_guided_choice_makes_the_reply_exactly_one_of_the_strings(client, tokenizer):
    def ask(question: str):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], n=2, temperature=1.0, seed=3,
            max_tokens=20, logprobs=True, extra_body={"guided_choice": SQUARES},
        )  # fmt: skip

    replies = await asyncio.gather(*map(ask, QUESTIONS))  # decoded together
    for choice in (choice for r in replies for choice in r.choices):
        assert choice.message.content in SQUARES and choice.finish_reason == "stop"
        ids = choice.token_ids  # the sampled ids, as recorded: the choice's text, then end-of-sequence
        assert ids[-1] == tokenizer.eos_token_id and tokenizer.decode(ids[:-1]) == choice.message.content
        assert len(choice.logprobs.content) == len(ids) and choice.logprobs.content[-1].logprob == 0.0


async def test_a_guided_choice_call_is_recorded_in_its_episode_with_its_ids(backend: LocalBackend, tokenizer):
    async with EpisodeClient(backend.base_url.removesuffix("/v1")) as episodes:
        episode = await episodes.create("guided-choice")
        agent = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
        stream = await agent.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Your move?"}], temperature=1.0, seed=5, max_tokens=20,
            stream=True, extra_body={"guided_choice": ["A1", "B2 then C3"]},
        )  # fmt: skip
        text = "".join([c.delta.content or "" async for chunk in stream for c in chunk.choices])
        calls = await episodes.calls(episode.id)
    assert text in ("A1", "B2 then C3")
    stored = calls[0]["response"]["choices"][0]
    assert calls[0]["request"]["guided_choice"] == ["A1", "B2 then C3"] and stored["message"]["content"] == text
    assert tokenizer.decode(stored["token_ids"][:-1]) == text
    assert len(stored["logprobs"]["content"]) == len(stored["token_ids"])


async def test_guided_choice_null_is_no_guide(client):  # what ART's self-play sends when it does not guide
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=4)
    plain = await client.chat.completions.create(**kwargs)
    null = await client.chat.completions.create(**kwargs, extra_body={"guided_choice": None})
    assert null.choices[0].message.content == plain.choices[0].message.content


CALC_TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"guided_choice": []}, "guided_choice must be a non-empty list of strings"),
        ({"guided_choice": "A1"}, "guided_choice must be a non-empty list of strings"),
        ({"guided_choice": ["A1", 2]}, "guided_choice[1] is 2: every choice must be a string"),
        ({"guided_choice": ["A1"], "tools": [CALC_TOOL]}, "cannot be combined with tools"),
        ({"guided_choice": ["A1"], "response_format": {"type": "json_object"}}, "cannot be combined with a JSON"),
    ],
)
async def test_bad_guided_choice_is_a_400_naming_it(client, extra, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "guided_choice" and fragment in caught.value.body["message"]


async def test_a_choice_no_text_can_hold_is_a_400_naming_it(backend: LocalBackend):
    # valid JSON (a lone surrogate escape) that is no UTF-8 text; the openai SDK cannot even send it, httpx can
    body = '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "guided_choice": ["A1", "\\ud800"]}'
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{backend.base_url}/chat/completions", content=body % MODEL)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice"
    assert "surrogates not allowed" in r.json()["error"]["message"]
