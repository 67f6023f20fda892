"""LocalBackend: loads models in-process, runs their engines, and serves them over HTTP on loopback. Where ART keeps
it (``from art.local.backend import LocalBackend``); ``flywheel.LocalBackend`` is the same class."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn

import torch

from flywheel.checkpoints import sync
from flywheel.checkpoints.layout import model_path
from flywheel.checkpoints.run import RunStore
from flywheel.dev import train_config
from flywheel.gateway.auth import ApiKeys, is_loopback
from flywheel.gateway.recorder import Gateway
from flywheel.gather import phase_seconds
from flywheel.home import default_home
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import load_model
from flywheel.inference.registry import ModelRegistry, ServedModel
from flywheel.local.gap_alarm import GapAlarm
from flywheel.local.loggers import MetricLoggers
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store
from flywheel.store.db import default_url
from flywheel.train.checkpoint import Checkpoint
from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights, warn_once
from flywheel.train.trainer import Trainer, load_for_serving
from flywheel.types import TrainResult, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from flywheel.dev import TrainOptions
    from flywheel.model import Model, TrainableModel
    from flywheel.train.data_parallel import Replicas

MAX_CHECKPOINT_ENGINES = 2  # earlier checkpoints served at once (each holds a copy of the base weights)


def metric_means(trajectories: list[Trajectory], split: str) -> dict[str, float]:
    """``<split>/<name>``: the mean of each trajectory metric over the trajectories that have it."""
    means = {}
    for k in sorted({k for t in trajectories for k in t.metrics}):
        values = [float(t.metrics[k]) for t in trajectories if k in t.metrics]
        means[f"{split}/{k}"] = sum(values) / len(values)
    return means


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
        api_keys: ApiKeys | None = None,
        insecure_no_auth: bool = False,
        in_process: bool = True,
        loggers: Sequence[str] | None = None,
        replicas: Replicas | None = None,
    ):
        """``compile``: engines decode with a compiled step (``InferenceEngine(compile=True)``: faster sampling at
        few concurrent rows, minutes to compile per engine, needs a C++ compiler). ``api_keys``: the HTTP server
        wants a key of each route's role (``flywheel.gateway.auth``; give registered models an agent key as their
        ``inference_api_key``); without any it is open, so a ``host`` other than loopback also needs
        ``insecure_no_auth=True``. ``in_process``: ART's choice of where its engine runs; here it always runs in
        this process (False is accepted, with a warning). ``loggers``: the trackers every metric row also goes to
        (``wandb``, ``mlflow``, ``tensorboard``; default: ``$FLYWHEEL_LOGGERS``, else those whose variables are
        set: ``flywheel.local.loggers``). ``replicas``: this process is rank 0 of data-parallel replicas
        (``flywheel.train.data_parallel``; the other ranks run ``follow``): the one model registered here trains
        on all of them, each step split between them."""
        if serve_http and not api_keys and not insecure_no_auth and not is_loopback(host):
            raise ValueError(
                f"LocalBackend(host={host!r}) would serve every route to anyone who can reach it: give api_keys, "
                "or insecure_no_auth=True to serve it open anyway."
            )
        if not in_process:
            warn_once(
                "LocalBackend.in_process", "LocalBackend(in_process=False): Flywheel's engine runs in this process."
            )
        self.path = Path(path) if path is not None else default_home()
        self.registry = ModelRegistry(loader=self._serve_checkpoint)
        self._engines: dict[str, InferenceEngine] = {}
        self._checkpoint_engines: dict[str, InferenceEngine] = {}  # "name@step" of earlier steps, oldest first
        self._checkpoint_lock = threading.Lock()
        self._trainers: dict[tuple[str, str], Trainer] = {}  # (project, name) -> trainer on its own engine
        self._runs: dict[tuple[str, str], RunStore] = {}  # their directories, locked while registered here
        self._step_locks: dict[tuple[str, str], asyncio.Lock] = {}  # one step (train, save, restore) at a time
        self._extras: dict[tuple[str, str], dict] = {}  # the ``extra`` of the checkpoint the live weights are at
        self._trained: dict[tuple[str, str], tuple[int, set[str]]] = {}  # last train step, its trajectories' ids
        self._gap_alarm = GapAlarm()  # per model: the sampler/trainer log-prob gap jumping
        self._replicas = replicas
        self._dtype, self._max_batch, self._compile = dtype, max_batch, compile
        self._host, self._port, self._serve_http, self._api_keys = host, port, serve_http, api_keys
        self._server: BackgroundServer | None = None
        self.gateway: Gateway | None = None  # with the HTTP server: agents anywhere record episodes through it
        # every history row also goes to the trackers that are on (W&B when WANDB_API_KEY is set, as in ART)
        self.loggers = MetricLoggers(self.path, loggers)
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
            # episodes recorded through the gateway: FLYWHEEL_DB, else SQLite in this backend's home
            self.gateway = Gateway(Store(default_url(self.path)))
            app = create_app(self.registry, self.gateway, auth=self._api_keys)
            self._server = BackgroundServer(app, self._host, self._port).start()

    async def _base_engine(self, base_model: str) -> tuple[InferenceEngine, str]:
        """The engine that serves a base model as is, and the model's resolved name: an embedded one of its own."""
        return await self._engine(base_model)

    async def load(self, base_model: str) -> InferenceEngine:
        """Serve a base model as is (no adapter), e.g. as a judge or a baseline."""
        async with self._lock:
            if base_model not in self._engines:
                engine, resolved_name = await self._base_engine(base_model)
                self._engines[base_model] = engine
                for name in {base_model, resolved_name}:
                    self.registry.add(name, engine)
            self._serve()
            return self._engines[base_model]

    async def register(self, model: TrainableModel, trained_weights: TrainedWeights | None = None) -> None:
        """Give the model its own engine (its own copy of the base weights, with what ``trained_weights`` trains: a
        LoRA adapter by default) and resume from its latest checkpoint if it has one. The model's directory is
        this backend's until ``close``: a second backend (in this process or another) gets ``ModelInUseError``
        naming the holder's pid."""
        key = (model.project, model.name)
        async with self._lock:
            if self._replicas is not None and self._trainers and key not in self._trainers:
                raise ValueError(
                    f"This backend trains model '{next(iter(self._trainers))[1]}' on its replicas already: one model "
                    f"per backend with replicas ('{model.name}' needs a backend, and replicas, of its own)."
                )
            if key not in self._trainers:
                run = RunStore(self.model_dir(model))
                run.lock()
                try:
                    await asyncio.to_thread(run.recover)  # after a crash: back to the latest checkpoint
                    engine, _ = await self._engine(model.base_model)
                    try:  # model work runs on the engine's thread (see InferenceEngine.call)
                        trainer = await engine.call(Trainer, engine, trained_weights)
                        latest = run.latest()
                        if latest is not None:
                            checkpoint = await asyncio.to_thread(run.read, latest, mode=trainer.trained_weights.mode)
                            await engine.call(trainer.load, checkpoint)
                            self._extras[key] = checkpoint.state.extra
                        if self._replicas is not None:  # the other ranks start from these weights and step
                            await engine.call(trainer.replicate, self._replicas)
                    except BaseException:
                        engine.close()
                        raise
                except BaseException:
                    run.unlock()
                    raise
                self._trainers[key], self._runs[key], self._step_locks[key] = trainer, run, asyncio.Lock()
            self._serve()
        await self._publish(model)

    async def unregister(self, model: TrainableModel) -> None:
        """Let go of a registered model: its engines close (requests on them finish first), its names are no longer
        served and its directory is free. What was not checkpointed is dropped: registering it again resumes from
        its latest checkpoint (e.g. a fine-tuning job paused or cancelled mid-epoch). Not registered: nothing."""
        key = (model.project, model.name)
        async with self._lock:
            trainer = self._trainers.pop(key, None)
            if trainer is None:
                return
            lock = self._step_locks.pop(key)
            async with lock:  # a step being taken is saved first
                pass
            if self._replicas is not None:
                await trainer.engine.call(self._replicas.stop)  # the other ranks' follow() returns
            engines = [trainer.engine]
            with self._checkpoint_lock:
                for served in list(self._checkpoint_engines):
                    if served.rpartition("@")[0] == model.name:
                        engines.append(self._checkpoint_engines.pop(served))
            for served in self.registry.all():
                if served.engine in engines:
                    self.registry.remove(served.name)
            for engine in engines:
                await asyncio.to_thread(engine.close, drain=True)
            self._runs.pop(key).unlock()
            for state in (self._extras, self._trained):
                state.pop(key, None)
            self._gap_alarm.forget(key)

    def trainer(self, model: TrainableModel) -> Trainer:
        try:
            return self._trainers[(model.project, model.name)]
        except KeyError:
            raise RuntimeError(f"Model '{model.name}' is not registered with this backend.") from None

    async def _publish(self, model: TrainableModel) -> None:
        """Serve the live weights as ``name`` and ``name@<step>``; an older ``name@k`` on the live engine would
        lie, so it goes (a request for it then loads checkpoint k: ``_serve_checkpoint``)."""
        trainer = self.trainer(model)
        prefix = f"{model.name}@"
        for served in self.registry.all():
            if served.name.startswith(prefix) and served.engine is trainer.engine:
                self.registry.remove(served.name)
        self.registry.add(model.name, trainer.engine, owned_by=model.project, step=lambda: trainer.step)
        self.registry.add(
            model.get_inference_name(trainer.step), trainer.engine, owned_by=model.project, step=trainer.step
        )

    def _serve_checkpoint(self, served_name: str) -> ServedModel | None:
        """The registry's loader: ``name@step`` of a registered model at an earlier checkpoint gets an engine of
        its own (a fresh base model with that checkpoint's weights); the last ``MAX_CHECKPOINT_ENGINES`` stay."""
        name, _, step = served_name.rpartition("@")
        owners = [(key, t) for key, t in self._trainers.items() if key[1] == name]
        if not step.isdigit() or len(owners) != 1:
            return None
        (project, _), trainer = owners[0]
        run = self._runs[(project, name)]
        if int(step) not in run.steps():
            return None
        with self._checkpoint_lock:  # one load at a time; a second request for the same step waits for the first
            if served_name not in self._checkpoint_engines:
                try:
                    checkpoint = run.read(int(step), optimizer=False)
                except FileNotFoundError:  # deleted (delete_checkpoints) since it was listed
                    return None
                base, tokenizer, _ = load_model(trainer.engine.model.name_or_path, dtype=self._dtype)
                load_for_serving(base, checkpoint)
                self._checkpoint_engines[served_name] = InferenceEngine(
                    base, tokenizer, max_batch=self._max_batch, compile=self._compile
                )
                self.registry.add(served_name, self._checkpoint_engines[served_name], owned_by=project, step=int(step))
                while len(self._checkpoint_engines) > MAX_CHECKPOINT_ENGINES:
                    oldest = next(iter(self._checkpoint_engines))
                    self.registry.remove(oldest)
                    self._checkpoint_engines.pop(oldest).close(drain=True)  # requests on it finish first
            return self.registry.get(served_name)

    def model_dir(self, model: Model) -> Path:
        return model_path(self.path, model.project, model.name)

    def run(self, model: Model) -> RunStore:
        """The model's directory: history, trajectories, checkpoints (read-only use if not registered here)."""
        return self._runs.get((model.project, model.name)) or RunStore(self.model_dir(model))

    async def restore(self, model: TrainableModel, step: int) -> None:
        """Load checkpoint ``step`` into the live weights (e.g. the best one, for a final evaluation). Later
        checkpoints stay until training goes on from here: the first step after it moves them, their history
        rows and trajectories to ``abandoned/`` (they are another branch)."""
        trainer, run = self.trainer(model), self.run(model)
        async with self._step_locks[(model.project, model.name)]:
            checkpoint = await asyncio.to_thread(run.read, step, mode=trainer.trained_weights.mode)
            await trainer.engine.call(trainer.load, checkpoint)
            self._extras[(model.project, model.name)] = checkpoint.state.extra
        await self._publish(model)

    async def rewind(self, model: TrainableModel, step: int | None, *, extra: dict) -> int:
        """Training goes on from checkpoint ``step``'s trained weights (None: the base model's) with a fresh
        optimizer, as a new checkpoint one step after the live one, with ``extra``; the live weights go there.
        Unlike ``restore`` the step only grows and nothing is abandoned (a deployment may point at the steps in
        between); the new step's history row (split ``rewind``) says where its weights came from. The checkpoint
        is durable before the live weights change. Returns the new step."""
        trainer, run, key = self.trainer(model), self.run(model), (model.project, model.name)
        async with self._step_locks[key]:
            await self._branch(model, trainer)
            if step is None:
                weights = await trainer.engine.call(trainer.base_state)
            else:
                mode = trainer.trained_weights.mode
                weights = (await asyncio.to_thread(run.read, step, mode=mode, optimizer=False)).weights
            current = await trainer.engine.call(trainer.checkpoint)
            row = {"time": time.time(), "step": trainer.step + 1, "split": "rewind", "rewound_to": step}
            state = current.state.model_copy(
                update={"step": trainer.step + 1, "rows": [row | {"checkpoint": True}], "extra": extra}
            )
            checkpoint = Checkpoint(state, weights, rng=current.rng, adapter_config=current.adapter_config)
            await asyncio.to_thread(run.write, checkpoint)
            await trainer.engine.call(trainer.load, checkpoint)  # no optimizer state: a fresh one
            self._extras[key] = extra
        await self._publish(model)
        return state.step

    async def get_step(self, model: Model) -> int:
        """Optimizer steps taken so far (0 before any training)."""
        key = (model.project, model.name)
        if key in self._trainers:
            return self._trainers[key].step
        return self.run(model).latest() or 0

    def checkpoint_extra(self, model: TrainableModel) -> dict:
        """The ``extra`` stored with the checkpoint the live weights come from (after a resume or a restore), or
        of the last one this backend wrote; ``{}`` if none."""
        self.trainer(model)  # registered
        return dict(self._extras.get((model.project, model.name), {}))

    # ---- training ----------------------------------------------------------------------------------------------

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
        **options: Unpack[TrainOptions],
    ) -> TrainResult:
        """One RL step, recorded (history row, trajectories). ``config`` (default: ART's defaults) and ART's keyword
        arguments (``learning_rate=...``, mapped by ``flywheel.dev.train_config``). ``save_checkpoint``: write a
        checkpoint of it (with ``extra``, e.g. the caller's data position, back from ``checkpoint_extra`` on
        resume); its history row says whether it has one, and holds ``metrics``, the caller's own figures of the step
        (dynamic sampling's groups drawn and kept, say). ``verbose``: print the step's metrics. A None among the
        groups (``ruler_score_group(..., swallow_exceptions=True)`` for a group its judge could not score, which
        ART's scripts pass on as they are) is left out, with a warning."""
        config = train_config(config, options)
        trainer = self.trainer(model)
        given = list(groups)
        kept = [g for g in given if g is not None]
        if len(kept) < len(given):
            warnings.warn(
                f"{len(given) - len(kept)} of the {len(given)} groups given to train are None (as "
                "ruler_score_group(..., swallow_exceptions=True) returns for a group it could not score): left out",
                stacklevel=2,
            )
        trajectories = [t for g in kept for t in g.trajectories]
        key = (model.project, model.name)
        async with self._step_locks[key]:  # a second caller's step waits for this one's save
            await self._branch(model, trainer)
            if config.beta > 0 and config.kl_reference_step != trainer.reference_step:
                await self._set_kl_reference(model, trainer, config.kl_reference_step)
            step_metrics = await trainer.engine.call(trainer.rl_step, kept, config)
            if (gap := step_metrics.get("sampler_logprob_gap")) is not None:  # is the served policy the trained one?
                step_metrics["sampler_gap_alarm"] = float(self._gap_alarm.check(key, trainer.step, gap))
            step_metrics |= phase_seconds(kept) | metric_means(trajectories, "train") | (metrics or {})
            row = {"step": trainer.step, "split": "train", **step_metrics}
            save = save_checkpoint and not step_metrics.get("skipped")
            self.run(model).save_trajectories("train", trainer.step, trajectories)  # first: the row commits them
            await self._after_step(model, trainer, [row], "train", config.model_dump(), save, extra)
            step = trainer.step
            await asyncio.to_thread(
                self.loggers.log_trajectories, model.project, model.name, "train", step, trajectories
            )
            self._trained[key] = (step, {t.id for t in trajectories})
        if verbose:
            print(f"{model.name} step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(step_metrics.items())))
        return TrainResult(step=step, metrics=step_metrics)

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: list[Trajectory],
        config: SFTConfig,
        progress: Callable[[dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """SFT steps; ``progress`` gets each step's metrics as soon as it is taken (on the engine's thread)."""
        trainer = self.trainer(model)
        async with self._step_locks[(model.project, model.name)]:
            await self._branch(model, trainer)
            history = await trainer.engine.call(trainer.sft, trajectories, config, progress)
            rows = [{"step": trainer.step - len(history) + i + 1, "split": "sft", **m} for i, m in enumerate(history)]
            await self._after_step(model, trainer, rows, "sft", config.model_dump(), True, None)
        return history

    async def sft_loss(self, model: TrainableModel, trajectories: list[Trajectory]) -> dict[str, float]:
        """SFT's loss on ``trajectories`` under the live weights, without training (``Trainer.sft_loss``)."""
        trainer = self.trainer(model)
        return await trainer.engine.call(trainer.sft_loss, trajectories)

    async def _set_kl_reference(self, model: TrainableModel, trainer: Trainer, step: int | None) -> None:
        """The KL term's reference: the base model (``None``) or this model's checkpoint at ``step``."""
        if step is None:
            await trainer.engine.call(trainer.set_reference, None)
            return
        run = self.run(model)
        if step not in run.steps():
            raise ValueError(
                f"kl_reference_step={step}: model '{model.name}' has no checkpoint at that step "
                f"(it has {run.steps() or 'none'}); save one there (e.g. at the end of SFT) or leave it None for the base"
            )
        checkpoint = await asyncio.to_thread(run.read, step, mode=trainer.trained_weights.mode, optimizer=False)
        await trainer.engine.call(trainer.set_reference, checkpoint.weights, step)

    async def _branch(self, model: TrainableModel, trainer: Trainer) -> None:
        """Training goes on from the live step: checkpoints and rows above it (left by a ``restore``) are another
        branch, archived; earlier-step engines serving them go too."""
        if await asyncio.to_thread(self.run(model).abandon_after, trainer.step) is None:
            return

        def drop_engines() -> None:
            with self._checkpoint_lock:
                for served in list(self._checkpoint_engines):
                    name, _, step = served.rpartition("@")
                    if name == model.name and int(step) > trainer.step:
                        self.registry.remove(served)
                        self._checkpoint_engines.pop(served).close()

        await asyncio.to_thread(drop_engines)

    async def _after_step(
        self,
        model: TrainableModel,
        trainer: Trainer,
        rows: list[dict],
        split: str,
        config: dict,
        save: bool,
        extra: dict | None,
    ) -> None:
        """A step's history rows: committed by its checkpoint (durable first, the rows after it) or appended."""
        stamp = time.time()
        rows = [
            {"time": stamp, **row, "checkpoint": save and row["step"] == trainer.step} for row in rows
        ]  # SFT: its last
        run = self.run(model)
        if save:
            checkpoint = await trainer.engine.call(trainer.checkpoint)
            checkpoint.state = checkpoint.state.model_copy(
                update={"rows": rows, "extra": extra or {}, "last_split": split, "last_config": config}
            )
            await asyncio.to_thread(run.write, checkpoint)
            self._extras[(model.project, model.name)] = extra or {}
        else:
            await asyncio.to_thread(run.append, rows)
        await asyncio.to_thread(self.loggers.log, model.project, model.name, rows)
        await self._publish(model)

    def history(self, model: TrainableModel) -> list[dict]:
        return self.run(model).history()

    async def log(
        self,
        model: Model,
        trajectories: list[Trajectory],
        split: str,
        extra_metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Record evaluation trajectories and their mean reward/metrics as ``<split>/...`` at the current step (or
        ``step``), with ``extra_metrics`` (``<split>/<name>``, unless the name has a ``/``). Trajectories of the
        last ``train`` step, which recorded them, are not written again as that step's ``train`` split."""
        key = (model.project, model.name)
        async with self._step_locks.get(key) or contextlib.nullcontext():
            step = await self.get_step(model) if step is None else step
            trained_step, trained_ids = self._trained.get(key, (None, set()))
            if split == "train" and step == trained_step:
                trajectories = [t for t in trajectories if t.id not in trained_ids]
            metrics: dict[str, float] = {}
            if trajectories:
                metrics[f"{split}/reward"] = sum(t.reward for t in trajectories) / len(trajectories)
                metrics |= metric_means(trajectories, split) | {f"{split}/n": len(trajectories)}
            metrics |= {k if "/" in k else f"{split}/{k}": v for k, v in (extra_metrics or {}).items()}
            run = self.run(model)
            run.save_trajectories(split, step, trajectories)  # first: the row commits them
            row = {"time": time.time(), "step": step, "split": split, **metrics}
            await asyncio.to_thread(run.append, [row])
            await asyncio.to_thread(self.loggers.log, model.project, model.name, [row])
            await asyncio.to_thread(self.loggers.log_trajectories, model.project, model.name, split, step, trajectories)
        return metrics

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str = "val/reward", *, maximize: bool = True
    ) -> list[int]:
        """Keep the latest checkpoint and the best existing one by ``best_checkpoint_metric`` (the highest, or
        the lowest if not ``maximize``; a NaN never wins), and the steps the model's deployments serve or would
        roll back to (as weights: ``prune_checkpoints``); return the deleted steps."""
        self.trainer(model)  # registered: this backend owns the directory
        async with self._step_locks[(model.project, model.name)]:
            return await asyncio.to_thread(self.run(model).prune, best_checkpoint_metric, maximize)

    async def prune_checkpoints(self, model: TrainableModel, keep: Iterable[int] = (), rollback: int = 1) -> list[int]:
        """Keep the checkpoints deployments and training need (``RunStore.prune_deployed``): the latest and the
        live weights' step (after a ``restore``) whole, with ``keep``; those the model's deployments point at, and
        the ``rollback`` steps before each, as weights alone; delete the others and return their steps. Between
        steps: a checkpoint being written waits for it."""
        trainer = self.trainer(model)  # registered: this backend owns the directory
        async with self._step_locks[(model.project, model.name)]:
            whole = {trainer.step, *keep}
            return await asyncio.to_thread(self.run(model).prune_deployed, whole, rollback)

    async def _experimental_push_to_s3(
        self,
        model: Model,
        *,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> None:
        """ART's checkpoint sync: the model's directory to ``<s3_bucket>/<prefix>/<project>/models/<name>``, where
        ``s3_bucket`` is a bucket name (S3, needs ``s3fs``) or any fsspec URL (``flywheel.checkpoints.sync``)."""
        url = sync.remote_url(model.project, model.name, s3_bucket, prefix)
        async with self._step_locks.get((model.project, model.name)) or contextlib.nullcontext():  # between steps
            await asyncio.to_thread(sync.push, self.model_dir(model), url, delete=delete, verbose=verbose)

    async def _experimental_pull_from_s3(
        self,
        model: Model,
        *,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
        only_step: int | Literal["latest"] | None = None,
    ) -> None:
        """ART's checkpoint sync, the other way: before ``register`` (which then resumes from what was pulled)."""
        if (model.project, model.name) in self._trainers:
            raise RuntimeError(f"Model '{model.name}' is registered here: pull its directory before register().")
        url = sync.remote_url(model.project, model.name, s3_bucket, prefix)
        run = RunStore(self.model_dir(model))
        await asyncio.to_thread(sync.pull_run, run, url, only_step=only_step, delete=delete, verbose=verbose)

    async def _experimental_deploy(
        self,
        deploy_to: str,
        model: TrainableModel,
        step: int | None = None,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        pull_s3: bool = True,
        wait_for_completion: bool = True,
    ) -> NoReturn:
        """ART's deployment of a checkpoint to hosted LoRA inference, which needs Together AI's API and an S3 bucket
        (ART uploads the checkpoint there for Together to fetch): not available here, so it raises an error that
        says so and how to serve the checkpoint with Flywheel instead. The arguments are ART's."""
        served = f"{model.name}@{step}" if step is not None else model.name
        url = f"{self._server.base_url}/v1" if self._server is not None else "backend.base_url, once registered"
        raise NotImplementedError(
            f"backend._experimental_deploy(deploy_to={str(getattr(deploy_to, 'value', deploy_to))!r}) needs Together "
            "AI's hosted LoRA inference (https://api.together.xyz, with TOGETHER_API_KEY) and an S3 bucket to upload "
            "the checkpoint to; Flywheel does not deploy to a hosting service. Serve the checkpoint yourself: this "
            f"backend's server answers model={served!r} ({url}), `flywheel serve --model <checkpoint dir>` serves "
            f"one on its own, and `flywheel deploy {model.name}@production --step {'N' if step is None else step}` "
            "points a deployment alias at a step (docs/user-guide.md, 'Deployments and the audit trail')."
        )

    async def close(self) -> None:
        if self._replicas is not None and self._trainers:
            await next(iter(self._trainers.values())).engine.call(self._replicas.stop)
        await asyncio.to_thread(self.loggers.finish)
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self.gateway is not None:
            self.gateway.store.close()
            self.gateway = None
        for engine in [
            *self._engines.values(),
            *(t.engine for t in self._trainers.values()),
            *self._checkpoint_engines.values(),
        ]:
            engine.close()
        self._engines.clear()
        self._trainers.clear()
        self._checkpoint_engines.clear()
        for run in self._runs.values():  # the model directories are free for another backend
            run.unlock()
        self._runs.clear()
        self._step_locks.clear()
        self._extras.clear()
        self._trained.clear()
        for served in self.registry.all():  # drop the last references to the engines' models
            self.registry.remove(served.name)

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
