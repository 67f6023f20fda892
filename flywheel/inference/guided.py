"""Constrained (JSON-schema-guided) decoding with llguidance.

A request's schema is compiled once into a grammar and a template matcher (``compile_guide``); each sequence of
the request gets its own copy of the matcher. Before a token is drawn, the rows of guided sequences have every
token the grammar forbids set to -inf (``constrain``); the drawn token then advances the sequence's matcher. Once
the grammar is complete, only end-of-sequence is allowed, which forces the stop.

A forced tool call (``tool_choice`` "required" or a named function) is guided the same way by a grammar of one
call in chat.py's default format (``compile_tool_call_guide``): ``<tool_call>``, ``{"name": ..., "arguments": ...}``
with the name one of the offered tools' and the arguments following that tool's ``parameters`` schema, then
``</tool_call>``.

vLLM's ``guided_choice`` (a list of strings) is a grammar of their alternatives (``compile_choice_guide``): the reply
is exactly one of them, then end-of-sequence.

Because the mask is applied to the logits, the log-probabilities reported for a guided sequence are those of the
constrained distribution (forbidden tokens have probability 0, the rest renormalised). Rows without a guide are
left untouched and cost nothing.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

from flywheel.inference.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

log = logging.getLogger(__name__)
# Compact JSON: a small model offered free whitespace between tokens can fill its whole budget with newlines.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_BITS = torch.arange(8, dtype=torch.uint8)

_tokenizers: dict[int, llguidance.LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


class GrammarError(ValueError):
    """The response format cannot be compiled into a grammar (an invalid or unsupported JSON schema)."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param  # the request field at fault


@dataclass(frozen=True)
class Guide:
    """One request's compiled grammar; ``matcher()`` gives each of its sequences a fresh parser state. ``grammar``
    is its llguidance source, which an engine that samples elsewhere sends instead (vLLM's guidance backend)."""

    template: llguidance.LLMatcher
    grammar: str

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


def _ll_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The llguidance view of a tokenizer, built once per tokenizer (it takes a fraction of a second)."""
    key = id(tokenizer)
    with _tokenizers_lock:
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(eos_ids) or None)
        return _tokenizers[key]


def compile_guide(tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int], schema: dict[str, Any] | None) -> Guide:
    """Compile a JSON schema (None: any JSON object) for this tokenizer; GrammarError says what is wrong with it."""
    schema = _ANY_OBJECT if schema is None else schema
    try:  # a Lark grammar of one JSON value, the options in the schema (x-guidance), as vLLM's "grammar" takes it
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
        body = json.dumps(schema, ensure_ascii=False)
        grammar = llguidance.LLMatcher.grammar_from_lark(f"start: %json {body}")
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc
    try:
        template = llguidance.LLMatcher(_ll_tokenizer(tokenizer, eos_ids), grammar, log_level=0)
    except ValueError as exc:
        raise GrammarError(f"unsupported JSON schema: {exc}") from exc
    if template.is_error():
        raise GrammarError(f"unsupported JSON schema: {template.get_error()}")
    return Guide(template, grammar)


def _arguments_schema(parameters: Any, llt: llguidance.LLTokenizer, name: str) -> dict[str, Any]:
    """A tool's ``parameters`` as the schema its call's arguments are guided by: any JSON object where there is
    none, or where llguidance cannot compile it (the call still parses; the tool checks its arguments)."""
    if not isinstance(parameters, dict) or not parameters:
        return {**_ANY_OBJECT, "x-guidance": _JSON_OPTIONS}
    schema = {"type": "object", **parameters, "x-guidance": _JSON_OPTIONS}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    failed, problems = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, llt)
    if failed:
        log.warning("tool %r: its parameters cannot guide a call (%s); arguments: any JSON object", name, problems[0])
        return {**_ANY_OBJECT, "x-guidance": _JSON_OPTIONS}
    return schema


def tool_call_grammar(tools: Sequence[dict[str, Any]], llt: llguidance.LLTokenizer) -> str:
    """A Lark grammar (llguidance's dialect, which vLLM's guidance backend takes) for exactly one call of one of
    ``tools`` (OpenAI tool dicts) in the default format: the opening tag, ``{"name": "NAME", "arguments": ARGS}``
    and the closing tag, ARGS after NAME's parameters. Each tool's arguments are a ``%json`` grammar of their own,
    so a schema's ``$ref``s resolve against its own root."""
    rules = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
        rules.append(f'call_{i}: {json.dumps(head, ensure_ascii=False)} args_{i} "}}"')
        schema = _arguments_schema(fn.get("parameters"), llt, fn["name"])
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
    start = f"start: {json.dumps(TOOL_CALL_OPEN)} ({alternatives}) {json.dumps(TOOL_CALL_CLOSE)}"
    return "\n".join([start, *rules])


def compile_tool_call_guide(
    tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int], tools: Sequence[dict[str, Any]]
) -> Guide:
    """A guide that makes the reply one call of one of ``tools`` (``tool_call_grammar``), then end-of-sequence."""
    llt = _ll_tokenizer(tokenizer, eos_ids)
    grammar = tool_call_grammar(tools, llt)
    template = llguidance.LLMatcher(llt, grammar, log_level=0)
    if template.is_error():
        raise GrammarError(f"cannot guide a call of these tools: {template.get_error()}", param="tools")
    return Guide(template, grammar)


def compile_lark_guide(
    tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int], lark: str, what: str = "grammar", param: str = "grammar"
) -> Guide:
    """A guide of a Lark grammar in llguidance's dialect (what ``Guide.grammar`` holds, and vLLM's structured output
    ``grammar`` takes); GrammarError, saying it cannot guide ``what``, where it does not compile."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        template = llguidance.LLMatcher(_ll_tokenizer(tokenizer, eos_ids), grammar, log_level=0)
    except (ValueError, TypeError) as exc:  # e.g. a lone surrogate, which no UTF-8 text holds
        raise GrammarError(f"cannot guide {what}: {exc}", param=param) from exc
    if template.is_error():
        raise GrammarError(f"cannot guide {what}: {template.get_error()}", param=param)
    return Guide(template, grammar)


def compile_choice_guide(tokenizer: PreTrainedTokenizerBase, eos_ids: Sequence[int], choices: Sequence[str]) -> Guide:
    """A guide that makes the reply exactly one of ``choices`` (any tokenization of it), then end-of-sequence."""
    start = "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    return compile_lark_guide(tokenizer, eos_ids, start, "a reply to these choices", "guided_choice")


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
