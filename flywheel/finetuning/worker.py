"""The fine-tuning jobs' worker (``JobWorker``): queued jobs run one at a time, oldest first, on a ``LocalBackend``
of its own, in a thread with its own event loop, so that a job's training never waits on the HTTP server's loop
nor holds it.

A job's model is a Flywheel model like any other (project ``fine-tuning``, named as OpenAI names fine-tuned models:
``ft:<base>:flywheel:<suffix>:<id>``), served as ``name`` and ``name@step`` by the server that created it. A
supervised job trains one epoch at a time (``LocalBackend.train_sft``, the examples shuffled by the job's seed and
the epoch), each epoch ending in a checkpoint (its loss, and the validation file's when there is one), an event per
step with its metrics. A reinforcement job's step answers a batch of rows several times each, grades the answers
with the job's grader and takes a GRPO step; every ``eval_interval`` steps the validation rows are graded and a
checkpoint recorded. Cancel and pause take effect at the next step: the model is let go of (in SFT what the epoch
had not checkpointed is dropped: a resumed job starts that epoch again). A server stopped mid-job finds it
``running`` when it starts again and resumes it from its last checkpoint; a job that cannot go on is ``failed``
with the reason, never lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import threading
import time
from collections import OrderedDict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from flywheel.finetuning import gate
from flywheel.finetuning.files import Files
from flywheel.finetuning.wire import ORGANIZATION
from flywheel.graders.data import RFTRow
from flywheel.graders.rollout import rft_rollout
from flywheel.graders.scoring import score_group
from flywheel.graders.spec import parse_grader
from flywheel.inference.registry import ServedModel, UnknownModelError
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.store import Store, finetuning
from flywheel.store.finetuning import JobStatus
from flywheel.store.schema import FineTuningCheckpoint
from flywheel.store.schema import FineTuningJob as JobRow
from flywheel.train.config import SFTConfig, TrainConfig
from flywheel.types import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)

PROJECT = "fine-tuning"  # the project of the jobs' models, under the worker's home
SFT_LEARNING_RATE = 2e-4  # learning_rate_multiplier 1 (LoRA's usual rate)
RL_LEARNING_RATE = 5e-6  # learning_rate_multiplier 1 in RFT (ART's default)
MAX_MODELS = 2  # jobs' models registered at once on the worker's backend (each holds an engine)
RFT_MAX_TOKENS = 512  # an RFT answer's most tokens, by default


class _Pace:
    """When a running job should finish, at the pace of its steps since it started (or restarted) running."""

    def __init__(self, first: int, total: int):
        self.start, self.first, self.total = time.monotonic(), first, total

    def finish(self, step: int) -> datetime | None:
        if step <= self.first:
            return None
        per_step = (time.monotonic() - self.start) / (step - self.first)
        return finetuning.now() + timedelta(seconds=per_step * (self.total - step))


class _Stop(Exception):
    """A running job was cancelled or paused: its training stops at the step."""


def fine_tuned_name(job: JobRow) -> str:
    """OpenAI's shape: ``ft:<base>:<organization>:<suffix>:<id>`` (the base without '/', the suffix maybe empty)."""
    base = job.model.replace("/", "-")
    return f"ft:{base}:{ORGANIZATION}:{job.suffix or ''}:{job.id.removeprefix('ftjob-')[:8]}"


class JobWorker:
    """Runs queued jobs, oldest first, one at a time, on its own ``LocalBackend`` (home ``home``) in a thread of its
    own. ``start`` returns once it is ready; ``stop`` leaves a running job ``running`` (the next start resumes it)."""

    def __init__(
        self,
        store: Store,
        files: Files,
        home: Path,
        *,
        backend_options: dict[str, Any] | None = None,
        max_tokens: int = RFT_MAX_TOKENS,
    ):
        """``max_tokens``: the most tokens an RFT answer may take (OpenAI's jobs have no such field)."""
        self.store, self.files, self.home, self.max_tokens = store, files, home, max_tokens
        self.backend_options = backend_options or {}
        self.backend: LocalBackend | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._wake, self._ready, self._stopping = threading.Event(), threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._models: OrderedDict[str, TrainableModel] = OrderedDict()  # registered, least recently used first
        self._models_lock = threading.Lock()  # ``serve`` reads and reorders it from the server's threads
        self._training: str | None = None  # the running job's model, never let go of while it trains

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="fine-tuning-jobs", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def stop(self, timeout: float = 60.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wake(self) -> None:
        self._wake.set()

    def serve(self, name: str) -> ServedModel | None:
        """The server registry's loader (called off its event loop): a job's model or one of its checkpoints
        (``name``, ``name@step``), served by this worker's backend (a finished job's model is registered again
        after a restart). None for a name no job made."""
        if self.backend is None or self.loop is None:
            return None
        model_name = name.rpartition("@")[0] if "@" in name else name
        with self._models_lock:  # registered already (and that checkpoint loaded): no store, no hop to the worker
            if model_name in self._models:
                self._models.move_to_end(model_name)
                with contextlib.suppress(UnknownModelError):
                    return self.backend.registry.get(name)
        with self.store.session() as s:
            job = finetuning.find_job_by_model(s, model_name)
            base = None if job is None else job.base_model
        if base is None:
            return None
        model = TrainableModel(name=model_name, project=PROJECT, base_model=base)
        backend = self.backend

        async def served() -> ServedModel | None:
            await self._load(model)
            try:
                return await backend.registry.resolve(name)
            except UnknownModelError:
                if name != f"{model_name}@0":
                    return None
            # step 0, which no weights were saved for (an RFT job's first steps trained nothing): its LoRA adapter
            # starts at zero, so its weights are the base model's
            await backend.load(base)
            return backend.registry.get(base)

        return asyncio.run_coroutine_threadsafe(served(), self.loop).result()

    async def _load(self, model: TrainableModel) -> TrainableModel:
        """``model`` registered on the worker's backend (the one registered already, if it is), after letting go of
        the least recently used others beyond ``MAX_MODELS`` (each holds an engine): a request for one of those
        registers it again."""
        assert self.backend is not None
        with self._models_lock:
            if model.name in self._models:
                self._models.move_to_end(model.name)
                return self._models[model.name]
            evicted = [n for n in self._models if n != self._training][: max(0, len(self._models) + 1 - MAX_MODELS)]
            gone = [self._models.pop(name) for name in evicted]
        for old in gone:
            await self.backend.unregister(old)
        await model.register(self.backend)
        with self._models_lock:
            self._models[model.name] = model
        return model

    async def _unload(self, model: TrainableModel) -> None:
        assert self.backend is not None
        with self._models_lock:
            self._models.pop(model.name, None)
        await self.backend.unregister(model)

    async def _main(self) -> None:
        try:
            self.loop = asyncio.get_running_loop()
            # its own loopback server: RFT samples the job's model as an agent would (rft_rollout)
            self.backend = LocalBackend(path=self.home, **self.backend_options)
            with self.store.session() as s:
                for job in finetuning.jobs_in(s, JobStatus.running):  # the server stopped while it ran
                    finetuning.add_event(s, job.id, "The server restarted: the job resumes from its last checkpoint")
                    job.status = JobStatus.queued
        except BaseException as exc:
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping.is_set():
                with self.store.session() as s:
                    job = finetuning.next_queued(s)
                    if job is not None:
                        s.expunge(job)
                if job is None:
                    await asyncio.to_thread(self._wake.wait, 5.0)
                    self._wake.clear()
                    continue
                await self._run(job)
        finally:
            await self.backend.close()

    async def _run(self, job: JobRow) -> None:
        try:
            await (self._supervised if job.method["type"] == "supervised" else self._reinforcement)(job)
        except _Stop:
            pass
        except Exception as exc:  # a job that cannot go on is failed with the reason, never lost
            log.exception("fine-tuning job %s failed", job.id)
            with self.store.session() as s:
                row = finetuning.get_job(s, job.id)
                if row.status not in finetuning.FINAL:
                    message = f"{type(exc).__name__}: {exc}"
                    finetuning.set_status(s, row, JobStatus.failed, error={"code": "server_error", "message": message, "param": None})  # fmt: skip
                    finetuning.add_event(s, job.id, f"The job failed: {message}", level="error")
            if (model := self._models.get(self._training or "")) is not None:  # its live weights are half-trained
                with contextlib.suppress(Exception):
                    await self._unload(model)
        finally:
            self._training = None

    def _status(self, job_id: str) -> JobStatus:
        with self.store.session() as s:
            return JobStatus(finetuning.get_job(s, job_id).status)

    async def _supervised(self, job: JobRow) -> None:
        assert self.backend is not None
        hyper = job.method["supervised"]["hyperparameters"]
        epochs, batch = hyper["n_epochs"], hyper["batch_size"]
        train = [_trajectory(r) for r in self.files.rows(job.training_file, "training_file")]
        valid = [_trajectory(r) for r in self.files.rows(job.validation_file, "validation_file")] if job.validation_file else []  # fmt: skip
        steps_per_epoch = math.ceil(len(train) / batch)
        started = await self._start(job)
        if started is None:
            return
        model, done = started
        step = await model.get_step()
        if done and step > done[-1].step:  # an epoch's checkpoint was written, its record not: recorded now
            done.append(await self._checkpoint(job, model, len(done) + 1, {}, valid))
        config = SFTConfig(learning_rate=SFT_LEARNING_RATE * hyper["learning_rate_multiplier"], batch_size=batch)
        total = steps_per_epoch * epochs
        pace = _Pace(await model.get_step(), total)
        for epoch in range(len(done) + 1, epochs + 1):
            order = list(train)
            random.Random(job.seed * 1000 + epoch).shuffle(order)
            first = await model.get_step()

            seen: list[dict[str, float]] = []

            def progress(metrics: dict[str, float], epoch: int = epoch, first: int = first, seen: list = seen) -> None:
                """Each step's event; a job no longer running (cancelled, paused) stops here."""
                if self._should_stop(job):
                    raise _Stop
                seen.append(metrics)
                taken = first + len(seen)
                self._step_event(
                    job.id, f"Step {taken}/{total}: training loss={metrics['loss']:.4f}", pace,
                    {"step": taken, "train_loss": metrics["loss"], "total_steps": total, "epoch": epoch,
                     "tokens": metrics["tokens_trained"]},
                )  # fmt: skip

            try:
                history = await self.backend.train_sft(model, order, config, progress)
            except _Stop:
                await self._unload(model)  # what the epoch had not checkpointed is dropped
                raise
            loss = sum(h["loss"] for h in history) / len(history) if history else math.nan
            tokens = sum(int(h["tokens_trained"]) for h in history)
            with self.store.session() as s:
                row = finetuning.get_job(s, job.id)
                row.trained_tokens = (row.trained_tokens or 0) + tokens
            await self._checkpoint(job, model, epoch, {"train_loss": loss}, valid)
            await self._stop_if_asked(job, model)  # paused or cancelled while the epoch ended
        self._succeed(job, model.name)

    async def _start(self, job: JobRow) -> tuple[TrainableModel, list[FineTuningCheckpoint]] | None:
        """The job's model, registered, and its checkpoints so far; None if the job is no longer queued."""
        assert self.backend is not None
        with self.store.session() as s:
            row = finetuning.get_job(s, job.id)
            if row.status != JobStatus.queued:
                return None
            row.status = JobStatus.running
            done = finetuning.checkpoints(s, job.id)
            for c in done:
                s.expunge(c)
            finetuning.add_event(s, job.id, "Fine-tuning job started" if not done else f"Fine-tuning job resumed after step {done[-1].step}")  # fmt: skip
        model = TrainableModel(name=job.fine_tuned_model or fine_tuned_name(job), project=PROJECT, base_model=job.base_model)  # fmt: skip
        self._training = model.name
        return await self._load(model), done

    def _should_stop(self, job: JobRow) -> bool:
        """Cancelled or paused, or the server is stopping (the job stays running: the next start resumes it)."""
        return self._stopping.is_set() or self._status(job.id) != JobStatus.running

    async def _stop_if_asked(self, job: JobRow, model: TrainableModel) -> None:
        if self._should_stop(job):
            await self._unload(model)
            raise _Stop

    def _step_event(self, job_id: str, message: str, pace: _Pace, data: dict[str, Any]) -> None:
        """A step's metrics event, and the job's estimated finish at the pace of its steps so far."""
        with self.store.session() as s:
            finetuning.add_event(s, job_id, message, type_="metrics", data=data)
            finetuning.get_job(s, job_id).estimated_finish = pace.finish(data["step"])

    def _succeed(self, job: JobRow, name: str) -> None:
        """The job's model created, its step metrics kept as its result file, the job succeeded."""
        with self.store.session() as s:
            steps: dict[int, dict[str, float]] = {}
            for event in finetuning.list_events(s, job.id, after=None, limit=1_000_000)[::-1]:  # oldest first
                if event.type == "metrics" and event.data:
                    data = {k: v for k, v in event.data.items() if k not in ("total_steps", "epoch", "tokens")}
                    steps.setdefault(int(data["step"]), {}).update(data)
            for checkpoint in finetuning.checkpoints(s, job.id):  # validation metrics; a step's own train loss stays
                row = steps.setdefault(checkpoint.step, {"step": checkpoint.step})
                row |= {k: v for k, v in checkpoint.metrics.items() if k not in row}
        results = self.files.create_results([steps[step] for step in sorted(steps)])
        with self.store.session() as s:
            row = finetuning.get_job(s, job.id)
            row.result_files = [results.id]
            row.fine_tuned_model = name
            finetuning.add_event(s, job.id, f"New fine-tuned model created: {name}")
            finetuning.set_status(s, row, JobStatus.succeeded)
            finetuning.add_event(s, job.id, "The job has successfully completed")

    async def _reinforcement(self, job: JobRow) -> None:
        """RFT: each step, ``batch_size`` training rows, each answered ``group_size`` times (4 x compute_multiplier)
        and graded; a GRPO step on the groups (one whose answers all score alike has nothing to teach); every
        ``eval_interval`` steps the validation rows (``eval_samples`` answers each) are graded and a checkpoint
        recorded. The position is the step count of its metrics events: a restarted job goes on after the last. A job
        whose metadata asks for the gate ends by sending its best checkpoint through it (``gate.py``)."""
        assert self.backend is not None
        spec = job.method["reinforcement"]
        hyper, grader = spec["hyperparameters"], parse_grader(spec["grader"], "method.reinforcement.grader")
        train, valid = self._rft_rows(job.training_file, "training_file"), []
        if job.validation_file:
            valid = self._rft_rows(job.validation_file, "validation_file")
        batch, interval = hyper["batch_size"], hyper["eval_interval"]
        group_size = max(2, round(4 * hyper["compute_multiplier"]))
        per_epoch = math.ceil(len(train) / batch)
        total = per_epoch * hyper["n_epochs"]
        started = await self._start(job)
        if started is None:
            return
        model, done = started
        with self.store.session() as s:
            position = finetuning.last_metrics_step(s, job.id)
        if position and (position % interval == 0 or position == total) and all(c.step != position for c in done):
            await self._checkpoint(job, model, (position - 1) // per_epoch + 1, {}, [], position)  # record lost
        config = TrainConfig(learning_rate=RL_LEARNING_RATE * hyper["learning_rate_multiplier"])
        # every answer at temperature 1, in the job's response_format (guided: the grader gets what it parses)
        sampling = {"temperature": 1.0, "max_tokens": self.max_tokens}
        sampling |= {"response_format": spec["response_format"]} if spec.get("response_format") else {}
        pace = _Pace(position, total)
        for step in range(position + 1, total + 1):
            await self._stop_if_asked(job, model)
            epoch, index = divmod(step - 1, per_epoch)
            order = list(train)
            random.Random(job.seed * 1000 + epoch).shuffle(order)
            rows = order[index * batch : (index + 1) * batch]
            groups = await asyncio.gather(*(self._rft_group(model, row, grader, group_size, sampling) for row in rows))
            result = await self.backend.train(model, groups, config)
            rewards = [t.reward for g in groups for t in g.trajectories]
            mean = sum(rewards) / len(rewards)
            trained = "" if not result.metrics.get("skipped") else " (no step: every group's answers scored alike)"
            self._step_event(
                job.id, f"Step {step}/{total}: train reward={mean:.4f}{trained}", pace,
                {"step": step, "total_steps": total, "train_reward_mean": mean, "epoch": epoch + 1},
            )  # fmt: skip
            if step % interval == 0 or step == total:
                metrics = {"train_reward_mean": mean}
                if valid:
                    metrics["valid_reward_mean"] = await self._rft_eval(
                        model, valid, grader, hyper["eval_samples"], sampling
                    )
                    metrics["full_valid_reward_mean"] = metrics["valid_reward_mean"]
                await self._checkpoint(job, model, epoch + 1, metrics, [], step)
        if gate.requested(job.meta) is not None and not gate.decided(self.store, job.id):
            await self._stop_if_asked(job, model)  # cancelled or paused as training ended: no decision for it
            await gate.send_through_gate(job, self.store, model, self.backend, grader, valid,
                                         samples=hyper["eval_samples"], sampling=sampling)  # fmt: skip
        await self._stop_if_asked(job, model)  # cancelled while it was judged: cancelled, never succeeded
        self._succeed(job, model.name)

    def _rft_rows(self, file_id: str, param: str) -> list[RFTRow]:
        """A file's rows as RFT rows: the messages (and tools) asked, every other field the grader's item."""
        rows = []
        for i, row in enumerate(self.files.rows(file_id, param)):
            item = {k: v for k, v in row.items() if k not in ("messages", "tools")}
            rows.append(RFTRow(index=i, messages=row["messages"], tools=row.get("tools"), item=item))
        return rows

    async def _rft_group(self, model: TrainableModel, row: RFTRow, grader, size: int, sampling: dict[str, Any]) -> TrajectoryGroup:  # fmt: skip
        answers = await asyncio.gather(*(rft_rollout(model, row, **sampling) for _ in range(size)))
        return await score_group(grader, TrajectoryGroup(answers), lambda _: row.item)

    async def _rft_eval(self, model: TrainableModel, rows: list[RFTRow], grader, samples: int, sampling: dict[str, Any]) -> float:  # fmt: skip
        groups = await asyncio.gather(*(self._rft_group(model, row, grader, samples, sampling) for row in rows))
        rewards = [t.reward for g in groups for t in g.trajectories]
        return sum(rewards) / len(rewards)

    async def _checkpoint(
        self,
        job: JobRow,
        model: TrainableModel,
        epoch: int,
        metrics: dict[str, float],
        valid: list[Trajectory],
        step: int | None = None,
    ) -> FineTuningCheckpoint:
        """Record the live weights as the job's checkpoint at ``step`` (the job's step; default the model's: an RFT
        step whose groups all tied took none, so two of its checkpoints may name the same weights), with
        ``metrics`` and, given ``valid``, SFT's validation loss."""
        assert self.backend is not None
        at = await model.get_step()
        step = at if step is None else step
        if valid:
            metrics = metrics | {"valid_loss": (await self.backend.sft_loss(model, valid))["loss"]}
            metrics["full_valid_loss"] = metrics["valid_loss"]
        with self.store.session() as s:
            row = finetuning.add_checkpoint(s, job.id, step=step, epoch=epoch, model=model.get_inference_name(at), metrics=metrics)  # fmt: skip
            said = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            finetuning.add_event(s, job.id, f"Checkpoint created at step {step} (epoch {epoch}): {row.model}" + (f"; {said}" if said else ""))  # fmt: skip
            s.expunge(row)
        return row


def _trajectory(row: dict[str, Any]) -> Trajectory:
    return Trajectory(messages_and_choices=row["messages"], tools=row.get("tools"))
