"""ART's ``art.utils.litellm``: a LiteLLM answer's choice as the openai SDK's ``Choice``, which a Trajectory holds.

Scripts that sample with ``litellm.acompletion`` (ART's email agent ART-E) append
``convert_litellm_choice_to_openai(response.choices[0])`` to ``trajectory.messages_and_choices``. LiteLLM is not
imported here: its ``Choices`` is read through ``model_dump()``.
"""

from __future__ import annotations

from typing import Any

from openai.types.chat.chat_completion import Choice

MESSAGE_FIELDS = ("role", "content", "tool_calls")  # what a sampled assistant turn is; LiteLLM adds its own fields


def convert_litellm_choice_to_openai(litellm_choice: Any) -> Choice:
    """``litellm_choice`` (a ``litellm.types.utils.Choices``, or its dict) as an openai ``Choice``: the assistant
    message's content and tool calls, the finish reason, the index, and the log-probabilities when there are."""
    data = litellm_choice.model_dump() if hasattr(litellm_choice, "model_dump") else dict(litellm_choice)
    message = data.get("message") or {}
    if message.get("role") != "assistant":
        raise ValueError(f"convert_litellm_choice_to_openai: a sampled choice is an assistant turn, not {message!r}")
    return Choice.model_validate(
        {
            "index": data.get("index", 0),
            "finish_reason": data.get("finish_reason") or "stop",
            "message": {key: message.get(key) for key in MESSAGE_FIELDS},
            "logprobs": data.get("logprobs"),
        }
    )
