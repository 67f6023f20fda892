"""LocalBackend: loads models in-process, runs their engines, and serves them over HTTP on loopback."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import load_model
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer

if TYPE_CHECKING:
    from flywheel.model import TrainableModel


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
    ):
        self.path = Path(path) if path is not None else default_home()
        self.registry = ModelRegistry()
        self._engines: dict[str, InferenceEngine] = {}
        self._dtype, self._max_batch = dtype, max_batch
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
        """The loaded engine of a base model (after ``register``)."""
        return self._engines[base_model]

    async def load(self, base_model: str) -> InferenceEngine:
        async with self._lock:
            if base_model not in self._engines:
                model, tokenizer, resolved = await asyncio.to_thread(load_model, base_model, dtype=self._dtype)
                engine = InferenceEngine(model, tokenizer, max_batch=self._max_batch)
                self._engines[base_model] = engine
                self.registry.add(base_model, engine)
                if resolved.name != base_model:
                    self.registry.add(resolved.name, engine)
            if self._serve_http and self._server is None:
                self._server = BackgroundServer(create_app(self.registry), self._host, self._port).start()
            return self._engines[base_model]

    async def register(self, model: TrainableModel) -> None:
        engine = await self.load(model.base_model)
        step = await self.get_step(model)
        self.registry.add(model.name, engine, owned_by=model.project)
        self.registry.add(model.get_inference_name(step), engine, owned_by=model.project)

    def model_dir(self, model: TrainableModel) -> Path:
        return self.path / model.project / "models" / model.name

    async def get_step(self, model: TrainableModel) -> int:
        """The latest checkpoint step (0 before any training)."""
        checkpoints = self.model_dir(model) / "checkpoints"
        steps = [int(p.name) for p in checkpoints.glob("[0-9]*") if p.is_dir() and p.name.isdigit()]
        return max(steps, default=0)

    async def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
