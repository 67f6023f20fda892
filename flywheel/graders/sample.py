"""The ``sample`` namespace: what graders see of a model's answer (its text, parsed JSON, tool calls, choices)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel


class Sample(BaseModel):
    """A model's answer as OpenAI's graders see it.

    ``output_json`` exists only when ``output_text`` is valid JSON; a template that reads it otherwise counts a
    ``sample_parse_error``. ``output_tools`` are the answer's tool calls in the chat completions shape
    (``{"id", "type": "function", "function": {"name", "arguments"}}``, arguments being a JSON string).
    """

    output_text: str = ""
    output_tools: list[dict[str, Any]] = []
    finish_reason: str = "stop"

    @classmethod
    def from_text(cls, text: str) -> Sample:
        return cls(output_text=text)

    @classmethod
    def from_message(cls, message: dict[str, Any], finish_reason: str = "stop") -> Sample:
        """The sample of an assistant message dict (``content`` and optional ``tool_calls``)."""
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep their text
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return cls(
            output_text=content or "", output_tools=list(message.get("tool_calls") or []), finish_reason=finish_reason
        )

    def output_json(self) -> tuple[bool, Any]:
        """(True, value) when the text parses as JSON, else (False, None)."""
        try:
            return True, json.loads(self.output_text)
        except ValueError:
            return False, None

    def namespace(self) -> dict[str, Any]:
        """The dict templates and python graders read: ``output_text``, ``output_json`` (when valid JSON),
        ``output_tools`` and ``choices`` (one chat completions choice holding the answer)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.output_text}
        if self.output_tools:
            message["tool_calls"] = self.output_tools
        namespace: dict[str, Any] = {
            "output_text": self.output_text,
            "output_tools": self.output_tools,
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}],
        }
        valid, value = self.output_json()
        if valid:
            namespace["output_json"] = value
        return namespace


class EpisodeSample(Sample):
    """An episode as a grader stack grades it (``stack.score``): its final answer (this sample's own fields, what
    every grader but the safety gate reads) and ``turns``, every assistant turn the model produced, in order, the
    final answer included (what the safety gate grades, one by one). ``scoring.sample_of`` makes one of a
    trajectory, ``regress.last_sample`` of an episode's stored calls."""

    turns: list[Sample] = []
