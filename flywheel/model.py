"""Model handles, as in ART: ``Model`` for any OpenAI-compatible endpoint, ``TrainableModel`` for ours.

Both take ART's arguments: ``config`` (any pydantic model of the script's own, e.g. ``max_turns``; the class is
generic in it, ``TrainableModel[MyConfig]``), ``entity``, and for a trainable one ``_internal_config`` (ART's
engine settings, ``flywheel.dev``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from openai import AsyncOpenAI, Timeout
from pydantic import BaseModel, PrivateAttr, SerializeAsAny, field_validator

from flywheel import dev
from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights
from flywheel.types import TrainResult, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from typing_extensions import Unpack

ModelConfig = TypeVar("ModelConfig", bound=BaseModel | None)

# ART's client settings: a rollout may wait long for a busy engine, a connection should not
OPENAI_TIMEOUT = Timeout(timeout=1200, connect=5.0)


class Model(BaseModel, Generic[ModelConfig]):
    """A model reached through an OpenAI-compatible API (e.g. a judge, or a hosted model to compare against)."""

    name: str
    project: str
    entity: str | None = None  # ART's W&B entity: kept with the model, not used here
    config: SerializeAsAny[ModelConfig] | None = None  # the script's own settings (a pydantic model)
    inference_model_name: str | None = None
    inference_base_url: str | None = None
    inference_api_key: str | None = None
    trainable: bool = False
    base_path: str | None = None  # the backend's directory, under which `<project>/models/<name>/` is (register)

    _openai_client: AsyncOpenAI | None = PrivateAttr(default=None)
    _backend: Backend | None = PrivateAttr(default=None)

    @field_validator("config", mode="before")
    @classmethod
    def _config_is_a_pydantic_model(cls, config: Any) -> Any:
        if config is not None and not isinstance(config, BaseModel):
            raise ValueError(
                f"config must be a pydantic model (class MyConfig(BaseModel): ...), got {type(config).__name__}"
            )
        return config

    def get_inference_name(self, step: int | None = None) -> str:
        return self.inference_model_name or self.name

    def _base_url(self) -> str:
        if not self.inference_base_url:
            raise RuntimeError(f"Model '{self.name}' has no inference_base_url.")
        return self.inference_base_url

    def openai_client(self) -> AsyncOpenAI:
        """One AsyncOpenAI client for the model (made on first use, made again if its URL or key changes), with
        ART's settings: the SDK's retries of connection errors, 429s and 5xx (2), a 20-minute timeout."""
        client = self._openai_client
        api_key = self.inference_api_key or "flywheel"
        if (
            client is None
            or str(client.base_url).rstrip("/") != self._base_url().rstrip("/")
            or client.api_key != api_key
        ):
            client = AsyncOpenAI(
                base_url=self._base_url(),
                api_key=api_key,
                timeout=OPENAI_TIMEOUT,
            )
            self._openai_client = client
        return client

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for ``litellm.acompletion`` (used by RULER and model graders); ``step``: a checkpoint
        of a trainable model (``name@step``)."""
        return {
            "model": f"openai/{self.get_inference_name(step)}",
            "api_base": self._base_url(),
            "api_key": self.inference_api_key or "flywheel",
        }

    async def register(self, backend: Backend) -> None:
        """Logs of this model (e.g. a prompted baseline, ``log``) go to ``backend``'s directory; nothing loads."""
        self._backend = backend
        self.base_path = str(backend.path)

    def backend(self) -> Backend:
        """The backend the model is registered with."""
        if self._backend is None:
            raise RuntimeError(f"Model '{self.name}' is not registered: call `await model.register(backend)` first.")
        return self._backend

    async def get_step(self) -> int:
        """0: a model Flywheel does not train has no steps."""
        return 0

    async def log(
        self,
        trajectories: Iterable[Trajectory | TrajectoryGroup | BaseException] | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Records trajectories (or groups of them) of a split, their mean reward and metrics as ``<split>/...``,
        and ``metrics`` given (e.g. ``backend.train``'s), at ``step`` (default: the current one). Exceptions (from
        ``gather_trajectories``) count in ``<split>/exceptions``. Trajectories that ``train`` already recorded
        at that step are not written twice."""
        items = list(trajectories or [])
        flat = [t for item in items for t in (item.trajectories if isinstance(item, TrajectoryGroup) else [item])]
        failed = sum(isinstance(t, BaseException) for t in flat) + sum(
            len(item.exceptions) for item in items if isinstance(item, TrajectoryGroup)
        )
        metrics = dict(metrics or {}) | ({"exceptions": failed} if failed else {})
        kept = [t for t in flat if isinstance(t, Trajectory)]
        return await self.backend().log(self, kept, split, metrics, step)


class Backend(Protocol):
    """What a ``Model`` (its logs) and a ``TrainableModel`` need of a backend: ``flywheel.LocalBackend`` runs
    everything in this process; an out-of-process one (a remote engine and trainer) implements the same methods."""

    path: Path  # where its models' directories are

    @property
    def serves_http(self) -> bool: ...
    @property
    def base_url(self) -> str: ...
    async def register(self, model: TrainableModel, trained_weights: TrainedWeights | None = None) -> None: ...
    async def get_step(self, model: Model) -> int: ...
    async def train(
        self,
        model: TrainableModel,
        groups: Iterable[TrajectoryGroup | None],
        config: TrainConfig | None = None,
        *,
        save_checkpoint: bool = True,
        extra: dict | None = None,
        metrics: dict[str, float] | None = None,
        verbose: bool = False,
        **options: Unpack[dev.TrainOptions],
    ) -> TrainResult: ...
    def checkpoint_extra(self, model: TrainableModel) -> dict: ...
    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: list[Trajectory],
        config: SFTConfig,
        progress: Callable[[dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]: ...
    async def log(
        self,
        model: Model,
        trajectories: list[Trajectory],
        split: str,
        extra_metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]: ...
    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str = "val/reward", *, maximize: bool = True
    ) -> list[int]: ...


class TrainableModel(Model[ModelConfig], Generic[ModelConfig]):
    """A model Flywheel samples from and trains: ``await model.register(LocalBackend())`` before use.
    ``_internal_config``: ART's engine settings (``flywheel.dev.InternalModelConfig``); its LoRA shape and full
    fine-tuning apply on top of ``trained_weights``, the rest is ignored with a warning."""

    base_model: str
    trainable: bool = True
    trained_weights: TrainedWeights = TrainedWeights()
    _internal_config: dev.InternalModelConfig | None = PrivateAttr(default=None)

    def __init__(self, *, _internal_config: dev.InternalModelConfig | None = None, **data: Any) -> None:
        super().__init__(**data)
        self._internal_config = _internal_config

    async def register(self, backend: Backend) -> None:
        weights = self.trained_weights
        if self._internal_config:
            weights = dev.trained_weights(self._internal_config, weights)
        await backend.register(self, weights)
        await super().register(backend)
        if backend.serves_http:
            self.inference_base_url = backend.base_url
        self.inference_api_key = self.inference_api_key or "flywheel"

    def get_inference_name(self, step: int | None = None) -> str:
        return self.name if step is None else f"{self.name}@{step}"

    async def get_step(self) -> int:
        return await self.backend().get_step(self)

    async def train(
        self,
        groups: Iterable[TrajectoryGroup | None],
        config: TrainConfig | None = None,
        _config: dev.TrainConfig | None = None,
        verbose: bool = False,
        *,
        save_checkpoint: bool = True,
        extra: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """One RL optimizer step on these groups; the next rollout samples from the updated weights; returns its
        metrics. ``save_checkpoint=False`` skips its checkpoint (the history row still goes in); ``extra`` (JSON)
        is stored with the checkpoint and comes back from ``checkpoint_extra()`` after a resume, e.g. a data
        position; ``metrics``, the caller's own figures of the step (``MixedGroups.metrics()``: groups drawn, kept
        and dropped by dynamic sampling), go in its history row. ``_config``: ART's ``art.dev.TrainConfig`` options
        (mapped, see ``flywheel.dev``); ``verbose`` prints the step's metrics. A None among the groups (a group RULER could not score, with
        ``swallow_exceptions=True``) is left out with a warning."""
        result = await self.backend().train(
            self,
            groups,
            config,
            save_checkpoint=save_checkpoint,
            extra=extra,
            metrics=metrics,
            verbose=verbose,
            **(_config or {}),
        )
        return result.metrics

    async def checkpoint_extra(self) -> dict[str, Any]:
        """The ``extra`` of the checkpoint the weights come from (the latest after a resume); ``{}`` if none."""
        return self.backend().checkpoint_extra(self)

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
        return await self.backend().train_sft(self, list(trajectories), config or SFTConfig(), progress)

    async def delete_checkpoints(
        self, best_checkpoint_metric: str = "val/reward", *, maximize: bool = True
    ) -> list[int]:
        """Keep the latest checkpoint and the best one by the metric (lowest if not ``maximize``)."""
        return await self.backend().delete_checkpoints(self, best_checkpoint_metric, maximize=maximize)


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
