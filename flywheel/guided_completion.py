"""ART's ``art.guided_completion``: a teacher's completion as the parameters that make a student reply the same.

For distillation by RL (ART's self-play example): the teacher's text becomes vLLM's ``guided_choice`` with that one
choice, so the student's reply is exactly that text; its tool call becomes a forced call of that tool
(``tool_choice``) whose ``parameters`` allow only the teacher's arguments. Flywheel's server honours both: the
choice as ``extra_body={"guided_choice": ...}``, the call as ``tool_choice`` with the frozen ``tools``. Either way
the student's reply is sampled token by token from its own (constrained) distribution, so it is trainable.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable

from openai.types.chat import ChatCompletion, ChatCompletionToolChoiceOptionParam, ChatCompletionToolParam


def freeze_tool_schema(tool: ChatCompletionToolParam, fixed_args: dict[str, object]) -> ChatCompletionToolParam:
    """A copy of ``tool`` (an OpenAI tool dict) whose ``parameters`` allow only ``fixed_args``: each one a ``const``
    of its value (any JSON value), all of them required, no other."""
    frozen = copy.deepcopy(tool)
    frozen["function"]["parameters"] = {
        "type": "object",
        "properties": {name: {"const": value} for name, value in fixed_args.items()},
        "required": list(fixed_args),
        "additionalProperties": False,
    }
    return frozen


def get_guided_completion_params(
    completion: ChatCompletion, base_tools: Iterable[ChatCompletionToolParam] | None = None
) -> tuple[list[str] | None, ChatCompletionToolChoiceOptionParam | None, list[ChatCompletionToolParam] | None]:
    """``(guided_choice, tool_choice, tool_params)`` that make a student's reply the teacher's ``completion``
    (its first choice): for a tool call (its first), ``(None, that tool forced, [that tool frozen to its
    arguments])``, the tool taken from ``base_tools``; for text, ``([the text], None, None)``."""
    message = completion.choices[0].message
    if message.tool_calls:
        call = message.tool_calls[0]
        if call.type != "function":
            raise ValueError(f"the teacher's tool call is of type {call.type!r}: only function calls can guide")
        if base_tools is None:
            raise ValueError(f"the teacher called {call.function.name!r}: pass the tools it was offered (base_tools)")
        name = call.function.name
        tool = next((t for t in base_tools if t["function"]["name"] == name), None)
        if tool is None:
            raise ValueError(f"the teacher called {name!r}, which is not one of base_tools")
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError as exc:
            raise ValueError(f"the teacher's call of {name!r} has arguments that are not JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"the teacher's call of {name!r} has arguments that are not a JSON object: {arguments!r}")
        return None, {"type": "function", "function": {"name": name}}, [freeze_tool_schema(tool, arguments)]
    if message.content is None:
        raise ValueError("the teacher's completion has neither text nor a tool call")
    return [message.content], None, None
