"""``/v1/fine_tuning/alpha/graders/run`` and ``/validate`` as OpenAI serves them, on ``flywheel.graders``: a grader
checked (a 400 naming where it is wrong) or run on one model sample and dataset item. A grade that fails (a python
grader that raises, a template naming a field the item lacks) is still a 200 with reward 0 and its error flagged
in ``metadata.errors``, as OpenAI answers it; what exactly failed is in ``metadata.errors.*_details`` and
Flywheel's ``metadata.error_details`` (with ``metadata.error_counts``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from openai.types.fine_tuning.alpha import GraderRunResponse
from pydantic import BaseModel, ConfigDict, Field

from flywheel.graders.run import GradeResult, grade
from flywheel.graders.sample import Sample
from flywheel.graders.spec import parse_grader


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


def run_response(result: GradeResult) -> dict[str, Any]:
    """``graders/run``'s answer (``GradeResult.to_openai``), checked against the SDK's ``GraderRunResponse``, with
    Flywheel's additions (``metadata.error_counts``, ``metadata.error_details``) kept."""
    answer = result.to_openai()
    checked = GraderRunResponse.model_validate(answer).model_dump(mode="json", by_alias=True)
    checked["metadata"] |= {k: answer["metadata"][k] for k in ("error_counts", "error_details")}
    return checked


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
