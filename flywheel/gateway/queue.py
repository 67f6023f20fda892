"""The rollout queue over HTTP: the training side enqueues tasks; runners anywhere claim attempts, run an agent
against each attempt's episode URL, and post its result (the protocol, for runners in any language, is in
docs/user-guide.md, "Runners").

Routes (JSON; errors in OpenAI's ``{"error": {...}}`` shape):

- ``POST /tasks`` ``{task_id, payload, group_size, split?, model?, max_tries?}`` -> 201, the task (200 if the same
  task was queued before; 409 if its id names another group)
- ``GET /tasks?status=&limit=&offset=`` -> ``{"data": [task, ...]}``; ``GET /tasks/{id}`` -> the task and its attempts
- ``POST /tasks/claim`` ``{runner, lease_seconds?}`` -> the oldest queued attempt, leased, with its task's payload and
  its episode's ``base_url``; 204 when nothing is queued
- ``POST /attempts/{id}/heartbeat`` ``{episode_id, lease_seconds?}`` -> the attempt, its lease extended
- ``POST /attempts/{id}/complete`` ``{episode_id, reward, metrics?, call_rewards?}`` -> the attempt, finished
- ``POST /attempts/{id}/fail`` ``{episode_id, reason}`` -> the attempt, requeued (or failed: its tries are used up)

A heartbeat, result or failure for a lease that is over (expired, or the attempt requeued or claimed again) is a
409 and changes nothing; an unknown task or attempt a 404; a malformed body a 400.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from flywheel.gateway.api import Outcome, episode_url, refuse_personal_id, root_url
from flywheel.gateway.client import GroupQueue, TextOnly
from flywheel.gateway.export import task_group
from flywheel.gateway.recorder import Gateway
from flywheel.gateway.schemas import Attempt, AttemptRecord, Lease, Task, TaskSpec, TaskStatus
from flywheel.openai_api import ErrorDetail, ErrorResponse
from flywheel.store import tasks
from flywheel.store.tasks import LeaseLostError, TaskConflictError, UnknownAttemptError, UnknownTaskError
from flywheel.types import TrajectoryGroup

MAX_LEASE_SECONDS = 24 * 3600
LeaseSeconds = Annotated[float, Field(gt=0, le=MAX_LEASE_SECONDS, description="How long the lease lasts unrenewed.")]
EpisodeId = Annotated[str, Field(min_length=1, max_length=64, description="The episode the lease was claimed with.")]


class ClaimRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    runner: str = Field(min_length=1, max_length=256, description="Who claims: shown on the attempt.")
    lease_seconds: LeaseSeconds = 60.0


class Heartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    lease_seconds: LeaseSeconds | None = None


class Result(Outcome):
    episode_id: EpisodeId
    reward: float  # required here: a result is a reward (finite: Outcome checks it)


class Failure(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    reason: str = Field(min_length=1, max_length=2000)


def _refusal(status: int, message: str, param: str, code: str) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, type="invalid_request_error", param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump())


def _refusals(route: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """The queue's refusals as OpenAI-style errors (unknown ids 404; a lease that is over, or a task id taken, 409)."""

    @functools.wraps(route)
    async def answer(*args: Any, **kwargs: Any) -> Any:
        try:
            return await route(*args, **kwargs)
        except UnknownTaskError as exc:
            return _refusal(404, str(exc), "task_id", "task_not_found")
        except UnknownAttemptError as exc:
            return _refusal(404, str(exc), "attempt_id", "attempt_not_found")
        except TaskConflictError as exc:
            return _refusal(409, str(exc), "task_id", "task_exists")
        except LeaseLostError as exc:
            return _refusal(409, str(exc), "episode_id", "lease_lost")

    return answer


def sent(attempt: AttemptRecord, root: str) -> Attempt:
    return Attempt.of(attempt, episode_url(root, attempt.episode_id) if attempt.episode_id else None)


def queue_router(gateway: Gateway) -> APIRouter:
    router = APIRouter(tags=["queue"])
    run = gateway.store.run

    @router.post("/tasks", status_code=201)
    @_refusals
    async def enqueue(body: TaskSpec):
        refuse_personal_id(gateway, "task_id", body.task_id, body.split)  # its episodes' group key: never redacted
        task, new = await run(
            tasks.enqueue,
            body.task_id,
            body.payload,
            group_size=body.group_size,
            split=body.split,
            model=body.model,
            max_tries=body.max_tries,
        )
        return JSONResponse(Task.of(task).model_dump(mode="json"), status_code=201 if new else 200)

    @router.get("/tasks")
    async def list_(
        status: TaskStatus | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        offset: Annotated[int, Query(ge=0)] = 0,
    ):
        found = await run(tasks.list_tasks, status=status, limit=limit, offset=offset)
        return {"object": "list", "data": [Task.of(t).model_dump(mode="json") for t in found]}

    @router.get("/tasks/{task_id}")
    @_refusals
    async def get(task_id: str, request: Request):
        task, attempts = await run(tasks.get_task, task_id)
        root = root_url(request)
        return Task.of(task, [sent(a, root) for a in attempts])

    @router.post("/tasks/claim")
    async def claim(body: ClaimRequest, request: Request):
        await gateway.settled()  # a lease it expires abandons an episode: its answered calls are written first
        lease = await run(tasks.claim, body.runner, body.lease_seconds)
        if lease is None:
            return Response(status_code=204)
        url = episode_url(root_url(request), lease.episode.id)
        return Lease.of(lease.attempt, url, payload=lease.payload, model=lease.model, split=lease.split)

    @router.post("/attempts/{attempt_id}/heartbeat")
    @_refusals
    async def heartbeat(attempt_id: str, body: Heartbeat, request: Request):
        await gateway.settled(body.episode_id, generating=False)  # a call being generated must not hold it up
        attempt = await run(tasks.heartbeat, attempt_id, body.episode_id, body.lease_seconds)
        return sent(attempt, root_url(request))

    @router.post("/attempts/{attempt_id}/complete")
    @_refusals
    async def complete(attempt_id: str, body: Result, request: Request):
        await gateway.settled(body.episode_id)
        gateway.refuse_lost(body.episode_id)
        attempt, episode = await run(
            tasks.complete,
            attempt_id,
            body.episode_id,
            reward=body.reward,
            metrics=body.metrics,
            call_rewards=body.call_rewards,
        )
        gateway.forget(episode)
        return sent(attempt, root_url(request))

    @router.post("/attempts/{attempt_id}/fail")
    @_refusals
    async def fail(attempt_id: str, body: Failure, request: Request):
        await gateway.settled(body.episode_id)
        reason = gateway.redact(body.reason)[0]  # an agent's exception text, often quoting what it was given
        attempt, episode = await run(tasks.fail, attempt_id, body.episode_id, reason)
        gateway.forget(episode)
        return sent(attempt, root_url(request))

    return router


class InProcessQueue(GroupQueue):
    """The queue as the server's own process reaches it (``flywheel loop`` beside its backend's server): tasks
    enqueued and read in the store, groups exported from it once the gateway wrote their calls (what ``POST /tasks``,
    ``GET /tasks/{id}`` and ``GET /groups`` do, without the HTTP round trips); runners still claim over HTTP."""

    def __init__(self, gateway: Gateway, root: str):
        self.gateway, self.where = gateway, root

    async def submit(self, spec: TaskSpec) -> Task:
        task, _ = await self.gateway.store.run(tasks.enqueue, **spec.model_dump())
        return Task.of(task)

    async def task(self, task_id: str) -> Task:
        task, attempts = await self.gateway.store.run(tasks.get_task, task_id)
        return Task.of(task, [sent(a, self.where) for a in attempts])

    async def group(self, task_id: str, *, split: str | None = None, text_only: TextOnly = "refuse") -> TrajectoryGroup:
        await self.gateway.settled()  # every episode's queued calls: the task's are among them
        return await self.gateway.store.run(task_group, task_id, split, text_only=text_only == "allow")
