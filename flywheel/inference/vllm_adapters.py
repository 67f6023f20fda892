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
its requests in flight are done. Other names go to the next loader (the fine-tuning service's).

It also holds a trainer's versions (``flywheel.vllm_backend``): ``publish`` serves a step's weights as ``NAME`` and
``NAME@STEP`` and unloads the versions not kept, ``forget`` unloads those above a step (another branch) or all of
them, ``adopt`` sorts the versions an earlier process left on the servers. Loads and unloads of both kinds go one at
a time, each on an event loop of its own thread, under one lock."""

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

    def adopt(self, name: str, step: int, directory: Path) -> None:
        """``name@step``, which the servers hold from ``directory`` already, counted as loaded."""
        self._loaded.setdefault(name, {})[step] = Path(directory)

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
        self._order: list[tuple[str, int]] = []  # (name, step) of the adapters requests loaded, the oldest first
        self._kept: dict[str, set[int]] = {}  # per model, the steps its trainer keeps loaded (``publish``)
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
            if (name, step) in self._order or step in self._kept.get(name, ()):  # served again since, or the
                return  # trainer's
            keep = set(self.versions.loaded(name)) - {step}
            try:
                self._on_own_loop(self.versions.retire(name, keep))
            except VLLMAdapterError as exc:  # no longer served here either way; vLLM bounds what it keeps
                log.warning("could not unload the adapter %s: %s", version_name(name, step), exc)

    # ---- a trainer's versions (flywheel.vllm_backend) ----

    def publish(self, name: str, project: str, step: int, directory: Path, keep: Iterable[int]) -> list[int]:
        """A trainer's weights at ``step`` (the peft adapter ``directory``) loaded as ``name@step`` and served as
        ``name`` and ``name@step``; every other version of ``name`` is then no longer served and is unloaded once
        its requests are done, unless its step is in ``keep`` or a request loaded it (and it is among the last
        ``max_loaded``). Returns the steps unloaded."""
        with self._lock:
            self._kept[name] = {*keep, step}
            if (name, step) in self._order:  # loaded by a request before: the trainer's from now on
                self._order.remove((name, step))
            view = self._on_own_loop(self.versions.publish(name, step, Path(directory)))
            self.registry.add(version_name(name, step), view, owned_by=project, step=step)
            self.registry.add(name, view, owned_by=project, step=step)
            requested = {s for n, s in self._order if n == name}
            return self._unload(name, [s for s in self.versions.loaded(name) if s not in self._kept[name] | requested])

    def forget(self, name: str, above: int | None = None) -> list[int]:
        """Unload the versions of ``name`` above step ``above`` (another branch: training went on from an earlier
        step), or all of them, however they were loaded. A refusal raises ``VLLMAdapterError``: a version left
        loaded would be served again when its step is trained anew. Returns the steps unloaded."""
        with self._lock:
            gone = [s for s in self.versions.loaded(name) if above is None or s > above]
            self._order = [(n, s) for n, s in self._order if n != name or s not in gone]
            if above is None:
                self._kept.pop(name, None)
                self.registry.remove(name)
            return self._unload(name, gone)

    def adopt(self, name: str, checkpoints: dict[int, Path]) -> list[int]:
        """The versions of ``name`` the servers hold already (an earlier process loaded them): one loaded from
        its checkpoint's directory (``checkpoints``, by step) is kept as loaded here (and retired in its turn),
        any other (a temporary adapter of a process gone, a checkpoint since abandoned or deleted) is unloaded.
        Returns the steps unloaded."""
        with self._lock:
            held = self._on_own_loop(self.pool.adapters())
            stale = []
            for adapter, roots in held.items():
                held_name, _, step = adapter.rpartition("@")
                if held_name != name or not step.isdigit():
                    continue
                directory = checkpoints.get(int(step))
                if directory is not None and roots == {str(directory)}:
                    self.versions.adopt(name, int(step), directory)
                else:
                    stale.append(int(step))
            for step in stale:
                self._on_own_loop(self.pool.unload_adapter(version_name(name, step)))
            return stale

    def _unload(self, name: str, steps: list[int]) -> list[int]:
        """No longer serve ``steps`` of ``name`` and unload them (the caller holds the lock)."""
        for step in steps:
            self.registry.remove(version_name(name, step))
        if steps:
            self._on_own_loop(self.versions.retire(name, set(self.versions.loaded(name)) - set(steps)))
        return steps

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
