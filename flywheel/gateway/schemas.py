"""The records of the episode API and the rollout queue, declared once: what the store returns, what the routes send
and what the Python client reads back.

Pydantic only (no HTTP, no database, no torch), so the store, the gateway's routes and the light client
(``flywheel.gateway.client``) all import it. A ``...Record`` is a row as the store reads it; its subclass without the
suffix is the same record on the wire, with what only a server can add (the episode's OpenAI ``base_url``, its
usage, a task's attempts). ``TaskSpec`` is the one request body shared by both sides: the loop builds it and
``POST /tasks`` validates it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, computed_field

from flywheel.types import Usage

MAX_GROUP_SIZE = 1024


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value  # SQLite keeps no time zone: it was UTC


Timestamp = Annotated[datetime, AfterValidator(_utc)]


class EpisodeStatus(StrEnum):
    open = "open"
    finished = "finished"
    abandoned = "abandoned"


class AttemptStatus(StrEnum):
    queued = "queued"
    leased = "leased"
    finished = "finished"
    failed = "failed"


class TaskStatus(StrEnum):
    open = "open"  # attempts are still queued or leased
    complete = "complete"  # all group_size attempts finished
    failed = "failed"  # none left to run and some failed: the group will not be complete


class EpisodeRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    task_id: str
    split: str
    model: str | None
    status: EpisodeStatus
    reward: float | None
    metrics: dict[str, Any]
    meta: dict[str, Any]
    created_at: Timestamp
    finished_at: Timestamp | None


class Episode(EpisodeRecord):
    """An episode as the episode API sends it."""

    base_url: str  # point the agent's OpenAI client here
    usage: Usage | None = None  # its calls, tokens, latency and cost (None: from a gateway that predates it)

    @classmethod
    def of(cls, record: EpisodeRecord, base_url: str, usage: Usage | None = None) -> Self:
        return cls(**record.model_dump(), base_url=base_url, usage=usage)


class AttemptRecord(BaseModel):
    """One of a queued task's ``group_size`` runs."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    task_id: str
    index: int
    status: AttemptStatus
    tries: int  # tries that ended without a result
    runner: str | None
    episode_id: str | None
    lease_seconds: float | None
    lease_expires_at: Timestamp | None
    error: str | None
    created_at: Timestamp
    finished_at: Timestamp | None


class Attempt(AttemptRecord):
    """An attempt as the queue sends it, with its episode's OpenAI base URL while it has an episode."""

    object: Literal["attempt"] = "attempt"
    base_url: str | None

    @classmethod
    def of(cls, record: AttemptRecord, base_url: str | None, **more: Any) -> Self:
        return cls(**record.model_dump(), base_url=base_url, **more)


class Lease(Attempt):
    """A claimed attempt: run the agent on ``payload`` against ``base_url``, heartbeat before ``lease_expires_at``,
    then complete (or fail) it."""

    episode_id: str
    base_url: str
    lease_expires_at: Timestamp
    payload: dict[str, Any]
    model: str | None  # the name the agent should call
    split: str


class TaskRecord(BaseModel):
    id: str
    payload: dict[str, Any]
    group_size: int
    split: str
    model: str | None
    max_tries: int
    created_at: Timestamp
    status: TaskStatus
    counts: dict[AttemptStatus, int]  # attempts in each state

    @computed_field
    @property
    def complete(self) -> bool:
        return self.status == TaskStatus.complete


class Task(TaskRecord):
    """A task as the queue sends it; ``attempts``: given by ``GET /tasks/{id}`` only."""

    object: Literal["task"] = "task"
    attempts: list[Attempt] = []

    @classmethod
    def of(cls, record: TaskRecord, attempts: list[Attempt] | None = None) -> Self:
        return cls(**record.model_dump(exclude={"complete"}), attempts=attempts or [])


class TaskSpec(BaseModel):
    """A task to enqueue (``POST /tasks``): ``group_size`` runs of an agent on ``payload``, whose episodes form the
    group ``task_id``."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(
        min_length=1, max_length=256, pattern=r"^[^/]+$", description="The group key its episodes carry (no '/')."
    )
    payload: dict[str, Any] = Field(description="What each attempt's agent is given.")
    group_size: int = Field(ge=1, le=MAX_GROUP_SIZE, description="Attempts, i.e. finished episodes in the group.")
    split: str = Field("train", min_length=1, max_length=32)
    model: str | None = Field(None, max_length=256, description="The model name the agent should call.")
    max_tries: int = Field(3, ge=1, le=100, description="Tries an attempt gets (expired or failed) before it fails.")
