"""Constrained (JSON-schema-guided) decoding with llguidance.

A request's schema is compiled once into a grammar and a template matcher (``compile_guide``); each sequence of
the request gets its own copy of the matcher. Before a token is drawn, the rows of guided sequences have every
token the grammar forbids set to -inf (``constrain``); the drawn token then advances the sequence's matcher. Once
the grammar is complete, only end-of-sequence is allowed, which forces the stop.

Because the mask is applied to the logits, the log-probabilities reported for a guided sequence are those of the
constrained distribution (forbidden tokens have probability 0, the rest renormalised). Rows without a guide are
left untouched and cost nothing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

# Compact JSON: a small model offered free whitespace between tokens can fill its whole budget with newlines.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_BITS = torch.arange(8, dtype=torch.uint8)

_tokenizers: dict[int, llguidance.LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


class GrammarError(ValueError):
    """The response format cannot be compiled into a grammar (an invalid or unsupported JSON schema)."""


@dataclass(frozen=True)
class Guide:
    """One request's compiled grammar; ``matcher()`` gives each of its sequences a fresh parser state."""

    template: llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


def _ll_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The llguidance view of a tokenizer, built once per tokenizer (it takes a fraction of a second)."""
    key = id(tokenizer)
    with _tokenizers_lock:
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(eos_ids) or None)
        return _tokenizers[key]


def compile_guide(
    tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int], schema: dict[str, Any] | None
) -> Guide:
    """Compile a JSON schema (None: any JSON object) for this tokenizer; GrammarError says what is wrong with it."""
    schema = _ANY_OBJECT if schema is None else schema
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc
    try:
        template = llguidance.LLMatcher(_ll_tokenizer(tokenizer, eos_ids), grammar, log_level=0)
    except ValueError as exc:
        raise GrammarError(f"unsupported JSON schema: {exc}") from exc
    if template.is_error():
        raise GrammarError(f"unsupported JSON schema: {template.get_error()}")
    return Guide(template)


def constrain(logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]) -> None:
    """Set the logits [B, V] of tokens each row's grammar forbids to -inf, in place; rows with None are left as
    they are, and with no matcher at all this returns at once."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    # one bit per token id, least significant bit first
    bitmask = torch.stack([torch.frombuffer(bytearray(matchers[i].compute_bitmask()), dtype=torch.uint8) for i in rows])
    allowed = ((bitmask[:, :, None] >> _BITS) & 1).bool().view(len(rows), -1)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:  # ids past the tokenizer's vocabulary (padded embeddings) are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))
