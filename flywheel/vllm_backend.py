"""VLLMBackend: LocalBackend's training, with every model sampled on vLLM servers (issue #40, live weight sync).

The trainer stays in this process, as LocalBackend's (its own copy of the base weights, its run directory, history
and checkpoints); what changes is who answers the model's names. After every step it takes (and at ``register``,
``restore`` and ``rewind``) the live LoRA weights are loaded into every vLLM server as the adapter ``NAME@STEP``: from
the step's checkpoint directory, or, for a step trained with ``save_checkpoint=False``, from an adapter written for it
under ``<home>/.published/``. ``NAME`` and ``NAME@STEP`` are then served by that adapter, so each call the gateway
records names the version that answered it, and the trainer's ``sampler_logprob_gap`` compares what vLLM sampled
with what the trainer scores (a jump: the served policy is not the trained one). A version is never changed in place:
a request in flight finishes on the adapter it started on. The last ``max_staleness_steps + 1`` steps and the steps
the model's deployments point at stay loaded; older ones are no longer served and are unloaded once their requests
are done (a request for ``NAME@k`` of an earlier checkpoint loads it again, as ``flywheel serve --vllm`` does:
``CheckpointAdapters``). Training on from an earlier step (after a ``restore``) unloads the versions above it first.
At registration, versions an earlier process left on the servers are kept if they are the model's checkpoints and
unloaded otherwise (a kill mid-publish leaves the restarted backend serving its latest checkpoint).

LoRA only: full fine-tuning on vLLM (a reload between ``/pause`` and ``/resume``) is not built yet, and registering
such a model says so. vLLM must serve the trained model's base directory (``--vllm-model-dir`` as ``resolve_model``
gives it) with ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flywheel.checkpoints.layout import published_path
from flywheel.checkpoints.run import write_adapter
from flywheel.inference.loading import resolve_model
from flywheel.inference.registry import ServedModel
from flywheel.inference.vllm_adapters import CheckpointAdapters
from flywheel.inference.vllm_engine import VLLMEngine, VLLMPool
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.train.config import TrainedWeights
from flywheel.train.trainer import Trainer


class UnservableModelError(ValueError):
    """A model this backend's vLLM servers cannot serve (full fine-tuning, another base model): says why."""


FULL_REFUSED = (
    "Model '{name}' trains every weight (TrainedWeights(mode='full')): on vLLM, Flywheel serves LoRA adapters only "
    "so far (full fine-tuning needs a weight reload between /pause and /resume, not built yet). Train it with "
    "LoRA, or on LocalBackend."
)


class VLLMBackend(LocalBackend):
    """A ``LocalBackend`` whose models are sampled by vLLM servers (``vllm_urls``, comma-separated or a list) that
    serve the base model directory ``vllm_model_dir`` (default: the first model's base, resolved). ``vllm_model``:
    the name they serve it as (default: the one they list); ``vllm_api_key``: their key, if any. ``max_staleness_steps``:
    how many steps before the live one stay loaded (set it as the loop's). Other arguments: ``LocalBackend``'s."""

    def __init__(
        self,
        vllm_urls: str | Sequence[str],
        *,
        vllm_model_dir: str | Path | None = None,
        vllm_model: str | None = None,
        vllm_api_key: str | None = None,
        max_staleness_steps: int = 2,
        **options: Any,
    ):
        urls = [u for u in (vllm_urls.split(",") if isinstance(vllm_urls, str) else vllm_urls) if u]
        if not urls:
            raise ValueError("VLLMBackend needs the URL of at least one vLLM server (e.g. http://127.0.0.1:8000).")
        if max_staleness_steps < 0:
            raise ValueError(f"max_staleness_steps must be 0 or more, got {max_staleness_steps}")
        super().__init__(**options)
        self._vllm_urls, self._vllm_model, self._vllm_api_key = urls, vllm_model, vllm_api_key
        self._vllm_model_dir = Path(vllm_model_dir).resolve() if vllm_model_dir is not None else None
        self.max_staleness_steps = max_staleness_steps
        self.adapters: CheckpointAdapters | None = None  # once the pool has started
        self._vllm_lock = asyncio.Lock()
        self._adopted: set[tuple[str, str]] = set()  # models whose versions left on the servers were looked at
        self._temporary: dict[tuple[str, str], dict[int, Path]] = {}  # adapters written for steps without checkpoint

    async def _vllm(self, base_model: str) -> CheckpointAdapters:
        """The adapters of the started pool; a base model other than the one the servers serve is refused."""
        path = (await asyncio.to_thread(resolve_model, base_model)).path
        async with self._vllm_lock:
            if self.adapters is None:
                pool = VLLMPool(
                    self._vllm_urls, self._vllm_model_dir or path, model=self._vllm_model, api_key=self._vllm_api_key
                )
                self.adapters = CheckpointAdapters(await pool.start(), self.registry, self.path)
        served = self.adapters.pool.model_dir.resolve()
        if path != served:
            raise UnservableModelError(
                f"'{base_model}' is {path}, and the vLLM servers of this backend serve {served}: a VLLMBackend "
                "samples one base model (start another, with vLLM servers of that model, for this one)."
            )
        return self.adapters

    @property
    def pool(self) -> VLLMPool:
        if self.adapters is None:
            raise RuntimeError("The vLLM servers are not in use yet: load or register a model first.")
        return self.adapters.pool

    async def load(self, base_model: str) -> VLLMEngine:  # type: ignore[override]
        """Serve a base model as is, sampled by the vLLM servers (which must serve it)."""
        adapters = await self._vllm(base_model)
        engine = adapters.pool.engine()
        async with self._lock:
            self._engines[base_model] = engine  # type: ignore[assignment]
            for name in {base_model, (await asyncio.to_thread(resolve_model, base_model)).name}:
                self.registry.add(name, engine)
            self._serve()
        return engine

    async def register(self, model: TrainableModel, trained_weights: TrainedWeights | None = None) -> None:
        """``LocalBackend.register`` (the trainer here, resumed from the latest checkpoint), then its live weights
        published to the vLLM servers. LoRA only."""
        if (trained_weights or TrainedWeights()).mode != "lora":
            raise UnservableModelError(FULL_REFUSED.format(name=model.name))
        await self._vllm(model.base_model)
        await super().register(model, trained_weights)

    def _serve_checkpoint(self, served_name: str) -> ServedModel | None:
        """``NAME@k`` of an earlier checkpoint: loaded into the vLLM servers as an adapter (``CheckpointAdapters``)."""
        return self.adapters(served_name) if self.adapters is not None else None

    async def _publish(self, model: TrainableModel) -> None:
        """The live weights loaded as ``NAME@STEP`` and served as ``NAME`` and ``NAME@STEP``; versions past the
        staleness bound, and not deployed, unloaded."""
        assert self.adapters is not None  # registered: started
        trainer, run, key = self.trainer(model), self.run(model), (model.project, model.name)
        if key not in self._adopted:
            checkpoints = {step: run.checkpoint_dir(step).resolve() for step in run.steps()}
            await asyncio.to_thread(self.adapters.adopt, model.name, checkpoints)
            shutil.rmtree(published_path(self.path, *key), ignore_errors=True)  # an earlier process's, now unloaded
            self._adopted.add(key)
        step = trainer.step
        directory = run.checkpoint_dir(step).resolve() if step in run.steps() else await self._write(model, trainer)
        keep = set(range(step - self.max_staleness_steps, step + 1)) | await asyncio.to_thread(run.deployed_steps, 0)
        gone = await asyncio.to_thread(self.adapters.publish, model.name, model.project, step, directory, keep)
        self._drop_written(key, gone)

    async def _write(self, model: TrainableModel, trainer: Trainer) -> Path:
        """The live adapter written where vLLM can load it, for a step without a checkpoint."""
        root = published_path(self.path, model.project, model.name)

        def write() -> Path:  # on the engine's thread: between steps
            root.mkdir(parents=True, exist_ok=True)
            # a fresh directory per version: a server never takes one version's files for another's
            directory = Path(tempfile.mkdtemp(prefix=f"step-{trainer.step}-", dir=root)).resolve()
            write_adapter(directory, trainer.checkpoint())
            return directory

        directory = await trainer.engine.call(write)
        self._temporary.setdefault((model.project, model.name), {})[trainer.step] = directory
        return directory

    def _drop_written(self, key: tuple[str, str], steps: list[int]) -> None:
        written = self._temporary.get(key, {})
        for step in steps:
            if (directory := written.pop(step, None)) is not None:
                shutil.rmtree(directory, ignore_errors=True)

    async def _branch(self, model: TrainableModel, trainer: Trainer) -> None:
        """``LocalBackend._branch``, and the versions above the live step unloaded: their steps are trained anew."""
        await super()._branch(model, trainer)
        if self.adapters is not None:
            gone = await asyncio.to_thread(self.adapters.forget, model.name, trainer.step)
            self._drop_written((model.project, model.name), gone)

    async def unregister(self, model: TrainableModel) -> None:
        """``LocalBackend.unregister``, and the model's versions unloaded from the vLLM servers."""
        registered = (model.project, model.name) in self._trainers
        await super().unregister(model)
        if registered:
            await self._forget((model.project, model.name))

    async def _forget(self, key: tuple[str, str]) -> None:
        assert self.adapters is not None
        await asyncio.to_thread(self.adapters.forget, key[1])
        self._drop_written(key, list(self._temporary.get(key, {})))
        self._adopted.discard(key)

    async def close(self) -> None:
        """``LocalBackend.close``, then the versions this backend published unloaded from the vLLM servers
        (which go on serving the base model and whatever else they hold)."""
        registered = list(self._trainers)
        await super().close()
        if self.adapters is not None:
            for key in registered:
                await self._forget(key)
            await self.adapters.pool.aclose()
