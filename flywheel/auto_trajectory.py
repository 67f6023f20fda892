"""ART's automatic trajectories: ``await capture_auto_trajectory(agent())`` runs a block of agent code and returns
the ``Trajectory`` of the chat completions it made, with no trajectory code in the agent.

Inside the block, every ``/chat/completions`` call made with httpx or httpx2 (the openai SDK, sync or async, and
whatever uses them) is recorded when its answer arrives: the messages sent and the first choice received, with the exact token
ids our server returns (a streamed answer is read whole before the SDK gets it, then re-assembled). A call that
continues the trajectory's conversation (its messages start with the conversation so far) extends it; any other
call starts, or continues, one of ``additional_histories`` (a sub-agent, a summariser). ``auto_trajectory()`` is the
trajectory being recorded, e.g. to set its reward inside the block. The hook on httpx's ``send`` is installed on
first use and records nothing outside a block (a context variable, so concurrent blocks record apart).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Coroutine
from typing import Any, Literal, overload

import httpx
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

from flywheel.types import (
    GUIDED,
    LOGPROBS_TEMPERATURE,
    PROMPT_TOKEN_IDS,
    TEMPERATURE,
    TOKEN_IDS,
    TOKENIZER,
    TOP_P,
    WEIGHTS_STEP,
    History,
    Message,
    Trajectory,
    set_sampled_tokens,
)

_current: contextvars.ContextVar[Trajectory | None] = contextvars.ContextVar("flywheel_auto_trajectory", default=None)
_installed = False


@overload
def auto_trajectory(*, required: Literal[True]) -> Trajectory: ...
@overload
def auto_trajectory(*, required: Literal[False] = False) -> Trajectory | None: ...
def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """The trajectory the enclosing ``capture_auto_trajectory`` records (None outside one, or an error with
    ``required=True``)."""
    trajectory = _current.get()
    if trajectory is None and required:
        raise RuntimeError("auto_trajectory(required=True) was called outside capture_auto_trajectory(...)")
    return trajectory


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Runs ``coroutine`` and returns the trajectory of the chat completions it made (``finish()``-ed: its
    ``duration`` metric is the block's)."""
    _install()
    trajectory = Trajectory(messages_and_choices=[], reward=0.0)
    token = _current.set(trajectory)
    try:
        await coroutine
    finally:
        _current.reset(token)
    return trajectory.finish()


def _http_modules() -> list[Any]:
    """httpx, and httpx2 where installed (the openai SDK's own HTTP client since its 3.x releases)."""
    modules: list[Any] = [httpx]
    with contextlib.suppress(ImportError):
        import httpx2

        modules.append(httpx2)
    return modules


def _install() -> None:
    global _installed
    if _installed:
        return
    for module in _http_modules():
        _hook(module)
    _installed = True


def _hook(module: Any) -> None:
    """Wraps the module's ``AsyncClient.send`` and ``Client.send``: inside a block, a chat completion's answer is
    read (a stream too: the SDK then iterates over what was read) and recorded before it is returned."""
    async_send, sync_send = module.AsyncClient.send, module.Client.send

    async def send_async(self: Any, request: Any, **kwargs: Any) -> Any:
        response = await async_send(self, request, **kwargs)
        trajectory = _current.get()
        if trajectory is not None and _is_chat_completion(request, response):
            await response.aread()
            _record(trajectory, request, response)
        return response

    def send_sync(self: Any, request: Any, **kwargs: Any) -> Any:
        response = sync_send(self, request, **kwargs)
        trajectory = _current.get()
        if trajectory is not None and _is_chat_completion(request, response):
            response.read()
            _record(trajectory, request, response)
        return response

    module.AsyncClient.send = send_async
    module.Client.send = send_sync


def _is_chat_completion(request: Any, response: Any) -> bool:
    return request.method == "POST" and request.url.path.endswith("/chat/completions") and response.status_code == 200


def _record(trajectory: Trajectory, request: Any, response: Any) -> None:
    body = json.loads(request.content)
    messages: list[Message] = list(body.get("messages") or [])
    choice = _streamed_choice(response.text) if body.get("stream") else _first_choice(response.content)
    if choice is None:
        return
    histories: list[History] = [trajectory, *trajectory.additional_histories]
    target = next((h for h in histories if h.messages_and_choices and _continues(h.messages(), messages)), None)
    if target is None and not trajectory.messages_and_choices:
        target = trajectory
    if target is None:
        trajectory.additional_histories.append(
            History(messages_and_choices=[*messages, choice], tools=body.get("tools"))
        )
        return
    target.messages_and_choices.extend([*messages[len(target.messages_and_choices) :], choice])
    target.tools = target.tools or body.get("tools")


def _first_choice(content: bytes) -> Choice | None:
    completion = ChatCompletion.model_validate_json(content)
    return completion.choices[0] if completion.choices else None


def _streamed_choice(text: str) -> Choice | None:
    """The first choice of an SSE stream, put together from its chunks (our server's last chunk carries the
    sampled token ids)."""
    content, finish_reason, tool_calls, extras = "", None, {}, None
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for chunk_choice in json.loads(line[len("data: ") :]).get("choices", []):
            if chunk_choice.get("index", 0) != 0:
                continue
            delta = chunk_choice.get("delta") or {}
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = tool_calls.setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                function = call.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["arguments"] += function.get("arguments") or ""
            finish_reason = chunk_choice.get("finish_reason") or finish_reason
            if "token_ids" in chunk_choice:
                extras = chunk_choice
    if finish_reason is None:
        return None
    message = ChatCompletionMessage(
        role="assistant",
        content=content or None,
        tool_calls=[
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(tool_calls.items())
        ]
        or None,
    )
    choice = Choice(index=0, finish_reason=finish_reason, message=message)
    if extras is not None:
        set_sampled_tokens(
            choice, extras[PROMPT_TOKEN_IDS], extras[TOKEN_IDS], extras.get(TEMPERATURE, 1.0),
            top_p=extras.get(TOP_P, 1.0), guided=bool(extras.get(GUIDED)),
            logprobs_temperature=extras.get(LOGPROBS_TEMPERATURE), tokenizer=extras.get(TOKENIZER),
            weights_step=extras.get(WEIGHTS_STEP),
        )  # fmt: skip
    return choice


def _same(a: Message, b: Message) -> bool:
    def key(m: Message) -> tuple[Any, ...]:
        calls = [
            (c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
            for c in m.get("tool_calls") or []
        ]
        return m.get("role"), m.get("content") or "", calls, m.get("tool_call_id")

    return key(a) == key(b)


def _continues(history: list[Message], messages: list[Message]) -> bool:
    return len(messages) >= len(history) and all(_same(a, b) for a, b in zip(history, messages))


__all__ = ["auto_trajectory", "capture_auto_trajectory"]
