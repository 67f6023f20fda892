"""A Python client of the episode API (httpx; imports no torch: an agent's or a runner's process can use it).

Usage::

    client = EpisodeClient("http://127.0.0.1:8000")
    episode = await client.create("task-17")
    agent = AsyncOpenAI(base_url=episode.base_url, api_key="-")  # the agent's one-line change
    ...  # the agent runs, unmodified
    await client.finish(episode.id, reward=1.0)
    group = await client.group("task-17")  # a TrajectoryGroup, ready for model.train

and the rollout queue (``QueueClient``): the training side enqueues tasks and awaits their groups while runners
anywhere (``flywheel.gateway.runner``) claim attempts and post their results::

    queue = QueueClient("http://127.0.0.1:8000")
    groups = await queue.gather_groups([TaskSpec(task_id="task-17", payload={...}, group_size=4)], max_wait=600)
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import httpx

from flywheel.gateway.schemas import Attempt, Episode, Lease, Task, TaskSpec
from flywheel.types import Trajectory, TrajectoryGroup

TextOnly = Literal["refuse", "allow"]  # episodes with text-only calls: refused (for RL) or allowed (SFT, evaluation)


def error_message(response: httpx.Response, text_limit: int | None = None) -> str:
    """What a refused request was told: the message of an error in OpenAI's shape, else the body's text (its first
    ``text_limit`` characters)."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:text_limit]


class GatewayError(RuntimeError):
    """The gateway refused a request; ``status`` is its HTTP status, the message its explanation."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class EpisodeClient:
    """``url``: the server's root (``http://host:port``; a trailing ``/v1`` is dropped)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 60.0):
        root = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=root, headers=headers, timeout=timeout)

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise GatewayError(response.status_code, error_message(response))
        return (
            response.json()
            if response.headers.get("content-type", "").startswith("application/json")
            else response.text
        )

    async def create(
        self, task_id: str, *, split: str = "train", model: str | None = None, metadata: dict[str, Any] | None = None
    ) -> Episode:
        body = {"task_id": task_id, "split": split, "model": model, "metadata": metadata or {}}
        return Episode.model_validate(await self._call("POST", "/episodes", json=body))

    async def get(self, episode_id: str) -> Episode:
        return Episode.model_validate(await self._call("GET", f"/episodes/{episode_id}"))

    async def list(self, **filters: Any) -> list[Episode]:
        params = {k: v for k, v in filters.items() if v is not None}
        return [Episode.model_validate(e) for e in (await self._call("GET", "/episodes", params=params))["data"]]

    def _outcome(self, reward, metrics, call_rewards) -> dict[str, Any]:
        return {"reward": reward, "metrics": metrics or {}, "call_rewards": call_rewards or {}}

    async def reward(
        self,
        episode_id: str,
        reward: float | None = None,
        *,
        metrics: dict[str, float | int | bool] | None = None,
        call_rewards: dict[int, float] | None = None,
    ) -> Episode:
        """Record (or replace) an open episode's reward, metrics and per-call rewards."""
        body = self._outcome(reward, metrics, call_rewards)
        return Episode.model_validate(await self._call("POST", f"/episodes/{episode_id}/reward", json=body))

    async def finish(
        self,
        episode_id: str,
        reward: float | None = None,
        *,
        metrics: dict[str, float | int | bool] | None = None,
        call_rewards: dict[int, float] | None = None,
    ) -> Episode:
        """Close an episode with its outcome (a reward now or posted before); retrying is safe."""
        body = self._outcome(reward, metrics, call_rewards)
        return Episode.model_validate(await self._call("POST", f"/episodes/{episode_id}/finish", json=body))

    async def abandon(self, episode_id: str, reason: str | None = None) -> Episode:
        return Episode.model_validate(
            await self._call("POST", f"/episodes/{episode_id}/abandon", json={"reason": reason})
        )

    async def feedback(
        self,
        episode_id: str,
        kind: str,
        value: float,
        *,
        note: str | None = None,
        source: str | None = None,
        key: str | None = None,
    ) -> dict[str, Any]:
        """Outcome feedback that arrived later (``resolved``, ``rating``, ``kpi/<name>``), in any state; ``key``:
        your id for it, so that sending it again is harmless."""
        body = {"kind": kind, "value": value, "note": note, "source": source, "key": key}
        return await self._call("POST", f"/episodes/{episode_id}/feedback", json=body)

    async def feedback_of(self, episode_id: str) -> list[dict[str, Any]]:
        return (await self._call("GET", f"/episodes/{episode_id}/feedback"))["data"]

    async def calls(self, episode_id: str) -> list[dict[str, Any]]:
        return (await self._call("GET", f"/episodes/{episode_id}/calls"))["data"]

    async def trajectory(self, episode_id: str, *, text_only: TextOnly = "refuse") -> Trajectory:
        """The finished episode as a trajectory; ``text_only="allow"``: also one with text-only calls (an upstream
        returned no token ids: for SFT, graders and evaluation, not RL), else that is a 409 ``GatewayError``."""
        params = {"text_only": text_only}
        return Trajectory.model_validate(await self._call("GET", f"/episodes/{episode_id}/trajectory", params=params))

    async def group(self, task_id: str, *, split: str | None = None, text_only: TextOnly = "refuse") -> TrajectoryGroup:
        """The task's finished episodes as a group (``text_only`` as for ``trajectory``)."""
        params = {"split": split} if split else {}
        body = await self._call("GET", "/groups", params={"task_id": task_id, "text_only": text_only, **params})
        trajectories = [Trajectory.model_validate(t) for t in body["trajectories"]]
        return TrajectoryGroup(trajectories, metrics=body.get("metrics"))  # e.g. the episodes it left out

    async def transitions(self, episode_id: str, *, text_only: TextOnly = "refuse") -> str:
        """The episode as transitions, JSON lines (``flywheel.agents.transitions``; ``text_only`` as for
        ``trajectory``)."""
        return await self._call("GET", f"/episodes/{episode_id}/transitions", params={"text_only": text_only})

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EpisodeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class TaskFailedError(RuntimeError):
    """Tasks whose groups will not be complete: an attempt used up its tries."""


class QueueTimeoutError(TimeoutError):
    """Tasks still running when the wait ended."""


class GroupQueue(ABC):
    """Queued tasks' groups, waited for the same way whatever reaches the queue: ``QueueClient`` over HTTP, or the
    server's own process through ``InProcessQueue`` (``flywheel.gateway.queue``)."""

    where: str  # the server whose runners the tasks wait for: named when they time out

    @abstractmethod
    async def submit(self, spec: TaskSpec) -> Task:
        """Queue a task (the same task again is accepted and changes nothing)."""

    @abstractmethod
    async def task(self, task_id: str) -> Task:
        """The task with its attempts."""

    @abstractmethod
    async def group(self, task_id: str, *, split: str | None = None, text_only: TextOnly = "refuse") -> TrajectoryGroup:
        """The task's finished episodes as a group."""

    async def gather_groups(
        self, tasks: Iterable[TaskSpec], *, max_wait: float, poll_interval: float = 0.5, allow_failed: bool = False
    ) -> list[TrajectoryGroup]:
        """Enqueue ``tasks``, wait for runners to run them, and return their groups, in order (``wait_groups``)."""
        specs = list(tasks)
        for spec in specs:
            await self.submit(spec)
        return await self.wait_groups(
            [spec.task_id for spec in specs], max_wait=max_wait, poll_interval=poll_interval, allow_failed=allow_failed
        )

    async def wait_groups(
        self, task_ids: Sequence[str], *, max_wait: float, poll_interval: float = 0.5, allow_failed: bool = False
    ) -> list[TrajectoryGroup]:
        """The groups of queued tasks, in order, once none of them has an attempt queued or leased: each a
        ``TrajectoryGroup`` of its finished episodes. A ``QueueTimeoutError`` after ``max_wait`` seconds, naming the
        tasks still running; a ``TaskFailedError`` for failed tasks unless ``allow_failed`` (their groups are then
        smaller)."""
        deadline = time.monotonic() + max_wait
        done: dict[str, Task] = {}
        while True:
            for task_id in dict.fromkeys(task_ids):
                if task_id not in done and (task := await self.task(task_id)).status != "open":
                    done[task_id] = task
            running = [t for t in dict.fromkeys(task_ids) if t not in done]
            if not running:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                counts = [await self.task(t) for t in running[:5]]
                raise QueueTimeoutError(
                    f"{len(running)} of {len(set(task_ids))} tasks were still running after {max_wait:g} s: "
                    + "; ".join(f"{t.id} ({_counts(t)})" for t in counts)
                    + ("; ..." if len(running) > 5 else "")
                    + f". Are runners claiming from {self.where}? (flywheel runner --url ... --agent ...)"
                )
            await asyncio.sleep(min(poll_interval, left))
        if not allow_failed and (failed := [t for t in done.values() if t.status == "failed"]):
            raise TaskFailedError(
                f"{len(failed)} task(s) failed, their groups incomplete: "
                + "; ".join(
                    f"{t.id} ({_counts(t)}; last error: {next((a.error for a in t.attempts if a.status == 'failed'), None)})"
                    for t in failed[:5]
                )
            )
        return [await self.group(task_id, split=done[task_id].split) for task_id in task_ids]


class QueueClient(EpisodeClient, GroupQueue):
    """The rollout queue (and the episode API): the training side's ``enqueue`` and ``gather_groups``, a runner's
    ``claim``, ``heartbeat``, ``complete`` and ``fail``."""

    @property
    def where(self) -> str:
        return str(self._http.base_url)

    async def enqueue(
        self,
        task_id: str,
        payload: dict[str, Any],
        *,
        group_size: int,
        split: str = "train",
        model: str | None = None,
        max_tries: int = 3,
    ) -> Task:
        """Queue a task (the same task again is accepted and changes nothing)."""
        spec = TaskSpec(task_id=task_id, payload=payload, group_size=group_size, split=split, model=model,
                        max_tries=max_tries)  # fmt: skip
        return await self.submit(spec)

    async def submit(self, spec: TaskSpec) -> Task:
        return Task.model_validate(await self._call("POST", "/tasks", json=spec.model_dump()))

    async def task(self, task_id: str) -> Task:
        return Task.model_validate(await self._call("GET", f"/tasks/{task_id}"))

    async def tasks(self, *, status: str | None = None, limit: int = 100, offset: int = 0) -> list[Task]:
        params = {"limit": limit, "offset": offset} | ({"status": status} if status else {})
        return [Task.model_validate(t) for t in (await self._call("GET", "/tasks", params=params))["data"]]

    async def claim(self, runner: str, *, lease_seconds: float = 60.0) -> Lease | None:
        """Lease the oldest queued attempt; None when nothing is queued."""
        body = await self._call("POST", "/tasks/claim", json={"runner": runner, "lease_seconds": lease_seconds})
        return Lease.model_validate(body) if body else None

    async def heartbeat(self, attempt_id: str, episode_id: str, *, lease_seconds: float | None = None) -> Attempt:
        """Extend a lease (a ``GatewayError`` 409 once it is over: stop, the attempt is someone else's)."""
        body = {"episode_id": episode_id, "lease_seconds": lease_seconds}
        return Attempt.model_validate(await self._call("POST", f"/attempts/{attempt_id}/heartbeat", json=body))

    async def complete(
        self,
        attempt_id: str,
        episode_id: str,
        reward: float,
        *,
        metrics: dict[str, float | int | bool] | None = None,
        call_rewards: dict[int, float] | None = None,
    ) -> Attempt:
        """Post the result of a leased attempt (retrying is safe; a 409 if the lease is over)."""
        body = {"episode_id": episode_id} | self._outcome(reward, metrics, call_rewards)
        return Attempt.model_validate(await self._call("POST", f"/attempts/{attempt_id}/complete", json=body))

    async def fail(self, attempt_id: str, episode_id: str, reason: str) -> Attempt:
        """Give a leased attempt back without a result: it is requeued (a try counted) or, out of tries, failed."""
        body = {"episode_id": episode_id, "reason": reason}
        return Attempt.model_validate(await self._call("POST", f"/attempts/{attempt_id}/fail", json=body))


def _counts(task: Task) -> str:
    return ", ".join(f"{n} {status}" for status, n in task.counts.items() if n) + f" of {task.group_size}"
