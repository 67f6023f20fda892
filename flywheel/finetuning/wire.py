"""The fine-tuning API's request bodies (pydantic, refusing fields OpenAI does not have) and its response objects,
which are the openai SDK's own types built from the store's rows, so that the SDK parses them as OpenAI's."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from openai.types import FileDeleted, FileObject
from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint
from pydantic import BaseModel, ConfigDict, Field

from flywheel.store import finetuning
from flywheel.store.schema import FineTuningCheckpoint, FineTuningEvent, FineTuningFile
from flywheel.store.schema import FineTuningJob as JobRow

ORGANIZATION = "flywheel"  # the organization part of fine-tuned models' names, and the jobs' organization_id

Auto = Literal["auto"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hyperparameters(_Body):
    """Supervised (and the deprecated top-level ``hyperparameters``): "auto" lets the server choose."""

    batch_size: Auto | int = Field("auto", description="Examples per optimizer step.")
    learning_rate_multiplier: Auto | float = "auto"
    n_epochs: Auto | int = "auto"

    def checked(self) -> Hyperparameters:
        for name in ("batch_size", "n_epochs"):
            value = getattr(self, name)
            if value != "auto" and not 1 <= value <= 256:
                raise ValueError(f"hyperparameters.{name} must be 'auto' or 1 to 256, got {value}")
        lr = self.learning_rate_multiplier
        if lr != "auto" and not 0 < lr <= 100:
            raise ValueError(f"hyperparameters.learning_rate_multiplier must be 'auto' or above 0, got {lr}")
        return self


class SupervisedMethod(_Body):
    hyperparameters: Hyperparameters = Hyperparameters()


class ReinforcementHyperparameters(Hyperparameters):
    compute_multiplier: Auto | float = "auto"
    eval_interval: Auto | int = "auto"
    eval_samples: Auto | int = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] = "default"


class ReinforcementMethod(_Body):
    grader: dict[str, Any]
    hyperparameters: ReinforcementHyperparameters = ReinforcementHyperparameters()
    response_format: dict[str, Any] | None = None


class Method(_Body):
    type: Literal["supervised", "reinforcement", "dpo"]
    supervised: SupervisedMethod | None = None
    reinforcement: ReinforcementMethod | None = None
    dpo: dict[str, Any] | None = None


class Integration(_Body):
    type: Literal["wandb"]
    wandb: dict[str, Any]


class JobCreate(_Body):
    """``POST /v1/fine_tuning/jobs``'s body, as the openai SDK sends it."""

    model: str = Field(min_length=1)
    training_file: str = Field(min_length=1)
    validation_file: str | None = None
    hyperparameters: Hyperparameters | None = None  # deprecated by OpenAI in favour of method: supervised only
    method: Method | None = None
    suffix: str | None = Field(None, max_length=64)
    seed: int | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    integrations: list[Integration] | None = None


def _ts(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


def file_object(row: FineTuningFile) -> dict[str, Any]:
    return FileObject(
        id=row.id, bytes=row.bytes, created_at=_ts(row.created_at), filename=row.filename, object="file",
        purpose=row.purpose, status="processed",
    ).model_dump(mode="json", exclude_none=True)  # fmt: skip


def file_deleted(file_id: str) -> dict[str, Any]:
    return FileDeleted(id=file_id, deleted=True, object="file").model_dump(mode="json")


def job_object(row: JobRow) -> dict[str, Any]:
    """A job as OpenAI returns it: ``hyperparameters`` are the method's (resolved once the job validated). Its
    status and method are set after the SDK's type checked the rest: the type has no ``paused``, which OpenAI's
    pause returns, and takes a multi grader's ``graders`` as one grader where OpenAI's docs give a map of them (the
    SDK takes both as they come)."""
    kind = row.method["type"]
    hyper = {k: v for k, v in row.method.get(kind, {}).get("hyperparameters", {}).items() if k in Hyperparameters.model_fields}  # fmt: skip
    return FineTuningJob.model_validate(
        {
            "id": row.id, "object": "fine_tuning.job", "created_at": _ts(row.created_at), "model": row.model,
            "organization_id": ORGANIZATION, "status": "queued", "training_file": row.training_file,
            "validation_file": row.validation_file, "fine_tuned_model": row.fine_tuned_model,
            "finished_at": _ts(row.finished_at), "error": row.error, "hyperparameters": hyper, "seed": row.seed,
            "result_files": row.result_files or [], "trained_tokens": row.trained_tokens, "metadata": row.meta or None,
            "estimated_finish": _ts(row.estimated_finish), "integrations": None,
        }
    ).model_dump(mode="json") | {"status": str(row.status), "method": row.method}  # fmt: skip


def event_object(row: FineTuningEvent) -> dict[str, Any]:
    return FineTuningJobEvent(
        id=finetuning.event_id(row), created_at=_ts(row.created_at), level=row.level, message=row.message,
        object="fine_tuning.job.event", data=row.data, type=row.type,
    ).model_dump(mode="json")  # fmt: skip


def checkpoint_object(row: FineTuningCheckpoint) -> dict[str, Any]:
    return FineTuningJobCheckpoint.model_validate(
        {
            "id": row.id, "created_at": _ts(row.created_at), "fine_tuned_model_checkpoint": row.model,
            "fine_tuning_job_id": row.job_id, "metrics": {"step": row.step, **row.metrics},
            "object": "fine_tuning.job.checkpoint", "step_number": row.step,
        }
    ).model_dump(mode="json", exclude_none=True)  # fmt: skip


def page(rows: list[Any], limit: int, to_object: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's list object from ``rows`` read with one more than ``limit`` (so that ``has_more`` is known); the SDK
    pages on with the last item's id as ``after`` while ``has_more``."""
    return {"object": "list", "data": [to_object(r) for r in rows[:limit]], "has_more": len(rows) > limit}
