"""The dashboard's approvals, under ``/ui/api/approvals``: the high-impact tool calls waiting for a person (oldest
first), the latest decisions, the deployments' tool policies, and the two decisions a person takes (approve, deny;
``{by, reason?}``). On ``flywheel serve`` a decision goes through the server's approval desk and its waiting call
goes on at once; on ``flywheel dashboard`` (another process) through the store, where the waiting server sees it
within a second. A decision on an approval no longer pending is a 409 that says what became of it."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from flywheel.approvals.desk import ApprovalDesk
from flywheel.approvals.routes import ApprovalId, Decided, DecisionBody
from flywheel.dashboard.common import PREFIX
from flywheel.store import approvals
from flywheel.store.approvals import ApprovalRecord, ApprovalStatus, ToolPolicyRecord

RECENT = 20  # decided approvals shown


class ApprovalsOut(BaseModel):
    pending: list[ApprovalRecord]
    recent: list[ApprovalRecord]  # the latest decided, newest first
    policies: list[ToolPolicyRecord]


def approvals_ui_router(desk: ApprovalDesk) -> APIRouter:
    router = APIRouter(prefix=f"{PREFIX}/approvals", tags=["dashboard"])
    run = desk.store.run

    @router.get("")
    async def listed() -> ApprovalsOut:
        await run(approvals.expire_due)
        pending = await run(approvals.list_approvals, status=ApprovalStatus.pending, limit=500)
        latest = await run(approvals.list_approvals, limit=RECENT + len(pending))
        recent = [a for a in latest if a.status != ApprovalStatus.pending][:RECENT]
        return ApprovalsOut(pending=pending, recent=recent, policies=await run(approvals.list_policies))

    @router.post("/{approval_id}/{decision}")
    async def decide(approval_id: ApprovalId, decision: Decided, body: DecisionBody) -> ApprovalRecord:
        return await desk.decide(approval_id, approve=decision == "approve", by=body.by, reason=body.reason)

    return router
