"""Prompt rendering and tool-call parsing (the documented default format)."""

from __future__ import annotations

import copy
import json

import pytest

from flywheel.inference.chat import parse_tool_calls, render_prompt, supports_tools, to_default_format

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def test_good_tool_call_is_parsed():
    content, calls = parse_tool_calls(
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    )
    assert content == "Let me compute."
    assert len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "calculator"
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "2+3"}


def test_several_calls_and_string_arguments_and_missing_closing_tag():
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"y": [1, 2]}}'
    )
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert json.loads(calls[1]["function"]["arguments"]) == {"y": [1, 2]}
    assert calls[0]["id"] != calls[1]["id"]


def test_malformed_tool_calls_come_back_as_plain_content():
    for text in [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {"x": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
        '<tool_call>["name", "a"]</tool_call>',
        '<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{"broken"</tool_call>',
    ]:
        content, calls = parse_tool_calls(text)
        assert calls == [] and content == text


def test_a_string_argument_may_contain_the_end_tag():
    """Read by the JSON decoder: a greedy decode on one CPU wrote the end tag inside its (grammar-valid) string."""
    text = '<tool_call>\n{"name": "calc", "arguments": {"expression": "17 * 23}}</tool_call> # 17 * "}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content is None and [c["function"]["name"] for c in calls] == ["calc"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "17 * 23}}</tool_call> # 17 * "}
    junk = '<tool_call>{"name": "calc", "arguments": {}} and then</tool_call>'  # text after the value: malformed
    assert parse_tool_calls(junk) == (junk, [])


def test_plain_text_is_untouched():
    assert parse_tool_calls("The answer is 5.") == ("The answer is 5.", [])


def test_default_format_renders_tools_calls_and_results(tokenizer):
    assert not supports_tools(tokenizer)  # SmolLM2's template has no tool support: the default format applies
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    rendered = to_default_format(messages, [TOOL])
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("Be exact.")
    assert '"name": "calculator"' in rendered[0]["content"] and "<tools>" in rendered[0]["content"]
    assert rendered[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>',
    }
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    # what we render for an assistant call parses back to the same call
    _, calls = parse_tool_calls(rendered[2]["content"])
    assert calls[0]["function"]["name"] == "calculator"
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "2+3"}

    text = tokenizer.decode(render_prompt(tokenizer, messages, [TOOL]))
    assert text.endswith("<|im_start|>assistant\n")
    assert "<tool_response>\n5\n</tool_response>" in text and "<tools>" in text


def test_tools_without_system_prompt_get_their_own_system_turn(tokenizer):
    rendered = to_default_format([{"role": "user", "content": "hi"}], [TOOL])
    assert rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"]
    assert rendered[1] == {"role": "user", "content": "hi"}


def test_content_parts_are_joined_and_non_text_parts_rejected(tokenizer):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert to_default_format([{"role": "user", "content": parts}], None)[0]["content"] == "Hello there"
    try:
        to_default_format([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None)
    except ValueError as exc:
        assert "image_url" in str(exc)
    else:
        raise AssertionError("an image part must be refused with a clear error")


def test_a_model_without_a_chat_template_is_a_clear_error_naming_it(tokenizer):
    """A real tokenizer (the embedded model's, copied) without its template, as a GGUF without one loads."""
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"^the model at .* has no chat template \(its files carry none\)"):
        render_prompt(bare, [{"role": "user", "content": "Hi"}])
    assert render_prompt(tokenizer, [{"role": "user", "content": "Hi"}])  # the original keeps its template
