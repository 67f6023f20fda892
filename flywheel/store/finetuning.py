"""The fine-tuning API's records: uploaded files, jobs (OpenAI's states), their events and checkpoints.

``flywheel.finetuning`` serves them; here they are only rows. A job's status moves through OpenAI's states:
``validating_files`` -> ``queued`` -> ``running`` -> ``succeeded`` | ``failed`` | ``cancelled`` (``paused`` while
paused). Lists are newest first with OpenAI's cursor: ``after`` is the id of the last object of the page before."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from flywheel.store.schema import FineTuningCheckpoint, FineTuningEvent, FineTuningFile, FineTuningJob


class JobStatus(StrEnum):
    validating_files = "validating_files"
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    paused = "paused"


FINAL = (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class UnknownObjectError(KeyError):
    """No file, job or checkpoint by that id: a 404 naming it."""

    def __init__(self, kind: str, object_id: str, param: str):
        self.kind, self.object_id, self.param = kind, object_id, param
        super().__init__(f"No such {kind}: '{object_id}'.")

    def __str__(self) -> str:
        return str(self.args[0])


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> datetime:
    return datetime.now(UTC)


# ---- files ---------------------------------------------------------------------------------------------------------


def add_file(s: Session, *, file_id: str, filename: str, purpose: str, size: int, lines: int, sha256: str) -> FineTuningFile:  # fmt: skip
    row = FineTuningFile(id=file_id, filename=filename, purpose=purpose, bytes=size, lines=lines, sha256=sha256, created_at=now())  # fmt: skip
    s.add(row)
    s.flush()
    return row


def get_file(s: Session, file_id: str, param: str = "file_id") -> FineTuningFile:
    row = s.get(FineTuningFile, file_id)
    if row is None:
        raise UnknownObjectError("file", file_id, param)
    return row


def list_files(s: Session, *, purpose: str | None, after: str | None, limit: int, order: str = "desc") -> list[FineTuningFile]:  # fmt: skip
    query = select(FineTuningFile)
    if purpose is not None:
        query = query.where(FineTuningFile.purpose == purpose)
    key = (FineTuningFile.created_at, FineTuningFile.id)
    if after is not None:
        last = get_file(s, after, "after")
        newer = (FineTuningFile.created_at > last.created_at) | (
            (FineTuningFile.created_at == last.created_at) & (FineTuningFile.id > last.id)
        )
        older = (FineTuningFile.created_at < last.created_at) | (
            (FineTuningFile.created_at == last.created_at) & (FineTuningFile.id < last.id)
        )
        query = query.where(older if order == "desc" else newer)
    query = query.order_by(*(k.desc() for k in key) if order == "desc" else key)
    return list(s.scalars(query.limit(limit)))


def delete_file(s: Session, file_id: str) -> None:
    s.delete(get_file(s, file_id))


# ---- jobs ----------------------------------------------------------------------------------------------------------


def add_job(s: Session, **fields: Any) -> FineTuningJob:
    """A new job, ``validating_files``, last in the queue."""
    seq = (s.scalar(select(func.max(FineTuningJob.seq))) or 0) + 1
    row = FineTuningJob(
        id=new_id("ftjob"), seq=seq, status=JobStatus.validating_files, created_at=now(), cancel_requested=False,
        **fields,
    )  # fmt: skip
    s.add(row)
    s.flush()
    return row


def get_job(s: Session, job_id: str, param: str = "fine_tuning_job_id") -> FineTuningJob:
    row = s.get(FineTuningJob, job_id)
    if row is None:
        raise UnknownObjectError("fine-tuning job", job_id, param)
    return row


def list_jobs(s: Session, *, after: str | None, limit: int, meta: dict[str, str] | None = None) -> list[FineTuningJob]:  # fmt: skip
    query = select(FineTuningJob)
    if after is not None:
        query = query.where(FineTuningJob.seq < get_job(s, after, "after").seq)
    rows = s.scalars(query.order_by(FineTuningJob.seq.desc()))
    picked = []
    for row in rows:  # metadata filters are few and rows small: matched here, portably (JSON operators differ)
        if meta and any(row.meta.get(k) != v for k, v in meta.items()):
            continue
        picked.append(row)
        if len(picked) == limit:
            break
    return picked


def next_queued(s: Session) -> FineTuningJob | None:
    """The oldest job waiting to run."""
    query = select(FineTuningJob).where(FineTuningJob.status == JobStatus.queued)
    return s.scalars(query.order_by(FineTuningJob.seq).limit(1)).first()


def jobs_in(s: Session, status: JobStatus) -> list[FineTuningJob]:
    """The jobs in ``status``, oldest first."""
    query = select(FineTuningJob).where(FineTuningJob.status == status)
    return list(s.scalars(query.order_by(FineTuningJob.seq)))


def set_status(s: Session, job: FineTuningJob, status: JobStatus, *, error: dict | None = None) -> None:
    job.status = status
    if status in FINAL:
        job.finished_at, job.estimated_finish = now(), None
        job.error = error


# ---- events and checkpoints ----------------------------------------------------------------------------------------


def add_event(s: Session, job_id: str, message: str, *, level: str = "info", type_: str = "message", data: dict | None = None) -> FineTuningEvent:  # fmt: skip
    row = FineTuningEvent(job_id=job_id, level=level, type=type_, message=message, data=data or {}, created_at=now())
    s.add(row)
    s.flush()
    return row


def event_id(row: FineTuningEvent) -> str:
    return f"ftevent-{row.id:012d}"


def list_events(s: Session, job_id: str, *, after: str | None, limit: int) -> list[FineTuningEvent]:
    get_job(s, job_id)
    query = select(FineTuningEvent).where(FineTuningEvent.job_id == job_id)
    if after is not None:
        number = after.removeprefix("ftevent-")
        if not number.isdigit():
            raise UnknownObjectError("event", after, "after")
        query = query.where(FineTuningEvent.id < int(number))
    return list(s.scalars(query.order_by(FineTuningEvent.id.desc()).limit(limit)))


def add_checkpoint(s: Session, job_id: str, *, step: int, epoch: int, model: str, metrics: dict) -> FineTuningCheckpoint:  # fmt: skip
    row = FineTuningCheckpoint(id=new_id("ftckpt"), job_id=job_id, step=step, epoch=epoch, model=model, metrics=metrics, created_at=now())  # fmt: skip
    s.add(row)
    s.flush()
    return row


def checkpoints(s: Session, job_id: str) -> list[FineTuningCheckpoint]:
    """The job's checkpoints, oldest first."""
    query = select(FineTuningCheckpoint).where(FineTuningCheckpoint.job_id == job_id)
    return list(s.scalars(query.order_by(FineTuningCheckpoint.step)))


def list_checkpoints(s: Session, job_id: str, *, after: str | None, limit: int) -> list[FineTuningCheckpoint]:
    get_job(s, job_id)
    rows = checkpoints(s, job_id)[::-1]
    if after is not None:
        ids = [r.id for r in rows]
        if after not in ids:
            raise UnknownObjectError("checkpoint", after, "after")
        rows = rows[ids.index(after) + 1 :]
    return rows[:limit]


def find_job_by_model(s: Session, name: str) -> FineTuningJob | None:
    """The job whose model is ``name``: its ``fine_tuned_model``, or the model its checkpoints were taken of."""
    job = s.scalars(select(FineTuningJob).where(FineTuningJob.fine_tuned_model == name).limit(1)).first()
    if job is not None:
        return job
    query = select(FineTuningCheckpoint.job_id).where(FineTuningCheckpoint.model.startswith(f"{name}@", autoescape=True))  # fmt: skip
    job_id = s.scalars(query.limit(1)).first()
    return None if job_id is None else s.get(FineTuningJob, job_id)


def last_metrics_step(s: Session, job_id: str) -> int:
    """The step of the job's last metrics event (0 before any): where a restarted job goes on."""
    query = select(FineTuningEvent.data).where(FineTuningEvent.job_id == job_id, FineTuningEvent.type == "metrics")
    last = s.scalars(query.order_by(FineTuningEvent.id.desc()).limit(1)).first()
    return int(last["step"]) if last else 0
