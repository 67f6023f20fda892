"""A Python client of the episode API (httpx; imports no torch: an agent's or a runner's process can use it).

Usage::

    client = EpisodeClient("http://127.0.0.1:8000")
    episode = await client.create("task-17")
    agent = AsyncOpenAI(base_url=episode.base_url, api_key="-")  # the agent's one-line change
    ...  # the agent runs, unmodified
    await client.finish(episode.id, reward=1.0)
    group = await client.group("task-17")  # a TrajectoryGroup, ready for model.train
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
from pydantic import BaseModel

from flywheel.types import Trajectory, TrajectoryGroup


class GatewayError(RuntimeError):
    """The gateway refused a request; ``status`` is its HTTP status, the message its explanation."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class Episode(BaseModel):
    id: str
    task_id: str
    split: str
    model: str | None
    status: str
    reward: float | None
    metrics: dict[str, Any]
    meta: dict[str, Any]
    created_at: datetime
    finished_at: datetime | None
    base_url: str  # point the agent's OpenAI client here


class EpisodeClient:
    """``url``: the server's root (``http://host:port``; a trailing ``/v1`` is dropped)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 60.0):
        root = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=root, headers=headers, timeout=timeout)

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise GatewayError(response.status_code, message)
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

    async def calls(self, episode_id: str) -> list[dict[str, Any]]:
        return (await self._call("GET", f"/episodes/{episode_id}/calls"))["data"]

    async def trajectory(self, episode_id: str) -> Trajectory:
        return Trajectory.model_validate(await self._call("GET", f"/episodes/{episode_id}/trajectory"))

    async def group(self, task_id: str, *, split: str | None = None) -> TrajectoryGroup:
        params = {"split": split} if split else {}
        body = await self._call("GET", "/groups", params={"task_id": task_id, **params})
        return TrajectoryGroup([Trajectory.model_validate(t) for t in body["trajectories"]])

    async def transitions(self, episode_id: str) -> str:
        """The episode as transitions, JSON lines (``flywheel.agents.transitions``)."""
        return await self._call("GET", f"/episodes/{episode_id}/transitions")

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EpisodeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
