"""``/v1/fine_tuning/alpha/graders/run`` and ``/validate`` as OpenAI serves them, on ``flywheel.graders``: a grader
checked (a 400 naming where it is wrong) or run on one model sample and dataset item. A grade that fails (a python
grader that raises, a template naming a field the item lacks) is still a 200 with reward 0 and its error flagged
in ``metadata.errors``, as OpenAI answers it; what exactly failed is in ``metadata.errors.*_details`` and the
non-standard ``metadata.error_details``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from openai.types.fine_tuning.alpha import GraderRunResponse
from pydantic import BaseModel, ConfigDict, Field

from flywheel.graders import errors as kinds
from flywheel.graders.run import GradeResult, grade
from flywheel.graders.sample import Sample
from flywheel.graders.spec import parse_grader

# Flywheel's finer kinds, as the flag OpenAI raises for them
_AS_OPENAI = {
    kinds.FORMULA_EVAL: kinds.FORMULA_PARSE,
    kinds.PYTHON_GRADER_TIMEOUT: "unresponsive_reward_error",
    kinds.PYTHON_GRADER_MEMORY: kinds.PYTHON_GRADER_SERVER,
    kinds.PYTHON_GRADER_FORBIDDEN: kinds.PYTHON_GRADER_RUNTIME,
}
_FLAGS = (
    kinds.FORMULA_PARSE, kinds.INVALID_VARIABLE, kinds.MODEL_GRADER_PARSE, kinds.MODEL_GRADER_REFUSAL,
    kinds.MODEL_GRADER_SERVER, kinds.OTHER, kinds.PYTHON_GRADER_RUNTIME, kinds.PYTHON_GRADER_SERVER,
    kinds.SAMPLE_PARSE, "truncated_observation_error", "unresponsive_reward_error",
)  # fmt: skip


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GraderRun(_Body):
    grader: dict[str, Any]
    model_sample: str
    item: dict[str, Any] = Field(default_factory=dict)


class GraderValidate(_Body):
    grader: dict[str, Any]


def _errors(result: GradeResult) -> dict[str, Any]:
    """OpenAI's error flags (each kind that occurred), with the details OpenAI gives for some."""
    raised = {_AS_OPENAI.get(kind, kind) for kind in result.errors}
    flags: dict[str, Any] = {flag: flag in raised for flag in _FLAGS}
    details = result.error_details
    flags["python_grader_runtime_error_details"] = details.get(kinds.PYTHON_GRADER_RUNTIME) or details.get(kinds.PYTHON_GRADER_FORBIDDEN)  # fmt: skip
    flags["python_grader_server_error_type"] = kinds.PYTHON_GRADER_MEMORY if kinds.PYTHON_GRADER_MEMORY in details else None  # fmt: skip
    flags["model_grader_server_error_details"] = details.get(kinds.MODEL_GRADER_SERVER)
    return flags


def run_response(result: GradeResult) -> dict[str, Any]:
    metadata = {
        "name": result.name, "type": result.type, "errors": _errors(result), "execution_time": result.latency_s,
        "scores": result.details, "sampled_model_name": None, "token_usage": None,
    }  # fmt: skip
    body = GraderRunResponse.model_validate(
        {"reward": result.reward, "sub_rewards": result.sub_rewards, "metadata": metadata,
         "model_grader_token_usage_per_model": {}}
    )  # fmt: skip
    return body.model_dump(mode="json", by_alias=True) | {"metadata": body.metadata.model_dump(mode="json", by_alias=True) | {"error_details": result.error_details}}  # fmt: skip


def graders_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/fine_tuning/alpha/graders/validate")
    async def validate(body: GraderValidate):
        parse_grader(body.grader, "grader")  # a GraderSpecError (a ValueError) is the 400 naming where
        return {"grader": body.grader}  # as given (the SDK's type takes a multi grader's map as one grader)

    @router.post("/v1/fine_tuning/alpha/graders/run")
    async def run(body: GraderRun):
        grader = parse_grader(body.grader, "grader")
        return run_response(await grade(grader, Sample.from_text(body.model_sample), body.item))

    return router
