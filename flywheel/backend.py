"""LocalBackend: loads models in-process, runs their engines, and serves them over HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flywheel.gather import phase_seconds
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import load_model
from flywheel.inference.registry import ModelRegistry, ServedModel
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.train.config import LoraSettings, SFTConfig, TrainConfig
from flywheel.train.trainer import Trainer, load_for_serving
from flywheel.types import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from flywheel.model import TrainableModel

MAX_CHECKPOINT_ENGINES = 2  # earlier checkpoints served at once (each holds a copy of the base weights)


def metric_means(trajectories: list[Trajectory], split: str) -> dict[str, float]:
    """``<split>/<name>``: the mean of each trajectory metric over the trajectories that have it."""
    means = {}
    for k in sorted({k for t in trajectories for k in t.metrics}):
        values = [float(t.metrics[k]) for t in trajectories if k in t.metrics]
        means[f"{split}/{k}"] = sum(values) / len(values)
    return means


def default_home() -> Path:
    """Project data (checkpoints, logs): ``$FLYWHEEL_HOME`` or ``./.flywheel``."""
    return Path(os.environ.get("FLYWHEEL_HOME") or ".flywheel")


class LocalBackend:
    """Everything on this machine: one engine per base model, shared by all models registered on it.

    The engine samples with the same weights the trainer updates (one process, one copy), and the same engine
    is reachable over HTTP at ``base_url`` for agents running in other processes.
    """

    def __init__(
        self,
        *,
        path: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        serve_http: bool = True,
        dtype: torch.dtype | None = None,
        max_batch: int = 64,
        compile: bool = False,
    ):
        """``compile``: engines decode with a compiled step (``InferenceEngine(compile=True)``: faster sampling at
        few concurrent rows, ~1-2 minutes to compile per engine, needs a C++ compiler)."""
        self.path = Path(path) if path is not None else default_home()
        self.registry = ModelRegistry(loader=self._serve_checkpoint)
        self._engines: dict[str, InferenceEngine] = {}
        self._checkpoint_engines: dict[str, InferenceEngine] = {}  # "name@step" of earlier steps, oldest first
        self._checkpoint_lock = threading.Lock()
        self._trainers: dict[tuple[str, str], Trainer] = {}  # (project, name) -> trainer on its own engine
        self._dtype, self._max_batch, self._compile = dtype, max_batch, compile
        self._host, self._port, self._serve_http = host, port, serve_http
        self._server: BackgroundServer | None = None
        self._lock = asyncio.Lock()

    @property
    def serves_http(self) -> bool:
        return self._serve_http

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("The HTTP server is not running: register a model first (or serve_http=False).")
        return self._server.base_url

    def engine(self, base_model: str) -> InferenceEngine:
        """The engine serving a base model as is (after ``load``)."""
        return self._engines[base_model]

    async def _engine(self, base_model: str) -> tuple[InferenceEngine, str]:
        model, tokenizer, resolved = await asyncio.to_thread(load_model, base_model, dtype=self._dtype)
        return InferenceEngine(model, tokenizer, max_batch=self._max_batch, compile=self._compile), resolved.name

    def _serve(self) -> None:
        if self._serve_http and self._server is None:
            self._server = BackgroundServer(create_app(self.registry), self._host, self._port).start()

    async def load(self, base_model: str) -> InferenceEngine:
        """Serve a base model as is (no adapter), e.g. as a judge or a baseline."""
        async with self._lock:
            if base_model not in self._engines:
                engine, resolved_name = await self._engine(base_model)
                self._engines[base_model] = engine
                for name in {base_model, resolved_name}:
                    self.registry.add(name, engine)
            self._serve()
            return self._engines[base_model]

    async def register(self, model: TrainableModel, lora: LoraSettings | None = None) -> None:
        """Give the model its own engine (its own copy of the base weights, with a LoRA adapter) and resume
        from its latest checkpoint if it has one."""
        key = (model.project, model.name)
        async with self._lock:
            if key not in self._trainers:
                engine, _ = await self._engine(model.base_model)
                try:  # model work runs on the engine's thread (see InferenceEngine.call)
                    trainer = await engine.call(Trainer, engine, lora)
                    latest = self._latest_checkpoint(model)
                    if latest is not None:
                        await engine.call(trainer.load, latest)
                except BaseException:
                    engine.close()
                    raise
                self._trainers[key] = trainer
            self._serve()
        self._publish(model)

    def trainer(self, model: TrainableModel) -> Trainer:
        try:
            return self._trainers[(model.project, model.name)]
        except KeyError:
            raise RuntimeError(f"Model '{model.name}' is not registered with this backend.") from None

    def _publish(self, model: TrainableModel) -> None:
        """Serve the live weights as ``name`` and ``name@<step>``; an older ``name@k`` on the live engine would
        lie, so it goes (a request for it then loads checkpoint k: ``_serve_checkpoint``)."""
        trainer = self.trainer(model)
        prefix = f"{model.name}@"
        for served in self.registry.all():
            if served.name.startswith(prefix) and served.engine is trainer.engine:
                self.registry.remove(served.name)
        for name in (model.name, model.get_inference_name(trainer.step)):
            self.registry.add(name, trainer.engine, owned_by=model.project)

    def _serve_checkpoint(self, served_name: str) -> ServedModel | None:
        """The registry's loader: ``name@step`` of a registered model at an earlier checkpoint gets an engine of
        its own (a fresh base model with that checkpoint's weights); the last ``MAX_CHECKPOINT_ENGINES`` stay."""
        name, _, step = served_name.rpartition("@")
        owners = [(key, t) for key, t in self._trainers.items() if key[1] == name]
        if not step.isdigit() or len(owners) != 1:
            return None
        (project, _), trainer = owners[0]
        directory = self.path / project / "models" / name / "checkpoints" / f"{int(step):04d}"
        if not directory.is_dir():
            return None
        with self._checkpoint_lock:  # one load at a time; a second request for the same step waits for the first
            if served_name not in self._checkpoint_engines:
                base, tokenizer, _ = load_model(trainer.engine.model.name_or_path, dtype=self._dtype)
                load_for_serving(base, directory)
                self._checkpoint_engines[served_name] = InferenceEngine(
                    base, tokenizer, max_batch=self._max_batch, compile=self._compile
                )
                self.registry.add(served_name, self._checkpoint_engines[served_name], owned_by=project)
                while len(self._checkpoint_engines) > MAX_CHECKPOINT_ENGINES:
                    oldest = next(iter(self._checkpoint_engines))
                    self.registry.remove(oldest)
                    self._checkpoint_engines.pop(oldest).close()
            return self.registry.get(served_name)

    def model_dir(self, model: TrainableModel) -> Path:
        return self.path / model.project / "models" / model.name

    def _latest_checkpoint(self, model: TrainableModel) -> Path | None:
        checkpoints = self.model_dir(model) / "checkpoints"
        steps = sorted((int(p.name), p) for p in checkpoints.glob("[0-9]*") if p.is_dir() and p.name.isdigit())
        return steps[-1][1] if steps else None

    async def restore(self, model: TrainableModel, step: int) -> None:
        """Load checkpoint ``step`` into the live adapter (e.g. the best one, for a final evaluation)."""
        directory = self.model_dir(model) / "checkpoints" / f"{step:04d}"
        if not directory.exists():
            raise FileNotFoundError(f"No checkpoint for step {step} at {directory}.")
        trainer = self.trainer(model)
        await trainer.engine.call(trainer.load, directory)
        self._publish(model)

    async def get_step(self, model: TrainableModel) -> int:
        """Optimizer steps taken so far (0 before any training)."""
        key = (model.project, model.name)
        if key in self._trainers:
            return self._trainers[key].step
        latest = self._latest_checkpoint(model)
        return int(latest.name) if latest is not None else 0

    # ---- training ----------------------------------------------------------------------------------------------

    async def train(self, model: TrainableModel, groups: Iterable[TrajectoryGroup], config: TrainConfig) -> dict[str, float]:
        trainer = self.trainer(model)
        groups = list(groups)
        trajectories = [t for g in groups for t in g.trajectories]
        metrics = await trainer.engine.call(trainer.rl_step, groups, config)
        metrics |= phase_seconds(groups) | metric_means(trajectories, "train")
        await self._after_step(model, trainer, metrics, "train", config.model_dump())
        self._save_trajectories(model, "train", trainer.step, trajectories)
        return metrics

    async def train_sft(self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig) -> list[dict[str, float]]:
        trainer = self.trainer(model)
        history = await trainer.engine.call(trainer.sft, trajectories, config)
        for i, metrics in enumerate(history):
            self._append_history(model, {"step": trainer.step - len(history) + i + 1, "split": "sft", **metrics})
        await self._after_step(model, trainer, None, "sft", config.model_dump())
        return history

    async def _after_step(self, model: TrainableModel, trainer: Trainer, metrics, split: str, config: dict) -> None:
        if metrics is not None:
            self._append_history(model, {"step": trainer.step, "split": split, **metrics})
            if metrics.get("skipped"):
                return
        directory = self.model_dir(model) / "checkpoints" / f"{trainer.step:04d}"
        await asyncio.to_thread(trainer.save, directory, {"last_config": config, "last_split": split})
        self._publish(model)

    def _append_history(self, model: TrainableModel, row: dict) -> None:
        path = self.model_dir(model) / "history.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"time": time.time(), **row}) + "\n")

    def history(self, model: TrainableModel) -> list[dict]:
        path = self.model_dir(model) / "history.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def _save_trajectories(self, model: TrainableModel, split: str, step: int, trajectories: list[Trajectory]) -> None:
        directory = self.model_dir(model) / "trajectories" / split
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / f"{step:04d}.jsonl").open("a") as f:
            for t in trajectories:
                f.write(t.model_dump_json() + "\n")

    async def log(self, model: TrainableModel, trajectories: list[Trajectory], split: str) -> dict[str, float]:
        """Record evaluation trajectories and their mean reward/metrics as ``<split>/...`` at the current step."""
        step = await self.get_step(model)
        metrics: dict[str, float] = {}
        if trajectories:
            metrics[f"{split}/reward"] = sum(t.reward for t in trajectories) / len(trajectories)
            metrics |= metric_means(trajectories, split) | {f"{split}/n": len(trajectories)}
        self._append_history(model, {"step": step, "split": split, **metrics})
        self._save_trajectories(model, split, step, trajectories)
        return metrics

    async def delete_checkpoints(self, model: TrainableModel, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Keep the latest checkpoint and the best one by ``best_checkpoint_metric``; return the deleted steps."""
        checkpoints = self.model_dir(model) / "checkpoints"
        steps = sorted(int(p.name) for p in checkpoints.glob("[0-9]*") if p.name.isdigit())
        scored = [(r[best_checkpoint_metric], r["step"]) for r in self.history(model) if best_checkpoint_metric in r]
        keep = {steps[-1]} if steps else set()
        if scored:
            best = max(scored)[1]  # ties: the later step
            keep.add(best)
        deleted = [s for s in steps if s not in keep]
        for s in deleted:
            shutil.rmtree(checkpoints / f"{s:04d}", ignore_errors=True)
        return deleted

    async def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        for engine in [*self._engines.values(), *(t.engine for t in self._trainers.values()), *self._checkpoint_engines.values()]:
            engine.close()
        self._engines.clear()
        self._trainers.clear()
        self._checkpoint_engines.clear()
        for served in self.registry.all():  # drop the last references to the engines' models
            self.registry.remove(served.name)

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
