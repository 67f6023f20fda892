"""The default redactor (flywheel/gateway/redact.py): what it replaces, and what it must leave alone."""

from __future__ import annotations

from collections import Counter

import pytest

from flywheel.gateway.redact import default_redactor, redact_value


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
