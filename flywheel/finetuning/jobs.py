"""Fine-tuning jobs as the API creates and changes them (``Jobs``): the model (or an alias), the files, the method
and its hyperparameters checked, with a 400 naming what is wrong; "auto" hyperparameters resolved; a job recorded
``validating_files`` while its files' examples are checked off the request, then ``queued`` (its events as OpenAI's:
validating, validated) for the worker (``flywheel.finetuning.worker``) to run, or ``failed`` naming the line at
fault; cancel, pause and resume."""

from __future__ import annotations

import logging
import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from flywheel.finetuning import gate
from flywheel.finetuning.files import Files
from flywheel.finetuning.wire import Hyperparameters, JobCreate, SupervisedMethod
from flywheel.graders.spec import GraderSpecError, parse_grader
from flywheel.graders.templates import variables
from flywheel.openai_api import ResponseFormat
from flywheel.store import Store, finetuning
from flywheel.store.finetuning import JobStatus
from flywheel.store.schema import FineTuningJob as JobRow

if TYPE_CHECKING:
    from flywheel.finetuning.worker import JobWorker

AUTO_EPOCHS = 3
log = logging.getLogger(__name__)


class JobError(ValueError):
    """A job that cannot be created (or changed) as asked: a 400 with ``param`` and ``code``."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class BaseModels:
    """The base models jobs may name: those this server trains, and ``aliases`` (e.g. ``gpt-4.1-mini`` -> the
    embedded model) so that scripts written for OpenAI's run unchanged."""

    served: list[str]
    aliases: dict[str, str] = field(default_factory=dict)

    def resolve(self, name: str) -> str:
        if name in self.served:
            return name
        if name in self.aliases:
            return self.aliases[name]
        aliases = "".join(f", {a} (-> {b})" for a, b in sorted(self.aliases.items()))
        raise JobError(
            f"The model '{name}' cannot be fine-tuned here. Models this server fine-tunes: {', '.join(self.served)}"
            f"{aliases}. (An alias is configured with flywheel serve --fine-tune-alias NAME=MODEL.)",
            "model", "model_not_available",
        )  # fmt: skip


def item_fields(grader: Any) -> set[str]:
    """The dataset fields a grader's templates read (``{{item.answer}}`` -> ``answer``), anywhere in its spec."""
    if isinstance(grader, str):
        return {str(path[1]) for path in variables(grader) if path[0] == "item" and len(path) > 1}
    if isinstance(grader, dict):
        return set().union(*(item_fields(v) for v in grader.values()))
    if isinstance(grader, list):
        return set().union(*(item_fields(v) for v in grader))
    return set()


def _examples_problem(rows: list[dict[str, Any]], kind: str, fields: set[str]) -> str | None:
    """What makes a file unusable for a ``kind`` job whose grader reads ``fields`` (the first line at fault)."""
    for number, row in enumerate(rows, start=1):
        messages = row.get("messages")
        if messages is None:
            return f"line {number} is a preference example (input, preferred_output...): a {kind} job needs 'messages'"
        if kind == "supervised" and not any(m.get("role") == "assistant" and m.get("weight", 1) != 0 for m in messages):
            return f"line {number} has no assistant message to train on (one without weight 0)"
        if kind == "reinforcement" and (missing := sorted(fields - row.keys())):
            return f"line {number} has no '{missing[0]}', which the grader reads ({{{{item.{missing[0]}}}}})"
    return None


def _resolved(kind: str, hyper: dict[str, Any], examples: int, validation: int) -> dict[str, Any]:
    """The hyperparameters a job runs with: "auto" replaced by what this server chooses."""
    batch = hyper.get("batch_size", "auto")
    epochs = hyper.get("n_epochs", "auto")
    lr = hyper.get("learning_rate_multiplier", "auto")
    resolved = hyper | {
        "batch_size": max(1, min(8 if kind == "supervised" else 4, examples)) if batch == "auto" else batch,
        "n_epochs": (AUTO_EPOCHS if kind == "supervised" else 1) if epochs == "auto" else epochs,
        "learning_rate_multiplier": 1.0 if lr == "auto" else lr,
    }
    if kind == "reinforcement":
        per_epoch = math.ceil(examples / resolved["batch_size"])
        resolved |= {
            "compute_multiplier": 1.0 if hyper["compute_multiplier"] == "auto" else hyper["compute_multiplier"],
            "eval_interval": per_epoch if hyper["eval_interval"] == "auto" else hyper["eval_interval"],
            "eval_samples": 2 if hyper["eval_samples"] == "auto" else hyper["eval_samples"],
        }
    return resolved


def _check(hyper: Hyperparameters, param: str) -> None:
    try:
        hyper.checked()
    except ValueError as exc:
        raise JobError(str(exc), param, "invalid_value") from None


class Jobs:
    """Creating, listing and changing jobs (the HTTP routes' side); ``worker`` runs them."""

    def __init__(self, store: Store, files: Files, models: BaseModels, worker: JobWorker):
        self.store, self.files, self.models, self.worker = store, files, models, worker
        # files are read and checked one job at a time, beside the worker (never behind a job that trains)
        self._validator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fine-tuning-validation")

    def create(self, body: JobCreate) -> JobRow:
        """Check what can be checked at once (the model, the method, its grader and hyperparameters, that the files
        exist, the gate's metadata: a 400 naming the field) and record the job ``validating_files``; its files'
        examples are checked next, off the request (``validate``)."""
        base = self.models.resolve(body.model)
        method = self._method(body)
        kind = method["type"]
        examples = self.files.examples(body.training_file, "training_file")
        validation = self.files.examples(body.validation_file, "validation_file") if body.validation_file else 0
        try:
            if gate.requested(body.metadata) is not None and (kind != "reinforcement" or not validation):
                raise ValueError(f"metadata.{gate.GATE_KEY}: the gate grades answers to the validation file: a "
                                 "reinforcement job with a validation_file can end through it")  # fmt: skip
        except ValueError as exc:
            raise JobError(str(exc), "metadata", "invalid_metadata") from None
        hyper = method[kind]["hyperparameters"]
        method[kind]["hyperparameters"] = _resolved(kind, hyper, examples, validation)
        seed = body.seed if body.seed is not None else random.SystemRandom().randrange(2**31)
        with self.store.session() as s:
            job = finetuning.add_job(
                s, model=body.model, base_model=base, method=method, training_file=body.training_file,
                validation_file=body.validation_file, suffix=body.suffix, seed=seed, meta=body.metadata or {},
            )  # fmt: skip
            finetuning.add_event(s, job.id, f"Validating training file: {body.training_file}")
            if body.validation_file:
                finetuning.add_event(s, job.id, f"Validating validation file: {body.validation_file}")
            if kind == "reinforcement" and hyper.get("reasoning_effort", "default") != "default":
                finetuning.add_event(s, job.id, f"reasoning_effort '{hyper['reasoning_effort']}' is ignored: the "
                                  "model answers as it is asked.", level="warn")  # fmt: skip
            if body.integrations:
                finetuning.add_event(s, job.id, "Integrations (wandb) are not run by this server: set WANDB_API_KEY "
                                  "where it runs to log its models' steps to W&B.", level="warn")  # fmt: skip
            s.flush()  # its changes are written before it leaves the session
            s.expunge(job)
        self._validator.submit(self.validate, job.id)
        return job

    def validate(self, job_id: str) -> None:
        """Check a ``validating_files`` job's examples against its method (something to train on; for RFT, every
        field its grader reads): queued for the worker, or ``failed`` with OpenAI's ``invalid_training_file`` or
        ``invalid_validation_file`` error naming the line. A job cancelled meanwhile is left as it is; one whose
        check itself failed is ``failed`` with the reason (a store that is down: validated again at the next start)."""
        try:
            self._validate(job_id)
        except Exception as exc:
            log.exception("validating fine-tuning job %s", job_id)
            with self.store.session() as s:
                job = finetuning.get_job(s, job_id)
                if job.status == JobStatus.validating_files:
                    message = f"The files could not be validated: {type(exc).__name__}: {exc}"
                    finetuning.set_status(s, job, JobStatus.failed, error={"code": "server_error", "message": message, "param": None})  # fmt: skip
                    finetuning.add_event(s, job.id, f"The job failed: {message}", level="error")

    def _validate(self, job_id: str) -> None:
        with self.store.session() as s:
            job = finetuning.get_job(s, job_id)
            if job.status != JobStatus.validating_files:
                return
            s.expunge(job)
        kind = job.method["type"]
        fields = item_fields(job.method[kind].get("grader"))
        error = None
        for param, file_id in (("training_file", job.training_file), ("validation_file", job.validation_file)):
            try:
                problem = file_id and _examples_problem(self.files.rows(file_id, param), kind, fields)
            except (OSError, ValueError) as exc:  # deleted (a FileError) or unreadable since it was checked
                problem = str(exc)
            if problem:
                error = {"code": f"invalid_{param}", "param": param, "message": f"Invalid {param} ({file_id}): {problem}."}  # fmt: skip
                break
        with self.store.session() as s:
            job = finetuning.get_job(s, job_id)
            if job.status != JobStatus.validating_files:
                return
            if error is not None:
                finetuning.set_status(s, job, JobStatus.failed, error=error)
                finetuning.add_event(s, job.id, f"The job failed: {error['message']}", level="error")
                return
            finetuning.add_event(s, job.id, "Files validated, moving job to queued state")
            finetuning.set_status(s, job, JobStatus.queued)
        self.worker.wake()

    def validate_left(self) -> None:
        """Validate again the jobs a stopped server left ``validating_files`` (none is lost)."""
        with self.store.session() as s:
            left = [job.id for job in finetuning.jobs_in(s, JobStatus.validating_files)]
        for job_id in left:
            self._validator.submit(self.validate, job_id)

    def close(self) -> None:
        self._validator.shutdown(wait=True, cancel_futures=True)

    def _method(self, body: JobCreate) -> dict[str, Any]:
        """The job's method, as stored: ``{"type": kind, kind: {"hyperparameters": {...}, ...}}``."""
        method = body.method
        if method is None or method.type == "supervised":
            if method is not None and body.hyperparameters is not None:
                raise JobError("Give the hyperparameters in method.supervised, not at the top level too.", "hyperparameters")  # fmt: skip
            if method is None:  # the deprecated top-level hyperparameters: supervised's
                hyper = body.hyperparameters or Hyperparameters()
            else:
                hyper = (method.supervised or SupervisedMethod()).hyperparameters
            _check(hyper, "method.supervised.hyperparameters")
            return {"type": "supervised", "supervised": {"hyperparameters": hyper.model_dump()}}
        if method.type == "reinforcement":
            given = method.reinforcement
            if given is None:
                raise JobError("method.reinforcement is required (its grader, hyperparameters).", "method.reinforcement")  # fmt: skip
            try:
                parse_grader(given.grader, "method.reinforcement.grader")
            except GraderSpecError as exc:
                raise JobError(str(exc), "method.reinforcement.grader", "invalid_grader") from None
            _check(given.hyperparameters, "method.reinforcement.hyperparameters")
            if given.response_format is not None:
                try:
                    TypeAdapter(ResponseFormat).validate_python(given.response_format)
                except ValidationError as exc:
                    where = "method.reinforcement.response_format"
                    raise JobError(f"{where} is not a chat response_format: {exc.errors()[0]['msg']}", where) from None
            return {"type": "reinforcement", "reinforcement": given.model_dump(exclude_none=True)}
        raise JobError(
            f"method.type '{method.type}' is not run by this server: supervised and reinforcement are.",
            "method.type", "unsupported_method",
        )  # fmt: skip

    def _change(self, job_id: str, action: str) -> JobRow:
        with self.store.session() as s:
            job = finetuning.get_job(s, job_id)
            status = JobStatus(job.status)
            if action == "cancel":
                if status in finetuning.FINAL:
                    raise JobError(f"Job {job_id} is {status}: it cannot be cancelled.", "fine_tuning_job_id", "job_already_finished")  # fmt: skip
                finetuning.set_status(s, job, JobStatus.cancelled)
                finetuning.add_event(s, job.id, "Job cancelled" + (" (its training stops at the next step)" if status == JobStatus.running else ""))  # fmt: skip
            elif action == "pause":
                if status not in (JobStatus.running, JobStatus.queued):
                    raise JobError(f"Job {job_id} is {status}: only a running or queued job can be paused.", "fine_tuning_job_id", "invalid_job_state")  # fmt: skip
                job.status, job.estimated_finish = JobStatus.paused, None
                finetuning.add_event(s, job.id, "Job paused" + (" (its training stops at the next step)" if status == JobStatus.running else ""))  # fmt: skip
            else:  # resume
                if status != JobStatus.paused:
                    raise JobError(f"Job {job_id} is {status}: only a paused job can be resumed.", "fine_tuning_job_id", "invalid_job_state")  # fmt: skip
                job.status = JobStatus.queued
                finetuning.add_event(s, job.id, "Job resumed: queued")
            s.flush()  # its changes are written before it leaves the session
            s.expunge(job)
        self.worker.wake()
        return job

    def cancel(self, job_id: str) -> JobRow:
        return self._change(job_id, "cancel")

    def pause(self, job_id: str) -> JobRow:
        return self._change(job_id, "pause")

    def resume(self, job_id: str) -> JobRow:
        return self._change(job_id, "resume")
