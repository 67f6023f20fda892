"""Which model names are served, and by which engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flywheel.inference.protocol import SamplingEngine


class UnknownModelError(KeyError):
    def __init__(self, name: str, known: list[str]):
        self.name = name
        super().__init__(f"The model '{name}' does not exist. Served models: {', '.join(known) or 'none'}.")

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class ServedModel:
    name: str
    engine: SamplingEngine  # the embedded InferenceEngine, or any other engine that samples
    owned_by: str = "flywheel"
    created: int = field(default_factory=lambda: int(time.time()))
    step: int | Callable[[], int] | None = None  # the checkpoint step it answers with (a callable: live weights)

    def current_step(self) -> int | None:
        return self.step() if callable(self.step) else self.step


class ModelRegistry:
    """Thread-safe map from public model names (``base``, ``name``, ``name@step``) to engines.

    ``loader``, if given, is asked (in a worker thread) for a name that is not served yet, e.g. an earlier
    checkpoint ``name@3``; it serves it (``add``) and returns it, or returns None for a name it does not know."""

    def __init__(self, loader: Callable[[str], ServedModel | None] | None = None) -> None:
        self._models: dict[str, ServedModel] = {}
        self._lock = threading.Lock()
        self._loader = loader

    def add(
        self,
        name: str,
        engine: SamplingEngine,
        owned_by: str = "flywheel",
        step: int | Callable[[], int] | None = None,
    ) -> None:
        with self._lock:
            self._models[name] = ServedModel(name=name, engine=engine, owned_by=owned_by, step=step)

    def remove(self, name: str) -> None:
        with self._lock:
            self._models.pop(name, None)

    def get(self, name: str) -> ServedModel:
        with self._lock:
            served = self._models.get(name)
            if served is None:
                raise UnknownModelError(name, sorted(self._models))
            return served

    async def resolve(self, name: str) -> ServedModel:
        """``get``, falling back on the loader (off the event loop: loading a model takes seconds)."""
        try:
            return self.get(name)
        except UnknownModelError:
            if self._loader is None or (served := await asyncio.to_thread(self._loader, name)) is None:
                raise
            return served

    def all(self) -> list[ServedModel]:
        with self._lock:
            return list(self._models.values())
