"""The data a rollout produces and training consumes: trajectories and groups of them.

A trajectory is one episode of an agent: the chat it had (plain message dicts for what the environment said, and
OpenAI ``Choice`` objects for the turns the model sampled, which are the only trainable ones), a reward, and
whatever metrics or metadata the rollout wants to record. Rewards are compared within a ``TrajectoryGroup``
(several rollouts of the same scenario), which is why groups are the unit that ``gather`` and training work on.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Self

from openai.types.chat.chat_completion import Choice
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
)

MetadataValue = str | int | float | bool | None

Message = dict[str, Any]
"""An OpenAI chat message dict, ``{"role": ..., "content": ...}``, maybe with ``tool_calls``, ``tool_call_id``
or ``name``."""


def _message_or_choice(value: Any) -> str:
    # JSON turns a Choice into a dict; "finish_reason" and "message" together only ever come from a Choice.
    if isinstance(value, Choice) or (isinstance(value, dict) and "finish_reason" in value and "message" in value):
        return "choice"
    return "message"


MessageOrChoice = Annotated[
    Annotated[Choice, Tag("choice")] | Annotated[Message, Tag("message")],
    Discriminator(_message_or_choice),
]
"""A turn of a conversation. A Choice is a sampled assistant turn; our server adds ``token_ids``,
``prompt_token_ids``, ``temperature``, ``top_p``, ``guided``, ``logprobs_temperature`` and ``tokenizer`` to it as
extra fields, which the OpenAI SDK's models keep (in memory and through JSON). Read and write them with the
accessors below, never by string name."""

Messages = list[Message]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[dict[str, Any]]
"""ART's type names (``art.Messages``, ``art.MessagesAndChoices``, ``art.Tools``): a conversation's messages, a
history's turns, its tool definitions (OpenAI ``{"type": "function", "function": {...}}`` dicts)."""

TOKEN_IDS, PROMPT_TOKEN_IDS, TEMPERATURE = "token_ids", "prompt_token_ids", "temperature"
TOP_P, GUIDED, LOGPROBS_TEMPERATURE, TOKENIZER = "top_p", "guided", "logprobs_temperature", "tokenizer"
WEIGHTS_STEP = "weights_step"  # the checkpoint step whose weights a Flywheel server answered the call with
INTERMEDIATE_REWARD = "intermediate_reward"
# Trajectory.metadata: a logged episode that joined a group as an off-policy member (sampled by an earlier
# checkpoint): the trainer reports its tokens' importance ratios apart (``off_policy_is_ratio_mean``)
OFF_POLICY = "off_policy"
# Trajectory.metadata: the oldest checkpoint step that answered a call of it (the gateway's export and off-policy
# members set it from the recorded calls; without it, the oldest ``WEIGHTS_STEP`` of its choices: ``answered_at``)
ANSWERED_AT = "answered_at_step"


@dataclass(frozen=True)
class SampledTokens:
    """What the sampler did for one Choice: the exact prompt it was fed, the ids it drew, the log-probability of
    each drawn id as the sampler reported it (``None`` when the client did not ask for log-probs), the temperature
    the turn trains at (its sampling temperature; 1.0 for a greedy draw or when none was recorded), and how it was
    drawn: greedily (``greedy``), from the top-p nucleus (``top_p`` < 1), under a grammar (``guided``: a forced
    tool call, ``guided_choice`` or a JSON ``response_format``), and the temperature its log-probs are at
    (``logprobs_temperature``: an upstream's may be T = 1's whatever it sampled at, ``gateway/upstream.py``)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None
    temperature: float
    greedy: bool = False
    top_p: float = 1.0
    guided: bool = False
    logprobs_temperature: float | None = 1.0  # None: at no temperature the trainer computes (truncated)

    @property
    def importance_logprobs(self) -> list[float] | None:
        """The sampler's log-probs as truncated importance sampling may compare the trainer's with, which scores
        the unconstrained softmax(logits / T) at ``temperature``: none for a guided turn (its log-probs are the
        masked distribution's) or one whose log-probs are at another temperature than it trains at. Top-p is left
        out of both sides (the sampler reports log-probs before the cut, ``inference/sampling.py``)."""
        if self.guided or self.logprobs_temperature != self.temperature:
            return None
        return self.logprobs


def sampled_tokens(choice: Choice) -> SampledTokens | None:
    """The sampled ids of a Choice that came from our engine (``None`` for one built by hand or by another API).
    A Choice recorded before ``top_p``, ``guided`` and ``logprobs_temperature`` were: top-p 1, not guided (the
    off-policy members also read the request, ``loop/offpolicy.py``), log-probs at its temperature."""
    prompt, completion = getattr(choice, PROMPT_TOKEN_IDS, None), getattr(choice, TOKEN_IDS, None)
    if prompt is None or completion is None:
        return None
    content = choice.logprobs.content if choice.logprobs and choice.logprobs.content else None
    logprobs = [t.logprob for t in content] if content and len(content) == len(completion) else None
    sampled_at = getattr(choice, TEMPERATURE, None)
    temperature = float(sampled_at or 1.0)  # greedy (0) trains as the T=1 distribution
    logprobs_at = getattr(choice, LOGPROBS_TEMPERATURE, temperature)  # recorded null: None
    return SampledTokens(
        list(prompt),
        list(completion),
        logprobs,
        temperature,
        greedy=sampled_at is not None and float(sampled_at) == 0.0,
        top_p=float(getattr(choice, TOP_P, None) or 1.0),
        guided=bool(getattr(choice, GUIDED, False)),
        logprobs_temperature=None if logprobs_at is None else float(logprobs_at or 1.0),
    )


def set_sampled_tokens(
    choice: Choice,
    prompt_ids: list[int],
    completion_ids: list[int],
    temperature: float,
    *,
    top_p: float = 1.0,
    guided: bool = False,
    logprobs_temperature: float | None = None,
    tokenizer: str | None = None,
    weights_step: int | None = None,
) -> None:
    """Record on a Choice what the sampler was fed and drew, and how: the temperature and top-p it drew at, whether
    a grammar guided it, the temperature its log-probs are at (default: the one it drew at; 1.0 for a greedy draw,
    as our engine reports them), the tokenizer whose ids these are (``gateway/splice.py``'s ``tokenizer_key``) and
    the checkpoint step whose weights drew them (``weights_step``: what bounded staleness reads)."""
    setattr(choice, PROMPT_TOKEN_IDS, list(prompt_ids))
    setattr(choice, TOKEN_IDS, list(completion_ids))
    setattr(choice, TEMPERATURE, float(temperature))
    setattr(choice, TOP_P, float(top_p))
    setattr(choice, GUIDED, bool(guided))
    at = logprobs_temperature if logprobs_temperature is not None else temperature
    setattr(choice, LOGPROBS_TEMPERATURE, float(at or 1.0))
    if tokenizer is not None:
        setattr(choice, TOKENIZER, tokenizer)
    if weights_step is not None:
        setattr(choice, WEIGHTS_STEP, int(weights_step))


def weights_step(choice: Choice) -> int | None:
    """The checkpoint step whose weights drew this Choice, as the Flywheel server that answered recorded it (the
    weights it started with: a step trained while it decoded only makes it fresher); None if none recorded."""
    value = getattr(choice, WEIGHTS_STEP, None)
    return None if value is None else int(value)


def completion_token_count(choice: Choice) -> int:
    """Sampled tokens of a Choice from our engine (0 for others)."""
    return len(getattr(choice, TOKEN_IDS, None) or [])


def intermediate_reward(choice: Choice) -> float | None:
    """The reward given to this turn alone (automatic intermediate rewards or your own), if any."""
    value = getattr(choice, INTERMEDIATE_REWARD, None)
    return None if value is None else float(value)


def set_intermediate_reward(choice: Choice, reward: float) -> None:
    if not math.isfinite(reward):
        raise ValueError(f"an intermediate reward was {reward}; rewards must be finite")
    setattr(choice, INTERMEDIATE_REWARD, float(reward))


def _tool_call_dict(call: Any) -> dict[str, Any]:
    if call.type == "function":
        return {
            "id": call.id,
            "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments},
        }
    return call.model_dump(mode="json", exclude_none=True)  # custom (non-function) tools: pass through unchanged


def choice_to_message(choice: Choice) -> Message:
    """The assistant message a sampled Choice produced, as a plain dict (``tool_calls`` only when present)."""
    message: Message = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [_tool_call_dict(call) for call in choice.message.tool_calls]
    return message


class History(BaseModel):
    """A conversation and the tools offered during it: a trajectory's main one, or one of its
    ``additional_histories`` (a sub-agent's, or the turns before a context reset)."""

    messages_and_choices: list[MessageOrChoice]
    tools: list[dict] | None = None

    def messages(self) -> list[Message]:
        """The chat as plain message dicts, each sampled Choice turned into the assistant message it produced."""
        # Message dicts are copied, so that editing the result cannot rewrite the trajectory.
        return [
            choice_to_message(item) if isinstance(item, Choice) else dict(item) for item in self.messages_and_choices
        ]


class Trajectory(History):
    """One rollout: the conversation, its reward and what the rollout chose to record about it."""

    # Validating on assignment catches `t.reward += nan` at the line that does it, not later in training.
    model_config = ConfigDict(validate_assignment=True)

    # Names the trajectory for judges, exports and errors; declared before reward and metrics so that their
    # validators can quote it.
    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    additional_histories: list[History] = []
    reward: float = 0.0
    metrics: dict[str, float | int | bool] = {}
    metadata: dict[str, MetadataValue] = {}
    logs: list[str] = []
    # when the trajectory was made (time.monotonic()), for finish(); not saved, and not part of its value (__eq__)
    _started: float = PrivateAttr(default_factory=time.monotonic)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def log(self, message: str) -> None:
        """Adds a line to ``logs`` (kept with the trajectory, shown by ``for_logging``)."""
        self.logs.append(message)

    def finish(self) -> Self:
        """Records ``metrics["duration"]``: seconds since the trajectory was made. Returns it, for
        ``return trajectory.finish()``."""
        self.metrics["duration"] = time.monotonic() - self._started
        return self

    @contextlib.asynccontextmanager
    async def track_duration(self, metric_name: str) -> AsyncIterator[None]:
        """``async with trajectory.track_duration("judge"):`` adds the block's seconds to
        ``metrics["judge_duration"]`` (summed over every use)."""
        start = time.monotonic()
        try:
            yield
        finally:
            key = f"{metric_name}_duration"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.monotonic() - start

    def for_logging(self) -> dict[str, Any]:
        """A JSON-ready summary to print or log: reward, metrics, metadata, logs, tools and the messages, each
        marked ``trainable`` when the model sampled it."""
        messages = [
            {**(choice_to_message(item) if isinstance(item, Choice) else item), "trainable": isinstance(item, Choice)}
            for item in self.messages_and_choices
        ]
        return {
            "reward": self.reward,
            "metrics": self.metrics,
            "metadata": self.metadata,
            "messages": messages,
            "tools": self.tools,
            "logs": self.logs,
        }

    @field_validator("reward")
    @classmethod
    def _reward_is_finite(cls, reward: float, info: ValidationInfo) -> float:
        # One NaN reward turns every advantage of its group into NaN, and from there the model weights.
        if not math.isfinite(reward):
            trajectory = info.data.get("id")
            raise ValueError(f"reward was {reward} (NaN/inf) in trajectory {trajectory}; rewards must be finite")
        return reward

    @field_validator("metrics")
    @classmethod
    def _metrics_are_not_nan(cls, metrics: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        for key, value in metrics.items():
            if isinstance(value, float) and math.isnan(value):
                trajectory = info.data.get("id")
                raise ValueError(f"metric {key!r} was NaN in trajectory {trajectory}; NaN would poison its averages")
        return metrics

    def __str__(self) -> str:
        sampled = sum(isinstance(item, Choice) for item in self.messages_and_choices)
        return (
            f"Trajectory(reward={self.reward:g}, {len(self.messages_and_choices)} turns ({sampled} sampled), "
            f"id={self.id})"
        )


class PydanticException(BaseModel):
    """A serialisable record of an exception raised by a rollout."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exception: BaseException) -> PydanticException:
        return cls(
            type=type(exception).__name__,
            message=str(exception),
            traceback="".join(traceback.format_exception(exception)),
        )


async def _resolved(value: Trajectory) -> Trajectory:
    """Lets a finished trajectory wait in line with pending rollouts, so that a group keeps its input order."""
    return value


class TrajectoryGroup(BaseModel):
    """Rollouts of the same scenario, whose rewards are compared with each other.

    ``TrajectoryGroup(rollout(model, s) for _ in range(4))`` may be written in sync code: the coroutines are kept,
    not run, until the group is awaited (or passed to ``gather_trajectory_groups``, which runs them with a
    progress bar and limits). Awaiting runs them concurrently and returns the same group, filled in. Rollouts that
    raised are recorded in ``exceptions``; their original exception objects stay in ``_original_exceptions``.
    """

    trajectories: list[Trajectory]
    exceptions: list[PydanticException] = []
    metadata: dict[str, MetadataValue] = {}  # about the scenario the group is of
    metrics: dict[str, float | int | bool] = {}  # about the group as a whole (per-trajectory ones go on each)
    logs: list[str] = []

    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)
    _original_exceptions: list[BaseException] = PrivateAttr(default_factory=list)
    # (start, rollouts done, scoring done) on time.monotonic(), set by gather_trajectory_groups
    _timing: tuple[float, float, float] | None = PrivateAttr(default=None)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]] = (),
        exceptions: Iterable[BaseException | PydanticException] = (),
        *,
        metadata: dict[str, MetadataValue] | None = None,
        metrics: dict[str, float | int | bool] | None = None,
        logs: list[str] | None = None,
    ) -> None:
        items, exceptions = list(trajectories), list(exceptions)
        raised = [item for item in items if isinstance(item, BaseException)]
        finished = [item for item in items if not isinstance(item, BaseException)]
        raised += [e for e in exceptions if isinstance(e, BaseException)]
        recorded = [e for e in exceptions if not isinstance(e, BaseException)]
        pending: list[Awaitable[Trajectory]] = []
        if any(inspect.isawaitable(item) for item in finished):
            pending = [item if inspect.isawaitable(item) else _resolved(item) for item in finished]
            finished = []
        super().__init__(
            trajectories=finished, exceptions=recorded, metadata=metadata or {}, metrics=metrics or {}, logs=logs or []
        )
        for exception in raised:
            self._record(exception)
        if pending:
            self._pending = pending
            # Leave the field unset until the rollouts finish, so that reading it reaches __getattr__ and fails
            # loudly, instead of returning an empty list that would silently train on nothing.
            del self.__dict__["trajectories"]

    def _check_finished(self) -> None:
        if self._pending:
            raise RuntimeError(
                f"this TrajectoryGroup has {len(self._pending)} rollouts still pending: await it "
                "(`group = await group`) or pass it to gather_trajectory_groups before reading its trajectories"
            )

    def __getattr__(self, name: str) -> Any:
        if name == "trajectories":  # only reached while the field is unset, i.e. rollouts are pending
            self._check_finished()
        return super().__getattr__(name)  # type: ignore[misc]  # pydantic's, which serves private attributes

    @model_serializer(mode="wrap")
    def _serialize_only_when_finished(self, handler: Any) -> Any:
        self._check_finished()  # pydantic would otherwise quietly leave the unset field out
        return handler(self)

    def __await__(self) -> Generator[Any, None, Self]:
        return self._run_pending().__await__()

    async def _run_pending(self) -> Self:
        if self._pending:
            self._complete(await asyncio.gather(*self._pending, return_exceptions=True))
        return self

    def _complete(self, results: Iterable[Trajectory | list[Trajectory] | BaseException]) -> None:
        """Fills the group with the results of its pending rollouts, in order; shared with gather."""
        finished: list[Trajectory] = []
        for result in results:
            if isinstance(result, BaseException):
                self._record(result)
            elif isinstance(result, Trajectory):
                finished.append(result)
            elif isinstance(result, list) and all(isinstance(t, Trajectory) for t in result):
                finished += result  # a rollout that made several trajectories (e.g. one per agent)
            else:
                raise TypeError(
                    f"a rollout returned {type(result).__name__}, expected a Trajectory or a list of them "
                    "(missing return?)"
                )
        self._pending = []
        self.trajectories = finished

    def _record(self, exception: BaseException) -> None:
        self.exceptions.append(PydanticException.from_exception(exception))
        self._original_exceptions.append(exception)

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]  # a group iterates its trajectories
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass
class TrainResult:
    """What ``backend.train`` returns (ART's): the model's step after it, and the step's metrics."""

    step: int
    metrics: dict[str, float]


class Usage(BaseModel):
    """An episode's calls added up, as the episode API returns it (``usage``): what the episode took and what it
    cost at the gateway's prices (``flywheel.store.costs`` computes it; ``flywheel.gateway.client`` reads it)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    cost: float = 0.0
    currency: str = "USD"
