"""The approvals over HTTP (on ``flywheel serve`` with a store; errors in OpenAI's shape):

- ``POST /approvals`` ``{tool, arguments?, call_id?, deployment?, episode_id?, split?, timeout_s?}`` -> 201, a pending
  approval (an agent's own request: ``HumanApprover``); ``GET /approvals/{id}/decision?wait=S`` -> its status and
  decision, waiting up to ``S`` seconds (at most 30) for one. These two need an agent key.
- ``GET /approvals?status=&limit=&offset=`` -> ``{"data": [...]}`` (pending ones oldest first, else newest first);
  ``GET /approvals/{id}``; ``POST /approvals/{id}/approve`` and ``/deny`` ``{by, reason?}`` -> the approval, decided
  (409: it was decided or expired before, which the message says).
- ``GET /tool-policies``; ``GET``, ``PUT`` ``{high_impact, allowed?, timeout_s?, otherwise?, grader?, threshold?, by,
  reason?}`` and ``DELETE /tool-policies/{deployment}``: a deployment's tool scope and high-impact tools.

Reading and deciding need an admin key (the server's keys: ``flywheel.gateway.auth``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flywheel.approvals.desk import ApprovalDesk
from flywheel.approvals.policy import ToolCallRequest
from flywheel.graders import parse_grader
from flywheel.server.errors import error_response
from flywheel.store import approvals
from flywheel.store.approvals import (
    MAX_TIMEOUT_S,
    ApprovalClosedError,
    ApprovalRecord,
    ApprovalStatus,
    NoToolPolicyError,
    Otherwise,
    ToolPolicyRecord,
    UnknownApprovalError,
)

MAX_WAIT_S = 30.0  # a decision's long poll
Decided = Literal["approve", "deny"]  # the two decisions a person takes (POST /approvals/{id}/approve | /deny)
ApprovalId = Annotated[int, PathParam(ge=1, le=2**62, description="An approval's id.")]  # within a database integer


class NewApproval(ToolCallRequest):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S, description="Then the call is denied (expired).")


class DecisionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: str = Field(min_length=1, max_length=256, description="Who decides (the audit event's actor).")
    reason: str | None = Field(None, max_length=2000)


class PolicyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    high_impact: list[str] = Field(max_length=256)
    allowed: list[str] | None = Field(None, max_length=256, description="The scope; None: any tool.")
    timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S)
    otherwise: Otherwise = Otherwise.deny
    grader: dict[str, Any] | None = None
    threshold: float = 0.5
    by: str = Field(min_length=1, max_length=256)
    reason: str | None = Field(None, max_length=2000)

    @field_validator("grader")
    @classmethod
    def _a_grader(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """A grader that could not decide is refused now, not at the first call it should decide (GraderSpecError
        is a ValueError: a 400 naming what is wrong)."""
        if value is not None:
            parse_grader(value, "grader")
        return value


class DecisionOut(BaseModel):
    id: int
    tool: str
    status: ApprovalStatus
    decided_by: str | None
    reason: str | None
    deadline: float  # Unix seconds


async def _unknown(_: Request, exc: Exception) -> JSONResponse:
    return error_response(404, str(exc), "invalid_request_error", code="not_found")


async def _closed(_: Request, exc: Exception) -> JSONResponse:
    return error_response(409, str(exc), "invalid_request_error", code="approval_closed")


ERRORS = {UnknownApprovalError: _unknown, NoToolPolicyError: _unknown, ApprovalClosedError: _closed}
"""The handlers an app with these routes (or the dashboard's) installs: ``app.add_exception_handler``."""


def approvals_router(desk: ApprovalDesk) -> APIRouter:
    router = APIRouter(tags=["approvals"])
    run = desk.store.run

    @router.post("/approvals", status_code=201)
    async def create(body: NewApproval) -> ApprovalRecord:
        return await desk.request(ToolCallRequest(**body.model_dump(exclude={"timeout_s"})), body.timeout_s, "agent")

    @router.get("/approvals/{approval_id}/decision")
    async def decision(approval_id: ApprovalId, wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 0) -> DecisionOut:
        record = await desk.wait(approval_id, wait)
        return DecisionOut(id=record.id, tool=record.tool, status=record.status, decided_by=record.decided_by,
                           reason=record.reason, deadline=record.deadline.timestamp())  # fmt: skip

    @router.get("/approvals")
    async def list_(
        status: ApprovalStatus | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    ) -> dict[str, Any]:
        await run(approvals.expire_due)
        found = await run(approvals.list_approvals, status=status, limit=limit, offset=offset)
        return {"object": "list", "data": [a.model_dump(mode="json") for a in found]}

    @router.get("/approvals/{approval_id}")
    async def get(approval_id: ApprovalId) -> ApprovalRecord:
        return await run(approvals.get, approval_id)

    @router.post("/approvals/{approval_id}/{decision}")
    async def decide(approval_id: ApprovalId, decision: Decided, body: DecisionBody) -> ApprovalRecord:
        return await desk.decide(approval_id, approve=decision == "approve", by=body.by, reason=body.reason)

    @router.get("/tool-policies")
    async def policies() -> dict[str, Any]:
        found = await run(approvals.list_policies)
        return {"object": "list", "data": [p.model_dump(mode="json") for p in found]}

    @router.get("/tool-policies/{deployment}")
    async def policy(deployment: str) -> ToolPolicyRecord:
        return await run(approvals.get_policy, deployment)

    @router.put("/tool-policies/{deployment}")
    async def set_policy(deployment: str, body: PolicyBody) -> ToolPolicyRecord:
        fields = body.model_dump(exclude={"by"})
        return await run(approvals.set_policy, deployment, **fields, actor=body.by)

    @router.delete("/tool-policies/{deployment}")
    async def remove_policy(deployment: str, by: Annotated[str, Query(min_length=1, max_length=256)]) -> dict:
        await run(approvals.remove_policy, deployment, actor=by)
        return {"deployment": deployment, "deleted": True}

    return router
