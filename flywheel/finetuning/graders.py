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
    """``graders/run``'s body: ``model_sample`` is the model's output text (``sample.output_json`` when it is valid
    JSON), ``item`` the dataset row."""

    grader: dict[str, Any]
    model_sample: str
    item: dict[str, Any] = Field(default_factory=dict)


class GraderValidate(_Body):
    """``graders/validate``'s body."""

    grader: dict[str, Any]


def _errors(result: GradeResult) -> dict[str, Any]:
    """OpenAI's error flags (each kind that occurred), with the details OpenAI gives for some."""
    raised = {_AS_OPENAI.get(kind, kind) for kind in result.errors}
    details = result.error_details
    flags: dict[str, Any] = {flag: flag in raised for flag in _FLAGS}
    flags["python_grader_runtime_error_details"] = details.get(kinds.PYTHON_GRADER_RUNTIME) or details.get(
        kinds.PYTHON_GRADER_FORBIDDEN
    )
    flags["python_grader_server_error_type"] = (
        kinds.PYTHON_GRADER_MEMORY if kinds.PYTHON_GRADER_MEMORY in details else None
    )
    flags["model_grader_server_error_details"] = details.get(kinds.MODEL_GRADER_SERVER)
    return flags


def run_response(result: GradeResult) -> dict[str, Any]:
    """``graders/run``'s answer, checked against the SDK's ``GraderRunResponse``, with Flywheel's message for each
    error kind added as ``metadata.error_details``."""
    metadata = {
        "name": result.name,
        "type": result.type,
        "errors": _errors(result),
        "execution_time": result.latency_s,
        "scores": result.details,
        "sampled_model_name": None,
        "token_usage": None,
    }
    body = GraderRunResponse.model_validate(
        {
            "reward": result.reward,
            "sub_rewards": result.sub_rewards,
            "metadata": metadata,
            "model_grader_token_usage_per_model": {},
        }
    )
    answer = body.model_dump(mode="json", by_alias=True)
    answer["metadata"]["error_details"] = result.error_details
    return answer


def graders_router() -> APIRouter:
    """The two routes, mounted by ``flywheel.server.app``. A malformed grader raises ``GraderSpecError`` (a
    ``ValueError``), which the app answers as a 400 ``invalid_request_error`` naming where it is wrong."""
    router = APIRouter()

    @router.post("/v1/fine_tuning/alpha/graders/validate")
    async def validate(body: GraderValidate) -> dict[str, Any]:
        parse_grader(body.grader, "grader")
        # The grader as given: the SDK's GraderValidateResponse types a multi grader's `graders` as one grader, not
        # OpenAI's {name: grader} map, so it is not built from that type.
        return {"grader": body.grader}

    @router.post("/v1/fine_tuning/alpha/graders/run")
    async def run(body: GraderRun) -> dict[str, Any]:
        grader = parse_grader(body.grader, "grader")
        return run_response(await grade(grader, Sample.from_text(body.model_sample), body.item))

    return router
