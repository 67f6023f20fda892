"""Trajectories: what an agent did in one episode, and how well it went.

Items of ``messages_and_choices`` are OpenAI chat message dicts (context: system, user, tool results, or assistant
turns that were not sampled from the model being trained) or ``openai`` ``Choice`` objects (sampled turns, the
ones training updates). A ``Choice`` from Flywheel's engine also carries ``token_ids`` and ``prompt_token_ids``.
"""

from __future__ import annotations

import asyncio
import math
import traceback as tb
import uuid
from collections.abc import Awaitable, Iterable, Iterator
from typing import Any, Union

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

Message = dict[str, Any]
MessageOrChoice = Union[Choice, Message]
MetricValue = Union[float, int, bool]


def _as_item(item: Any) -> MessageOrChoice:
    """JSON gives dicts back: a dict with ``finish_reason`` and ``message`` was a Choice."""
    if isinstance(item, dict) and "finish_reason" in item and "message" in item:
        return Choice.model_validate(item)
    if isinstance(item, (dict, Choice)):
        return item
    raise TypeError(f"messages_and_choices items must be message dicts or openai Choice objects, not {type(item).__name__}")


def choice_to_message(choice: Choice) -> Message:
    msg = choice.message
    out: Message = {"role": "assistant", "content": msg.content}
    if msg.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in msg.tool_calls
        ]
    return out


class History(BaseModel):
    """A conversation: messages and sampled choices, with the tools that were offered."""

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=True)

    messages_and_choices: list[MessageOrChoice]
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _items(cls, items: Iterable[Any]) -> list[MessageOrChoice]:
        return [_as_item(i) for i in items]

    def messages(self) -> list[Message]:
        """Plain message dicts, sampled choices turned into assistant messages."""
        return [choice_to_message(i) if isinstance(i, Choice) else dict(i) for i in self.messages_and_choices]


class Trajectory(History):
    """One episode: the main conversation (plus any side conversations) and its reward."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    additional_histories: list[History] = []
    reward: float = 0.0
    metrics: dict[str, MetricValue] = {}
    metadata: dict[str, str | int | float | bool | None] = {}
    logs: list[str] = []

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, reward: float, info) -> float:
        if not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward} (trajectory {info.data.get('id', '?')})")
        return reward

    @field_validator("metrics")
    @classmethod
    def _finite_metrics(cls, metrics: dict[str, MetricValue]) -> dict[str, MetricValue]:
        for key, value in metrics.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"metric '{key}' must be a finite number, got {value}")
        return metrics

    def __str__(self) -> str:
        turns = sum(isinstance(i, Choice) for i in self.messages_and_choices)
        return f"Trajectory(id={self.id[:8]}, reward={self.reward:.3f}, sampled_turns={turns}, items={len(self.messages_and_choices)})"


class PydanticException(BaseModel):
    """An exception a rollout raised, kept as data (type, message, traceback)."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> PydanticException:
        return cls(
            type=type(exc).__name__,
            message=str(exc),
            traceback="".join(tb.format_exception(type(exc), exc, exc.__traceback__)),
        )


class TrajectoryGroup(BaseModel):
    """Attempts at the same scenario; rewards are compared within the group.

    Built from trajectories, exceptions, or awaitables of trajectories (``TrajectoryGroup(rollout() for _ in
    range(4))`` in sync code); ``await group`` or ``gather_trajectory_groups`` runs the awaitables.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories_: list[Trajectory] = Field(default_factory=list, alias="trajectories")
    exceptions: list[PydanticException] = []
    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)
    _errors: list[BaseException] = PrivateAttr(default_factory=list)  # originals, to re-raise with tracebacks

    def __init__(
        self,
        trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]] = (),
        exceptions: list[PydanticException | BaseException] | None = None,
        **kwargs: Any,
    ):
        done, pending, errors = [], [], []
        for item in trajectories:
            if isinstance(item, (Trajectory, dict)):
                done.append(item)
            elif isinstance(item, BaseException):
                errors.append(item)
            elif isinstance(item, Awaitable):
                pending.append(item)
            else:
                raise TypeError(f"TrajectoryGroup items must be Trajectory, exception or awaitable, not {type(item).__name__}")
        stored = [e for e in exceptions or [] if not isinstance(e, BaseException)]
        errors += [e for e in exceptions or [] if isinstance(e, BaseException)]
        super().__init__(trajectories=done, exceptions=stored + [PydanticException.from_exception(e) for e in errors], **kwargs)
        self._pending, self._errors = pending, errors

    @property
    def trajectories(self) -> list[Trajectory]:
        if self._pending:
            raise RuntimeError(
                f"This TrajectoryGroup still has {len(self._pending)} rollouts to run: `await` it or pass it to "
                "gather_trajectory_groups first."
            )
        return self.trajectories_

    @trajectories.setter
    def trajectories(self, value: list[Trajectory]) -> None:
        self.trajectories_ = value

    @property
    def pending(self) -> list[Awaitable[Trajectory]]:
        return self._pending

    def add_result(self, result: Trajectory | BaseException) -> None:
        """Record one finished rollout (used by gather)."""
        if isinstance(result, BaseException):
            self._errors.append(result)
            self.exceptions.append(PydanticException.from_exception(result))
        else:
            self.trajectories_.append(result)

    def take_pending(self) -> list[Awaitable[Trajectory]]:
        pending, self._pending = self._pending, []
        return pending

    def __await__(self):
        async def run() -> TrajectoryGroup:
            results = await asyncio.gather(*self.take_pending(), return_exceptions=True)
            for r in results:
                self.add_result(r)
            return self

        return run().__await__()

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("by_alias", True)
        return super().model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        kwargs.setdefault("by_alias", True)
        return super().model_dump_json(**kwargs)
