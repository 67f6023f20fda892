"""A reusable tool-calling agent loop over the OpenAI chat API that returns a trainable ``Trajectory``.

Each turn asks the model for a completion with the tools offered; every tool call it makes is executed (parallel
calls concurrently) and answered with a ``tool`` message; the loop ends on a turn without tool calls (the final
answer) or after ``max_turns`` turns. The sampled ``Choice`` objects are kept as they are, so training uses the
exact token ids the engine sampled. A call of a tool declared ``high_impact`` runs only once the ``approve``r
allowed it (a person in production, a policy in training and evaluation: ``flywheel.approvals``); a call it did not
allow is answered with the decision (who denied it and why) and runs nothing. Whatever goes wrong with a tool call (an unknown tool, arguments that do not
fit the schema, an exception, a timeout) becomes an ``Error: ...`` tool message the model can read and recover
from, is counted in the trajectory's metrics, and is recorded per call in the Choice's ``tool_statuses``.
The reward is the caller's to set.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from openai import AsyncOpenAI
from openai.types.chat.chat_completion import Choice
from pydantic_core import to_json

from flywheel.agents.air import AIRConfig, apply_air
from flywheel.agents.cache import ToolCache, tool_call_key
from flywheel.agents.tools import TOOL_STATUSES, ArgumentsError, Tool, ToolError, ToolStatus, as_tools
from flywheel.approvals.policy import Approver, ToolCallRequest
from flywheel.model import Model
from flywheel.types import Message, Trajectory

_STATUS_METRICS: dict[ToolStatus, str] = {
    "error": "tool_errors",
    "timeout": "tool_timeouts",
    "unknown_tool": "unknown_tool",
    "bad_arguments": "bad_arguments",
    "denied": "denied_calls",
}


class _Episode:
    """The tools, the cache and the counters of one run."""

    def __init__(
        self, tools: dict[str, Tool], timeout: float | None, cache: ToolCache | None, approve: Approver | None
    ) -> None:
        self.tools, self.timeout, self.cache, self.approve = tools, timeout, cache, approve
        self.seen: set[str] = set()
        self.metrics: dict[str, int | bool] = {
            "turns": 0,
            "tool_calls": 0,
            "tool_errors": 0,
            "tool_timeouts": 0,
            "unknown_tool": 0,
            "bad_arguments": 0,
            "denied_calls": 0,
            "approved_calls": 0,
            "repeated_calls": 0,
            "cache_hits": 0,
            "cache_misses": 0,
            "truncated_turns": 0,
            "max_turns_reached": False,
        }

    async def execute(self, call: Any) -> tuple[str, ToolStatus]:
        """(content of the tool message, status) of one call."""
        if call.type != "function":  # a custom (free-text) tool call
            return "Error: only function tools are available.", "unknown_tool"
        name = call.function.name
        tool = self.tools.get(name)
        if tool is None:
            available = ", ".join(self.tools) or "none"
            return f"Error: unknown tool {name!r}. Available tools: {available}.", "unknown_tool"
        try:
            arguments = tool.parse_arguments(call.function.arguments or "")
        except ArgumentsError as exc:
            return f"Error: invalid arguments for {name}: {exc}", "bad_arguments"
        if tool.high_impact:
            assert self.approve is not None  # run_agent requires one for high-impact tools
            request = ToolCallRequest(tool=name, arguments=call.function.arguments or "", call_id=call.id)
            decision = await self.approve(request)
            if not decision.allowed:
                return f"Error: {decision.notice()}", "denied"
            self.metrics["approved_calls"] += 1

        async def run() -> str:
            # a sync tool past its timeout cannot be stopped: its thread finishes and the result is dropped
            return await asyncio.wait_for(tool.run(arguments), self.timeout)

        try:
            if self.cache is not None and tool.cacheable:
                # keyed on the validated arguments, so that "3" and 3 for an int are one call
                result, hit = await self.cache.fetch(name, json.loads(to_json(arguments)), run)
                self.metrics["cache_hits" if hit else "cache_misses"] += 1
            else:
                result = await run()
        except TimeoutError:  # past tool_timeout, or the tool's own (a timeout it raised, with no tool_timeout too)
            within = "" if self.timeout is None else f" within {self.timeout:g} s"
            return f"Error: {name} did not answer{within}.", "timeout"
        except ToolError as exc:
            return f"Error: {exc}", "error"
        except Exception as exc:
            return f"Error: {name} failed: {type(exc).__name__}: {exc}", "error"
        return result, "ok"

    async def answer(self, choice: Choice) -> list[Message]:
        """Run the turn's tool calls concurrently; their tool messages, in call order."""
        calls = choice.message.tool_calls or []
        results = await asyncio.gather(*(self.execute(call) for call in calls))
        statuses = [status for _, status in results]
        setattr(choice, TOOL_STATUSES, statuses)
        self.metrics["tool_calls"] += len(calls)
        for call, status in zip(calls, statuses):
            if status in _STATUS_METRICS:
                self.metrics[_STATUS_METRICS[status]] += 1
            key = tool_call_key(call)
            self.metrics["repeated_calls"] += key in self.seen
            self.seen.add(key)
        return [
            {"role": "tool", "tool_call_id": call.id, "content": content} for call, (content, _) in zip(calls, results)
        ]


def _check_messages(messages: Sequence[Message]) -> list[Message]:
    if not messages:
        raise ValueError("messages must hold at least one message (the task)")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be an OpenAI message dict with a 'role', got {message!r:.80}")
    return [dict(m) for m in messages]


async def run_agent(
    client: AsyncOpenAI | None,
    model: Model | str,
    messages: Sequence[Message],
    tools: Sequence[Tool | Callable[..., Any]] = (),
    max_turns: int = 8,
    *,
    temperature: float = 1.0,
    max_tokens: int = 256,
    tool_timeout: float | None = 30.0,
    cache: ToolCache | None = None,
    air: AIRConfig | None = None,
    metadata: dict[str, str | int | float | bool | None] | None = None,
    approve: Approver | None = None,
    **sampling: Any,
) -> Trajectory:
    """Run one episode. ``client`` None: ``model.openai_client()``. ``tools``: ``Tool``s or plain functions.

    ``tool_timeout`` (seconds, None: none) bounds each call; ``cache`` memoises cacheable tools' results; ``air``
    computes automatic intermediate rewards at the end (``flywheel.agents.air``). ``approve`` decides each call of
    a ``high_impact`` tool before it runs (required when there is one: ``flywheel.approvals.deny``/``allow`` or a
    ``GraderApprover`` for rollouts, ``HumanApprover`` in production). Other keyword arguments
    (``seed``, ``top_p``, ``stop``...) go to ``chat.completions.create``. Metrics: ``turns``, ``tool_calls``,
    ``tool_errors``, ``tool_timeouts``, ``unknown_tool``, ``bad_arguments``, ``denied_calls``, ``approved_calls``,
    ``repeated_calls``, ``cache_hits``, ``cache_misses``, ``truncated_turns`` (cut by ``max_tokens``),
    ``max_turns_reached``.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be at least 1, got {max_turns}")
    if client is None:
        if not isinstance(model, Model):
            raise ValueError("pass an OpenAI client, or a Model whose openai_client() to use")
        client = model.openai_client()
    name = model.get_inference_name() if isinstance(model, Model) else model
    by_name = as_tools(tools)
    if approve is None and (high := [t.name for t in by_name.values() if t.high_impact]):
        raise ValueError(
            f"tool {high[0]!r} is high-impact: pass approve= (flywheel.approvals.deny or allow, or a GraderApprover, "
            "for rollouts; a HumanApprover in production)"
        )
    schemas = [t.schema for t in by_name.values()]
    traj = Trajectory(messages_and_choices=_check_messages(messages), tools=schemas or None, metadata=metadata or {})
    episode = _Episode(by_name, tool_timeout, cache, approve)
    request: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens, "logprobs": True, **sampling}
    if schemas:
        request["tools"] = schemas
    for _ in range(max_turns):
        response = await client.chat.completions.create(model=name, messages=traj.messages(), **request)
        if not response.choices:
            raise RuntimeError(f"model {name!r} returned no choices (response id {response.id})")
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        episode.metrics["turns"] += 1
        episode.metrics["truncated_turns"] += choice.finish_reason == "length"
        if not choice.message.tool_calls:
            break
        traj.messages_and_choices.extend(await episode.answer(choice))
    else:
        episode.metrics["max_turns_reached"] = True
    traj.metrics.update(episode.metrics)
    if air is not None:
        apply_air(traj, air)
    return traj


def final_answer(traj: Trajectory) -> str:
    """The text of the last sampled turn when it was an answer (no tool calls), else ""."""
    for item in reversed(traj.messages_and_choices):
        if isinstance(item, Choice):
            return "" if item.message.tool_calls else item.message.content or ""
    return ""
