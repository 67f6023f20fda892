"""LoRA checkpoints served by vLLM (issue #40, live weight sync, first slice): versioned adapters and the loader of
``flywheel serve --vllm``.

``AdapterVersions`` keeps, per model, the versions loaded into a ``VLLMPool``: each checkpoint step is an adapter
of its own name, ``calc@6`` (never a name loaded again in place, so a request in flight never sees its adapter
change), and ``retire(name, keep)`` unloads the versions not kept once none of their requests is in flight
(``VLLMPool.unload_adapter``). Its calls for one model are made one at a time by the caller (the serve loader's lock).

``CheckpointAdapters`` is the model registry's loader on a server whose base model vLLM samples: a request for
``NAME@k``, where ``NAME`` is a model under the Flywheel home (``<home>/<project>/models/NAME``) and ``k`` a complete
LoRA checkpoint of it, loads that checkpoint's directory as it is (peft's ``adapter_config.json`` and
``adapter_model.safetensors``) into every vLLM server as the adapter ``NAME@k`` and serves it through its view, so
each recorded call names step ``k``. It keeps the last ``max_loaded`` loaded: past that, the one loaded longest ago is
no longer served (a new request for it loads it again) and is unloaded from the servers, in a thread of its own, once
its requests in flight are done. Other names go to the next loader (the fine-tuning service's)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar

from flywheel.checkpoints import layout
from flywheel.inference.registry import ModelRegistry, ServedModel, UnknownModelError
from flywheel.inference.vllm_engine import VLLMAdapterError, VLLMEngine, VLLMPool

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_CHECKPOINT_ADAPTERS = 8  # NAME@k adapters ``serve --vllm`` keeps loaded (vLLM: --max-loras bounds those in a batch)


def version_name(name: str, step: int) -> str:
    """The adapter name of a model's checkpoint ``step``: ``calc@6``, as Flywheel serves it."""
    return f"{name}@{step}"


class AdapterVersions:
    """The adapter versions of models loaded into ``pool``: ``publish`` loads one, ``retire`` unloads the others."""

    def __init__(self, pool: VLLMPool):
        self.pool = pool
        self._loaded: dict[str, dict[int, Path]] = {}  # model name -> step -> the adapter directory it was loaded from

    def loaded(self, name: str) -> list[int]:
        """The steps of ``name`` loaded now, ascending."""
        return sorted(self._loaded.get(name, {}))

    async def publish(self, name: str, step: int, directory: Path) -> VLLMEngine:
        """Checkpoint ``step`` of ``name`` (a peft adapter ``directory``) loaded as ``name@step`` (once: a step
        loaded already is served as it is), and the engine whose requests name it."""
        versions = self._loaded.setdefault(name, {})
        if step not in versions:
            await self.pool.load_adapter(version_name(name, step), Path(directory))
            versions[step] = Path(directory)
        return self.pool.view(version_name(name, step), step)

    async def retire(self, name: str, keep: Iterable[int]) -> list[int]:
        """Unload every loaded version of ``name`` whose step is not in ``keep``, each once none of its requests is
        in flight (new requests on it are refused from now on); returns the steps unloaded."""
        kept = set(keep)
        versions = self._loaded.get(name, {})
        gone = [step for step in sorted(versions) if step not in kept]
        for step in gone:
            del versions[step]
        await asyncio.gather(*(self.pool.unload_adapter(version_name(name, step)) for step in gone))
        return gone


class CheckpointAdapters:
    """The registry's loader for ``flywheel serve --vllm``: ``NAME@k`` of a LoRA model under ``home``, loaded into
    the vLLM servers as the adapter ``NAME@k`` and added to ``registry``; any other name is ``fallback``'s."""

    def __init__(
        self,
        pool: VLLMPool,
        registry: ModelRegistry,
        home: Path,
        fallback: Callable[[str], ServedModel | None] | None = None,
        max_loaded: int = MAX_CHECKPOINT_ADAPTERS,
    ):
        if max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        self.pool, self.registry, self.home, self.fallback = pool, registry, Path(home), fallback
        self.max_loaded = max_loaded
        self.versions = AdapterVersions(pool)
        self._order: list[tuple[str, int]] = []  # (name, step) of the adapters loaded here, the oldest first
        # one load or unload at a time; a second request for the same name waits for the first, a request for one
        # being unloaded waits for the unload (then loads it again)
        self._lock = threading.Lock()

    def __call__(self, served_name: str) -> ServedModel | None:
        name, _, step = served_name.rpartition("@")
        plain = name and "/" not in name and "\\" not in name and not name.startswith(".")  # no path out of the home
        found = layout.find_models(self.home, name) if plain and step.isdigit() else {}
        if not found:
            return self.fallback(served_name) if self.fallback is not None else None
        if len(found) > 1:
            raise ValueError(
                f"'{served_name}': models called '{name}' exist in several projects under {self.home} "
                f"({', '.join(found)}); this server cannot tell which one to serve."
            )
        (project, model_dir), = found.items()  # fmt: skip
        if int(step) not in layout.steps(model_dir):
            return None  # the registry's 404 lists what is served
        directory = layout.checkpoint_dir(model_dir, int(step)).resolve()
        self._check(served_name, directory)
        with self._lock:
            try:
                return self.registry.get(served_name)
            except UnknownModelError:
                pass
            view = self._on_own_loop(self.versions.publish(name, int(step), directory))
            self.registry.add(served_name, view, owned_by=project, step=int(step))
            self._order.append((name, int(step)))
            if len(self._order) > self.max_loaded:
                oldest = self._order.pop(0)
                self.registry.remove(version_name(*oldest))  # new requests load it again, after the unload
                threading.Thread(target=self._retire, args=oldest, daemon=True, name="flywheel-adapter-retire").start()
            return self.registry.get(served_name)

    def _retire(self, name: str, step: int) -> None:
        """Unload ``name@step`` from the servers once its requests in flight are done (off the request that
        loaded a newer one: that waits for nothing)."""
        with self._lock:
            if (name, step) in self._order:  # requested again before this thread got the lock: served again
                return
            keep = set(self.versions.loaded(name)) - {step}
            try:
                self._on_own_loop(self.versions.retire(name, keep))
            except VLLMAdapterError as exc:  # no longer served here either way; vLLM bounds what it keeps
                log.warning("could not unload the adapter %s: %s", version_name(name, step), exc)

    def _on_own_loop(self, work: Awaitable[T]) -> T:
        """``work`` on an event loop of this thread's own, its connections closed when it ends."""

        async def run() -> T:
            try:
                return await work
            finally:
                await self.pool.aclose()

        return asyncio.run(run())

    def _check(self, served_name: str, directory: Path) -> None:
        """A clear refusal (the API's 400) of a checkpoint vLLM cannot serve as an adapter of its model."""
        config_file = directory / layout.ADAPTER_CONFIG
        if not config_file.is_file():
            raise ValueError(
                f"'{served_name}' is not a LoRA checkpoint ({directory} has no {layout.ADAPTER_CONFIG}): on vLLM, "
                "this server serves LoRA checkpoints only; serve a full fine-tuning checkpoint without --vllm."
            )
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
        if base is None or Path(base).resolve() != self.pool.model_dir.resolve():
            raise ValueError(
                f"'{served_name}' is an adapter of {base}, and the vLLM servers serve {self.pool.model_dir}: "
                "serve it with vLLM servers (and --vllm-model-dir) of its base model."
            )
