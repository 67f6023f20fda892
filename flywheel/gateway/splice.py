"""Token-in, token-out: a prompt that reuses the exact ids an episode's earlier calls were fed and sampled.

An agent re-sends its whole history with every call, as text. Re-tokenizing that text does not give back the ids
the model sampled: a tokenizer has many ways to spell one string and the model need not have drawn the canonical
one, a client may re-serialise a tool call's JSON with other spacing or key order, a template may drop earlier
reasoning. Training on the re-tokenized history would train on tokens nobody sampled (verl #6719, Agent
Lightning #326, prime-rl #1352).

So the gateway keeps each output it returned in an episode (the ids fed, the ids drawn, the message the client
saw) and, for a new request, looks for the latest assistant message that is one of them, said the same way up to
re-serialisation (same text, same tool calls with the same parsed arguments) after the same conversation, drawn
with the same tokenizer as the request's model (``tokenizer_key``: another model's ids are not this one's). The
prompt is then that output's exact ids, then the template's rendering of what follows it, cut at the output's own
end-of-turn token. Where outputs say the same: a later call's wins (the agent's latest attempt); among the choices
of one call (n > 1), the first (their messages alike, the history cannot tell them apart). A request whose history matches no output (edited, or after an output that stopped without
its end-of-turn token) is rendered from text, and each assistant turn in it that was re-tokenized is counted. In
training (``flywheel.train.batch``) a call whose prompt extends the previous one token for token continues its
sequence; one that does not starts its own: no token trains unless it was sampled.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from flywheel.inference.chat import content_text, render_prompt, render_text


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def message_key(message: dict) -> str:
    """What a message says, up to how a client serialises it: role, text (stripped), tool calls (name and parsed
    arguments, not their ids), and for a tool result its text."""
    calls = [
        [c.get("function", c).get("name"), _arguments(c.get("function", c).get("arguments"))]
        for c in message.get("tool_calls") or []
    ]
    body = {"role": message.get("role"), "content": content_text(message.get("content")).strip(), "calls": calls}
    return json.dumps(body, sort_keys=True, ensure_ascii=False)


def tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


_tokenizer_keys: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, str] = weakref.WeakKeyDictionary()


def tokenizer_key(tokenizer: PreTrainedTokenizerBase) -> str:
    """Which tokenizer drew a choice's ids: a hash of its vocabulary and special tokens (the same for every process
    and host that loads it, whatever its path), computed once per tokenizer object."""
    key = _tokenizer_keys.get(tokenizer)
    if key is None:
        vocab = sorted(tokenizer.get_vocab().items())
        body = json.dumps([vocab, tokenizer.all_special_tokens], ensure_ascii=False).encode()
        key = _tokenizer_keys[tokenizer] = hashlib.sha256(body).hexdigest()[:16]
    return key


@dataclass(frozen=True)
class Output:
    """One choice an episode's call returned: the conversation it answered, what it said, its exact ids."""

    call_id: int
    choice: int
    key: tuple[str, ...]  # tools_key, then message_key of each request message, then of the reply
    ids: list[int]  # the prompt it was fed, then the completion it drew
    ended: bool  # the completion ends with an end-of-turn token (it can be continued exactly)
    tokenizer: str | None = None  # tokenizer_key of the tokenizer that drew it (None: not recorded, never spliced)


@dataclass(frozen=True)
class Splice:
    """The prompt for a request, and where its exact ids came from."""

    prompt: list[int]
    prefix_call: int | None = None  # the call whose output the prompt continues
    prefix_choice: int | None = None
    prefix_message: int | None = None  # the index of that output among the request's messages
    retokenized_turns: int = 0  # assistant turns of the request rendered from text


def output_key(messages: list[dict], tools: list[dict] | None, reply: dict) -> tuple[str, ...]:
    return (tools_key(tools), *(message_key(m) for m in messages), message_key(reply))


def splice_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None, outputs: list[Output]
) -> Splice:
    """The prompt for ``messages``, continuing the latest of ``outputs`` found in them (see the module doc)."""
    by_key: dict[tuple[str, ...], Output] = {}
    this = tokenizer_key(tokenizer)
    for o in outputs:  # later calls' outputs win (the agent's latest attempt); among one call's choices, the first
        if o.ended and o.tokenizer == this and not ((was := by_key.get(o.key)) and was.call_id == o.call_id):
            by_key[o.key] = o
    keys = (tools_key(tools), *(message_key(m) for m in messages))
    assistant = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    for k in reversed(assistant):
        output = by_key.get(keys[: k + 2])
        if output is None:
            continue
        tail = _tail_after(tokenizer, messages, tools, k, output.ids[-1])
        if tail is None:
            continue  # the template renders this history differently (e.g. drops earlier reasoning)
        prompt = output.ids + tokenizer.encode(tail, add_special_tokens=False)
        later = sum(1 for i in assistant if i > k)
        return Splice(prompt, output.call_id, output.choice, k, later)
    return Splice(render_prompt(tokenizer, messages, tools), retokenized_turns=len(assistant))


def _tail_after(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None, k: int, end_id: int
) -> str | None:
    """The rendered prompt's text after message ``k``'s end-of-turn token, if the rendering of ``messages[: k + 1]``
    up to that token is where the full prompt starts (it is not when a template rewrites earlier turns)."""
    full = render_text(tokenizer, messages, tools)
    head = render_text(tokenizer, messages[: k + 1], tools, add_generation_prompt=False)
    end = tokenizer.decode([end_id], skip_special_tokens=False)
    cut = head.rfind(end)
    if not end or cut < 0:
        return None
    cut += len(end)
    return full[cut:] if full.startswith(head[:cut]) else None
