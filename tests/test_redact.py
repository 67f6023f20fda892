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
    "phone",
    [
        "(555) 123-4567",
        "555-123-4567",
        "555 123 4567",
        "555.123.4567",
        "1-800-555-0199",
        "1 (800) 555-0199",
        "+1 (555) 123-4567",
        "+1-555-123-4567",
        "+1 415 555 0132",
        "+14155550123",
        "+44 20 7946 0958",
        "+44 (0)20 7946 0958",
        "+33 1 23 45 67 89",
        "+49 30 12345678",
        "+81 3-1234-5678",
        "+91 98765 43210",
        "020 7946 0958",
        "(020) 7946 0958",
        "07700 900123",
        "01 23 45 67 89",
    ],
)
def test_phone_numbers_in_common_formats_are_replaced(phone):
    assert default_redactor(f"Call {phone}, please.") == ("Call [phone], please.", Counter({"phone": 1}))
    assert default_redactor(f'{{"phone": "{phone}"}}') == ('{"phone": "[phone]"}', Counter({"phone": 1}))


@pytest.mark.parametrize(
    "text",
    [
        # issue #37, item 17: these were phone numbers to the redactor (a call with them lost its token ids)
        "2024-11-27 10:30",
        "Opened 2024-11-27 10:30, closed 2024-11-28 09:15:42",
        "192.168.100.200",
        "2024-11-27T10:30:00Z",
        "2024-11-27T10:30:00.123+01:00",
        "27.11.2024 10:30",
        "01.12.2024 10:30",
        "11-27-2024 10:30:15",
        "20241127 103000",
        "2024 11 27 10 30",
        "10:30:00 10:45:00",
        "12:30-13:45",
        "UTC+05:30",
        "GMT +05:30",
        "between 2019-2024 and 2025-2030",
        "10.0.0.1:8080, 255.255.255.0, 2001:db8::1",
        "v1.22.333",
        "version 10.15.7 build 2024.11.27",
        "ORD-2024-1127-5531",
        "order #2024-1127-553100",
        "INV 2024 000 1234",
        "id 555-1234-5678",
        "user-555-123-4567",
        "/api/v1/555-123-4567",
        "ISBN 978-3-16-148410-0",
        "zip 94105-1234",
        "pages 123-456",
        "1 234 567 890 tokens",
        "12 345 678 901",
        "$1,234,567.89",
        "lat 48.8566, lon 2.3522",
        "3.14159 2.71828 1.41421",
        "uuid 123e4567-e89b-12d3-a456-426614174000",
        "epoch 1732703400",
    ],
)
def test_dates_times_addresses_versions_and_order_numbers_are_not_phone_numbers(text):
    assert default_redactor(text) == (text, Counter())


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
    # issue #37, item 17: a redacted call leaves RL training: the share of them is shown
    assert stats["calls"] == {"recorded": 2, "redacted": 1, "redacted_share": 0.5}


async def test_free_text_is_redacted_and_ids_with_personal_data_are_refused(gateway: str):
    """Issue #37, item 17: an abandon's reason, an agent's exception text (a failed attempt's reason) and a
    feedback's source reached the store as sent. Ids are not redacted (two ids redacted alike would be one: two
    tasks' groups merged, a second feedback taken for a repost of the first): one with personal data is a 400
    that names the field and what it found, never the value; a training task's id is stored as given, as its
    calls are."""
    async with EpisodeClient(gateway) as client, httpx.AsyncClient(base_url=gateway, timeout=60) as http:
        episode = await client.create("ticket-2", split="production")
        why = "the user's request failed: call +1 (555) 123-4567 about the 2024-11-27 10:30 order"
        abandoned = await client.abandon(episode.id, why)
        assert abandoned.meta["abandoned_because"] == "the user's request failed: call [phone] about the 2024-11-27 10:30 order"  # fmt: skip
        posted = await client.feedback(episode.id, "resolved", 1.0, source="agent jane@example.com", key="fb-1")
        assert posted["source"] == "agent [email]" and posted["key"] == "fb-1"

        def refused(r: httpx.Response, param: str, kind: str) -> bool:
            error = r.json()["error"]
            return r.status_code == 400 and error["param"] == param and f"personal data ({kind})" in error["message"]

        by_key = await http.post(
            f"/episodes/{episode.id}/feedback", json={"kind": "rating", "value": 1, "key": "jane@example.com"}
        )
        assert refused(by_key, "key", "email") and "jane" not in by_key.text
        by_task = await http.post("/episodes", json={"task_id": "call 555-123-4567", "split": "production"})
        assert refused(by_task, "task_id", "phone") and "4567" not in by_task.text
        assert (await client.create("call 555-123-4567", split="train")).task_id == "call 555-123-4567"
        queued = {"payload": {}, "group_size": 1, "max_tries": 1}
        task = await http.post("/tasks", json={"task_id": "bob@example.com", "split": "production", **queued})
        assert refused(task, "task_id", "email")
        assert (await http.post("/tasks", json={"task_id": "q-1", **queued})).status_code == 201
        lease = (await http.post("/tasks/claim", json={"runner": "r1"})).json()
        failure = {"episode_id": lease["episode_id"], "reason": "KeyError: 'bob@example.com' at 2024-11-27 10:30"}
        failed = (await http.post(f"/attempts/{lease['id']}/fail", json=failure)).json()
        assert failed["error"] == "KeyError: '[email]' at 2024-11-27 10:30"
        assert (await client.get(lease["episode_id"])).meta["abandoned_because"] == failed["error"]
        stats = (await http.get("/gateway/stats")).json()
    assert stats["redacted"] == {"phone": 1, "email": 2} and stats["calls"]["recorded"] == 0


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
