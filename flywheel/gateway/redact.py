"""Redaction before storage: personal data in what the gateway records is replaced by a placeholder before it
reaches the store.

A ``Redactor`` maps a text to the redacted text and what it replaced, counted by kind. The default one finds e-mail
addresses, payment card numbers (13-19 digits, spaces or dashes allowed, Luhn-valid: an order number rarely is) and
phone numbers (9-15 digits in separated groups, or after a ``+``), and replaces them with ``[email]``, ``[card]``,
``[phone]``. Any callable of the same shape replaces it (a named-entity model, a customer's own rules).
``redact_value`` applies one to every string inside a JSON value (messages, tool arguments, metadata, feedback).

What token ids mean cannot be redacted by pattern: a caller that redacts a call's text must drop that call's token
ids too (the store would otherwise keep the personal data, one detokenization away).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

Redactor = Callable[[str], tuple[str, Counter[str]]]

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
_CARD = re.compile(r"(?<![\w-])\d(?:[ -]?\d){12,18}(?![\w-])")
_PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]\d{2,4}){1,4}(?![\w-])")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _is_phone(match: str) -> bool:
    digits = sum(ch.isdigit() for ch in match)
    separated = match.startswith("+") or "(" in match or len(re.findall(r"[ .-]", match)) >= 2
    return 9 <= digits <= 15 and separated


def default_redactor(text: str) -> tuple[str, Counter[str]]:
    """E-mail addresses, card numbers and phone numbers -> ``[email]``, ``[card]``, ``[phone]``."""
    counts: Counter[str] = Counter()

    def replace(kind: str, keep: Callable[[str], bool] = lambda _: True) -> Callable[[re.Match[str]], str]:
        def sub(match: re.Match[str]) -> str:
            if not keep(match.group()):
                return match.group()
            counts[kind] += 1
            return f"[{kind}]"

        return sub

    text = _EMAIL.sub(replace("email"), text)
    text = _CARD.sub(replace("card", lambda m: 13 <= len(d := re.sub(r"\D", "", m)) <= 19 and _luhn(d)), text)
    text = _PHONE.sub(replace("phone", _is_phone), text)
    return text, counts


def redact_value(value: Any, redactor: Redactor) -> tuple[Any, Counter[str]]:
    """Every string in a JSON value (dict keys stay as they are) through ``redactor``; what it replaced, by kind."""
    counts: Counter[str] = Counter()

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            out, found = redactor(v)
            counts.update(found)
            return out
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [walk(x) for x in v]
        return v

    return walk(value), counts
