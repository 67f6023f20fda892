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

A full fine-tuning model has the servers to itself (its weights replace theirs; a LoRA model, or the base model served
on them, is refused beside it, and the base model is then served on an embedded engine): after each step its weights
are reloaded into every server in place (``VLLMPool.reload_weights``: ``/pause``, ``reload_weights``, ``/resume``);
requests for the new step wait for the reload, the last step's finish first on its weights. Earlier checkpoints
``NAME@k`` are served by an embedded engine on request. Closed or unregistered, it gives the servers the base
model's weights back.

vLLM must serve the trained model's base directory (``--vllm-model-dir`` as ``resolve_model`` gives it), for LoRA
with ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, for full fine-tuning with
``VLLM_SERVER_DEV_MODE=1`` (the routes of a weight reload)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from flywheel.checkpoints.layout import FULL_WEIGHTS, published_path
from flywheel.checkpoints.run import write_weights
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import ResolvedModel, resolve_model
from flywheel.inference.protocol import SamplerUnavailableError
from flywheel.inference.registry import ServedModel
from flywheel.inference.vllm_adapters import CheckpointAdapters, version_name
from flywheel.inference.vllm_engine import IDLE_POLL_S, VLLMEngine, VLLMPool
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.train.config import TrainedWeights
from flywheel.train.trainer import Trainer

log = logging.getLogger(__name__)


class UnservableModelError(ValueError):
    """A model this backend's vLLM servers cannot serve (another base model; a full fine-tuning model and any other
    model on the same servers): says why."""


SERVERS_TAKEN = (
    "Model '{name}' trains every weight (TrainedWeights(mode='full')), and its weights replace the vLLM servers' "
    "own: it needs the servers to itself, and this backend already serves {what} on them. Give it vLLM servers of "
    "its own (another VLLMBackend), or train it with LoRA."
)
FULL_OWNER = (
    "The vLLM servers of this backend hold the fully fine-tuned weights of model '{owner}': '{name}' cannot be "
    "sampled there (a LoRA adapter would apply to those weights, not to the base model's). Give it vLLM servers of "
    "its own (another VLLMBackend)."
)


TIED_HEAD = "tied_head.safetensors"  # beside a full model's weights: its tied output head, for vLLM's reload


def _tied_head(base_model: str) -> tuple[str, str] | None:
    """The Hugging Face names of a model's input embeddings and output head when its config ties them, else None."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model(base_model).path)
    if not getattr(config.get_text_config(), "tie_word_embeddings", False):
        return None
    return "model.embed_tokens.weight", "lm_head.weight"


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
        self._temporary: dict[tuple[str, str], dict[int, Path]] = {}  # weights written for steps without checkpoint
        self._full: tuple[str, str] | None = None  # the full fine-tuning model whose weights the servers hold
        self._full_engine: VLLMEngine | None = None  # the engine of its live step
        self._tied_head: tuple[str, str] | None = None  # its (input embedding, output head) names, if they are tied

    async def _vllm(self, base_model: str) -> tuple[CheckpointAdapters, ResolvedModel]:
        """The adapters of the started pool, and ``base_model`` resolved; a base model other than the one the servers
        serve is refused."""
        resolved = await asyncio.to_thread(resolve_model, base_model)
        path = resolved.path
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
        return self.adapters, resolved

    @property
    def pool(self) -> VLLMPool:
        if self.adapters is None:
            raise RuntimeError("The vLLM servers are not in use yet: load or register a model first.")
        return self.adapters.pool

    async def _base_engine(self, base_model: str) -> tuple[InferenceEngine, str]:
        """A base model as is: sampled by the vLLM servers (which must serve it); on an embedded engine while a full
        fine-tuning model holds the servers' weights."""
        if self._full is not None:
            return await super()._base_engine(base_model)
        adapters, resolved = await self._vllm(base_model)
        return adapters.pool.engine(), resolved.name  # type: ignore[return-value]  # a SamplingEngine, served alike

    async def register(self, model: TrainableModel, trained_weights: TrainedWeights | None = None) -> None:
        """``LocalBackend.register`` (the trainer here, resumed from the latest checkpoint), then its live weights
        published to the vLLM servers: a LoRA model's as an adapter (any number of them), a full fine-tuning
        model's as the servers' weights (it then has the servers to itself)."""
        key = (model.project, model.name)
        full = (trained_weights or TrainedWeights()).mode == "full"
        if self._full is not None and self._full != key:
            raise UnservableModelError(FULL_OWNER.format(owner=self._full[1], name=model.name))
        if full and self._full is None:
            taken = [f"model '{k[1]}'" for k in self._trainers] + [f"the base model '{b}'" for b in self._engines]
            if taken:
                raise UnservableModelError(SERVERS_TAKEN.format(name=model.name, what=", ".join(taken)))
        await self._vllm(model.base_model)
        if full:
            self._full, self._tied_head = key, await asyncio.to_thread(_tied_head, model.base_model)
        try:
            await super().register(model, trained_weights)
        except BaseException:
            if full and key not in self._trainers:
                self._full = None
            raise

    def _serve_checkpoint(self, served_name: str) -> ServedModel | None:
        """``NAME@k`` of an earlier checkpoint: loaded into the vLLM servers as an adapter (``CheckpointAdapters``);
        of the full fine-tuning model, on an embedded engine of its own (the servers hold the live step only)."""
        if self._full is not None and served_name.rpartition("@")[0] == self._full[1]:
            return super()._serve_checkpoint(served_name)
        return self.adapters(served_name) if self.adapters is not None else None

    async def _publish(self, model: TrainableModel) -> None:
        """The live weights loaded as ``NAME@STEP`` and served as ``NAME`` and ``NAME@STEP``; versions past the
        staleness bound, and not deployed, unloaded."""
        assert self.adapters is not None  # registered: started
        trainer, run, key = self.trainer(model), self.run(model), (model.project, model.name)
        if key == self._full:
            await self._reload(model, trainer)
            return
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

    async def _reload(self, model: TrainableModel, trainer: Trainer) -> None:
        """The full fine-tuning model's live weights loaded into the servers in place of the last step's. New
        requests for ``NAME`` and ``NAME@STEP`` wait for them; the last step's requests finish first, on its
        weights (a request that arrives for it meanwhile is refused: a 503 to retry); so each is answered by the
        weights it names. An earlier ``NAME@k`` is served by an embedded engine, on request."""
        run, key, step = self.run(model), (model.project, model.name), trainer.step
        if step in run.steps():
            directory = run.checkpoint_dir(step).resolve()
        elif step == 0:  # never trained: the base model's own weights
            directory = self.pool.model_dir.resolve()
        else:
            directory = await self._write(model, trainer)
        engine, old = VLLMEngine(self.pool, None, step), self._full_engine
        engine.hold()
        for name in (model.name, version_name(model.name, step)):
            self.registry.add(name, engine, owned_by=model.project, step=step)
        if old is not None:
            if old.step != step:
                self.registry.remove(version_name(model.name, old.step))
            old.close()
            while old.in_flight:  # noqa: ASYNC110 (its requests run on the server's event loop)
                await asyncio.sleep(IDLE_POLL_S)
        self._full_engine = engine
        try:
            await self._reload_from(directory, key)
        except BaseException:
            engine.close()  # its requests are refused, not answered by weights it does not name
            raise
        engine.release()
        self._drop_written(key, [s for s in self._temporary.get(key, {}) if s != step])

    async def _reload_from(self, directory: Path, key: tuple[str, str]) -> None:
        """Every server's weights reloaded from ``directory`` (its ``model.safetensors``). A head tied to the input
        embeddings is given as a weight of its own, from a directory beside the others that links the weights and
        adds the head: vLLM 0.32's in-place reload loads a tied head from nothing and puts its old weights back
        (the log says "ParallelLMHead: Failed to load weights"), leaving it untied from the new embeddings."""
        if self._tied_head is None:
            await self.pool.reload_weights(directory)
            return
        embeddings, head = self._tied_head
        root = published_path(self.path, *key)

        def link() -> Path:
            root.mkdir(parents=True, exist_ok=True)
            linked = Path(tempfile.mkdtemp(prefix="reload-", dir=root)).resolve()
            (linked / FULL_WEIGHTS).symlink_to(directory / FULL_WEIGHTS)
            with safe_open(str(directory / FULL_WEIGHTS), "pt") as weights:
                save_file({head: weights.get_tensor(embeddings)}, str(linked / TIED_HEAD))
            return linked

        linked = await asyncio.to_thread(link)
        try:
            await self.pool.reload_weights(linked)
        finally:
            shutil.rmtree(linked, ignore_errors=True)

    async def _write(self, model: TrainableModel, trainer: Trainer) -> Path:
        """The live weights written where vLLM can load them, for a step without a checkpoint."""
        root = published_path(self.path, model.project, model.name)

        def write() -> Path:  # on the engine's thread: between steps
            root.mkdir(parents=True, exist_ok=True)
            # a fresh directory per version: a server never takes one version's files for another's
            directory = Path(tempfile.mkdtemp(prefix=f"step-{trainer.step}-", dir=root)).resolve()
            write_weights(directory, trainer.checkpoint())
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
        """A model no longer sampled here: its adapters unloaded, or (full fine-tuning) the servers given the base
        model's weights back; what was written for it removed."""
        assert self.adapters is not None
        if key == self._full:
            if self._full_engine is not None:
                self._full_engine.close()
                for name in (key[1], version_name(key[1], self._full_engine.step)):
                    self.registry.remove(name)
            self._full, self._full_engine = None, None
            await self._reload_from(self.pool.model_dir.resolve(), key)
        else:
            await asyncio.to_thread(self.adapters.forget, key[1])
        self._drop_written(key, list(self._temporary.get(key, {})))
        self._adopted.discard(key)

    async def close(self) -> None:
        """``LocalBackend.close``, then the versions this backend published unloaded from the vLLM servers
        (which go on serving the base model and whatever else they hold), or the base model's weights given back;
        a server that refuses is logged (the next backend's registration sorts what it left)."""
        registered = list(self._trainers)
        await super().close()
        if self.adapters is not None:
            for key in registered:
                try:
                    await self._forget(key)
                except SamplerUnavailableError as exc:
                    log.warning("closing, could not clear model '%s' from the vLLM servers: %s", key[1], exc)
            await self.adapters.pool.aclose()
