"""Redaction before storage (flywheel/gateway/redact.py): what the default redactor replaces and what it must leave
alone; and the gateway storing calls, metadata and feedback redacted, over a real loopback server."""

from __future__ import annotations

from collections import Counter

import httpx
import openai
import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.gateway.client import EpisodeClient, GatewayError
from flywheel.gateway.recorder import Gateway
from flywheel.gateway.redact import default_redactor, redact_value
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store


@pytest.mark.parametrize(
    ("text", "expected", "kinds"),
    [
        ("Mail me at jane.doe+shop@example.co.uk now", "Mail me at [email] now", {"email": 1}),
        ("Card 4111 1111 1111 1111, exp 12/27", "Card [card], exp 12/27", {"card": 1}),
        ("card:4242-4242-4242-4242.", "card:[card].", {"card": 1}),
        ("call (415) 555-0132 or +44 20 7946 0958", "call [phone] or [phone]", {"phone": 2}),
        ("my number is 555.123.4567", "my number is [phone]", {"phone": 1}),
        ("a@b.io, c@d.org", "[email], [email]", {"email": 2}),
    ],
)
def test_personal_data_is_replaced_and_counted(text, expected, kinds):
    assert default_redactor(text) == (expected, Counter(kinds))


@pytest.mark.parametrize(
    "text",
    [
        "What is 12 + 7? The answer is 19.",
        "12345 * 6789 = 83810205",
        "Order ORD-1234567890123 shipped on 2026-11-26 at 10:45",
        "Refund of $1,234.56 for order 4111111111111112",  # 16 digits but not Luhn-valid: an order number
        "Served from 127.0.0.1:8000, Python 3.11.7",
        "Ticket #48213, customer 000123",
        '{"a": 1, "b": [2, 3]}',
    ],
)
def test_ordinary_text_is_left_alone(text):
    assert default_redactor(text) == (text, Counter())


def test_every_string_in_a_json_value_is_redacted():
    request = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "I am bob@example.com"}]},
            {"role": "assistant", "tool_calls": [{"function": {"arguments": '{"phone": "+1 415 555 0132"}'}}]},
        ],
        "temperature": 0.7,
        "email@example.com": "keys stay",
    }
    redacted, counts = redact_value(request, default_redactor)
    assert redacted["messages"][0]["content"][0]["text"] == "I am [email]"
    assert redacted["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"phone": "[phone]"}'
    assert redacted["temperature"] == 0.7 and redacted["email@example.com"] == "keys stay"
    assert counts == Counter({"email": 1, "phone": 1})
    assert request["messages"][0]["content"][0]["text"] == "I am bob@example.com"  # the input is not changed


@pytest.fixture
def gateway(engine, tmp_path):
    registry = ModelRegistry()
    registry.add(EMBEDDED_MODEL, engine)
    store = Store(f"sqlite:///{tmp_path / 'f.db'}")
    server = BackgroundServer(create_app(registry, Gateway(store))).start()
    yield server.base_url.removesuffix("/v1")
    server.stop()
    store.close()


async def test_what_the_gateway_stores_is_redacted_and_what_it_answers_is_not(gateway: str):
    """A call with personal data is stored redacted and without the token ids that would spell it out (text-only:
    refused for RL, saying why); one without keeps its exact ids; metadata and feedback notes are redacted too."""
    async with EpisodeClient(gateway) as client:
        episode = await client.create("ticket-1", split="production", metadata={"customer": "ann@example.com"})
        assert episode.meta == {"customer": "[email]"}
        openai_client = openai.AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0)
        asked = "My card 4111 1111 1111 1111 was charged twice. Reply to ann@example.com."
        answer = await openai_client.chat.completions.create(
            model=EMBEDDED_MODEL, messages=[{"role": "user", "content": asked}], max_tokens=4, temperature=0
        )
        plain = await openai_client.chat.completions.create(
            model=EMBEDDED_MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
        )
        assert answer.choices[0].message.content and plain.choices[0].message.content
        first, second = await client.calls(episode.id)
        assert first["request"]["messages"][0]["content"] == "My card [card] was charged twice. Reply to [email]."
        assert first["text_only"] and "token_ids" not in first["response"]["choices"][0]
        assert "prompt_token_ids" not in first["response"]["choices"][0]
        assert not second["text_only"] and second["response"]["choices"][0]["token_ids"]
        await client.finish(episode.id, 1.0)
        with pytest.raises(GatewayError, match="personal data was redacted") as refused:
            await client.trajectory(episode.id)
        assert refused.value.status == 409
        assert (await client.trajectory(episode.id, text_only="allow")).reward == 1.0
        posted = await client.feedback(episode.id, "rating", 1.0, note="call me on +44 20 7946 0958")
        assert posted["note"] == "call me on [phone]"
    async with httpx.AsyncClient(base_url=gateway) as http:
        stats = (await http.get("/gateway/stats")).json()
    assert stats["redacted"] == {"email": 2, "card": 1, "phone": 1}


async def test_training_episodes_are_stored_as_sampled(gateway: str):
    """A training episode's calls keep their exact token ids even when their text looks like personal data (a
    calculator's '555 123 4567', an e-mail in a synthetic task): redacting them would make every such episode
    text-only and refuse its group for RL. The same call in a production episode is redacted."""
    asked = "Compute 555 123 4567 + 1 and mail it to bob@example.com."
    async with EpisodeClient(gateway) as client:
        ids = {}
        for split in ("train", "production"):
            episode = await client.create(f"task-{split}", split=split, metadata={"to": "bob@example.com"})
            openai_client = openai.AsyncOpenAI(base_url=episode.base_url, api_key="-", max_retries=0)
            await openai_client.chat.completions.create(
                model=EMBEDDED_MODEL, messages=[{"role": "user", "content": asked}], max_tokens=4, temperature=0
            )
            (call,) = await client.calls(episode.id)
            await client.finish(episode.id, 1.0)
            ids[split] = (episode, call)
        train, train_call = ids["train"]
        assert train.meta == {"to": "bob@example.com"}
        assert train_call["request"]["messages"][0]["content"] == asked and not train_call["text_only"]
        assert (await client.trajectory(train.id)).reward == 1.0  # usable for RL
        production, production_call = ids["production"]
        assert production.meta == {"to": "[email]"} and production_call["text_only"]
        assert production_call["request"]["messages"][0]["content"] == "Compute [phone] + 1 and mail it to [email]."


def test_flywheel_serve_refuses_an_unknown_redaction_scope():
    run = CliRunner().invoke(app, ["serve", "--redact", "some"])
    assert run.exit_code == 2 and "production" in run.output and "Traceback" not in run.output
