"""Redaction before storage: personal data in what the gateway records is replaced by a placeholder before it
reaches the store.

A ``Redactor`` maps a text to the redacted text and what it replaced, counted by kind. The default one finds e-mail
addresses, payment card numbers (13-19 digits, spaces or dashes allowed, Luhn-valid: an order number rarely is) and
phone numbers, and replaces them with ``[email]``, ``[card]``, ``[phone]``. A phone number is written in one of
the shapes people write them in: international (``+`` and a country code, then groups: ``+44 20 7946 0958``,
``+1 (555) 123-4567``, ``+14155550123``; 8 to 15 digits), North American (``(555) 123-4567``, ``555.123.4567``,
``1-800-555-0199``: 3, 3 and 4 digits) or national with a trunk 0 (``020 7946 0958``, ``01 23 45 67 89``; 9 to 12
digits). Dates, times, timestamps, IP addresses, version strings, amounts and order numbers are none of these (a
date's groups are 4-2-2 or 2-2-4; an address's 1-3 digits each and dotted; a number inside a word or a dashed id
is left alone), and neither is a bare run of digits: a phone number written without any separator or ``+`` is
not found (it looks like any id). Any callable of the same shape replaces it (a named-entity model, a customer's
own rules).
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
_PHONE = re.compile(
    r"""
    (?<![\w+\-/])(?<!\d[.:,])  # not inside a word, a dashed id, a path, a dotted or timed number
    (?:
        (?P<international>\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}+){1,6})
      | (?P<american>(?:1[ .-]?)?(?:\(\d{3}\)[ .-]?|\d{3}(?P<sep>[ .-]))\d{3}(?(sep)(?P=sep)|[ .-])\d{4})
      | (?P<national>\(?0\d{1,4}\)?(?:[ .-]\d{2,8}){1,4})
    )
    (?![\w\-/])(?![.:,]\d)  # nor followed by more of one
    """,
    re.VERBOSE,
)
_DIGITS = {"international": (8, 15), "american": (10, 11), "national": (9, 12)}


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _is_phone(match: re.Match[str]) -> bool:
    low, high = _DIGITS[match.lastgroup or ""]
    return low <= sum(ch.isdigit() for ch in match.group()) <= high


def default_redactor(text: str) -> tuple[str, Counter[str]]:
    """E-mail addresses, card numbers and phone numbers -> ``[email]``, ``[card]``, ``[phone]``."""
    counts: Counter[str] = Counter()

    def replace(kind: str, keep: Callable[[re.Match[str]], bool] = lambda _: True) -> Callable[[re.Match[str]], str]:
        def sub(match: re.Match[str]) -> str:
            if not keep(match):
                return match.group()
            counts[kind] += 1
            return f"[{kind}]"

        return sub

    text = _EMAIL.sub(replace("email"), text)
    text = _CARD.sub(replace("card", lambda m: 13 <= len(d := re.sub(r"\D", "", m.group())) <= 19 and _luhn(d)), text)
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
