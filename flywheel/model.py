"""Model handles, as in ART: ``Model`` for any OpenAI-compatible endpoint, ``TrainableModel`` for ours."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from openai import AsyncOpenAI
from pydantic import BaseModel, PrivateAttr

from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights
from flywheel.types import Trajectory, TrajectoryGroup


class Model(BaseModel):
    """A model reached through an OpenAI-compatible API (e.g. a judge, or a hosted model to compare against)."""

    name: str
    project: str
    config: dict[str, Any] = {}
    inference_model_name: str | None = None
    inference_base_url: str | None = None
    inference_api_key: str | None = None
    trainable: bool = False

    def get_inference_name(self, step: int | None = None) -> str:
        return self.inference_model_name or self.name

    def _base_url(self) -> str:
        if not self.inference_base_url:
            raise RuntimeError(f"Model '{self.name}' has no inference_base_url.")
        return self.inference_base_url

    def openai_client(self) -> AsyncOpenAI:
        # max_retries=0: a failed rollout should surface at once, gather decides what to do with it
        return AsyncOpenAI(base_url=self._base_url(), api_key=self.inference_api_key or "flywheel", max_retries=0)

    def litellm_completion_params(self) -> dict[str, Any]:
        """Keyword arguments for ``litellm.acompletion`` (used by RULER and model graders)."""
        return {
            "model": f"openai/{self.get_inference_name()}",
            "api_base": self._base_url(),
            "api_key": self.inference_api_key or "flywheel",
        }


class Backend(Protocol):
    """What a ``TrainableModel`` needs of a backend: ``flywheel.LocalBackend`` runs everything in this process; an
    out-of-process one (a remote engine and trainer) implements the same methods."""

    @property
    def serves_http(self) -> bool: ...
    @property
    def base_url(self) -> str: ...
    async def register(self, model: TrainableModel, trained_weights: TrainedWeights | None = None) -> None: ...
    async def get_step(self, model: TrainableModel) -> int: ...
    async def train(
        self,
        model: TrainableModel,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig,
        *,
        save_checkpoint: bool = True,
        extra: dict | None = None,
    ) -> dict[str, float]: ...
    def checkpoint_extra(self, model: TrainableModel) -> dict: ...
    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: list[Trajectory],
        config: SFTConfig,
        progress: Callable[[dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]: ...
    async def log(self, model: TrainableModel, trajectories: list[Trajectory], split: str) -> dict[str, float]: ...
    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str = "val/reward", *, maximize: bool = True
    ) -> list[int]: ...


class TrainableModel(Model):
    """A model Flywheel samples from and trains: ``await model.register(LocalBackend())`` before use."""

    base_model: str
    trainable: bool = True
    trained_weights: TrainedWeights = TrainedWeights()
    _backend: Backend | None = PrivateAttr(default=None)

    async def register(self, backend: Backend) -> None:
        await backend.register(self, self.trained_weights)
        self._backend = backend
        if backend.serves_http:
            self.inference_base_url = backend.base_url
        self.inference_api_key = self.inference_api_key or "flywheel"

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"Model '{self.name}' is not registered: call `await model.register(backend)` first.")
        return self._backend

    def get_inference_name(self, step: int | None = None) -> str:
        return self.name if step is None else f"{self.name}@{step}"

    async def get_step(self) -> int:
        return await self.backend.get_step(self)

    async def train(
        self,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        save_checkpoint: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """One RL optimizer step on these groups; the next rollout samples from the updated weights.
        ``save_checkpoint=False`` skips its checkpoint (the history row still goes in); ``extra`` (JSON) is stored
        with the checkpoint and comes back from ``checkpoint_extra()`` after a resume, e.g. a data position."""
        return await self.backend.train(
            self, groups, config or TrainConfig(), save_checkpoint=save_checkpoint, extra=extra
        )

    async def checkpoint_extra(self) -> dict[str, Any]:
        """The ``extra`` of the checkpoint the weights come from (the latest after a resume); ``{}`` if none."""
        return self.backend.checkpoint_extra(self)

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory] | str | Path,
        config: SFTConfig | None = None,
        progress: Callable[[dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Supervised warm start on assistant turns. Accepts trajectories or a JSONL path of
        ``{"messages": [...], "tools": [...]}`` rows (OpenAI fine-tuning format) or of trajectories. ``progress``
        is called with each optimizer step's metrics (loss, tokens_trained, train_seconds...) as it is taken, from
        the engine's thread."""
        if isinstance(trajectories, (str, Path)):
            trajectories = _read_jsonl(Path(trajectories))
        return await self.backend.train_sft(self, list(trajectories), config or SFTConfig(), progress)

    async def log(self, trajectories: Iterable[Trajectory | TrajectoryGroup], split: str = "val") -> dict[str, float]:
        flat = [
            t for item in trajectories for t in (item.trajectories if isinstance(item, TrajectoryGroup) else [item])
        ]
        return await self.backend.log(self, flat, split)

    async def delete_checkpoints(
        self, best_checkpoint_metric: str = "val/reward", *, maximize: bool = True
    ) -> list[int]:
        """Keep the latest checkpoint and the best one by the metric (lowest if not ``maximize``)."""
        return await self.backend.delete_checkpoints(self, best_checkpoint_metric, maximize=maximize)


def _read_jsonl(path: Path) -> list[Trajectory]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "messages_and_choices" in row:
                rows.append(Trajectory.model_validate(row))
            else:
                rows.append(Trajectory(messages_and_choices=row["messages"], tools=row.get("tools")))
        except (json.JSONDecodeError, KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a trajectory or a {{'messages': [...]}} row: {exc}") from exc
    return rows
