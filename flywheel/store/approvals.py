"""Tool policies and approvals: which tools a deployment may call (its scope) and which are high-impact, and each
high-impact call's approval request with its decision.

A policy belongs to a deployment alias (``calc@production``; the alias need not exist yet). An approval is requested
with a deadline; it is decided once: approved or denied (by a person, or by a policy off production), or expired
(its deadline passed: a denial). Every policy change, request and decision is an audit event written in the same unit
of work (subject ``approval/<id>`` for an approval, the alias for a policy), so the trail says who allowed what.
A decision taken on an approval that is no longer pending (decided, or past its deadline) is an
``ApprovalClosedError`` that says what became of it; it changes nothing.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from flywheel.gateway.schemas import Timestamp, _utc
from flywheel.store import audit
from flywheel.store.deployments import parse_alias
from flywheel.store.schema import Approval, ToolPolicy

MAX_TIMEOUT_S = 86_400.0  # a day: a call waits at most this long for a person
MAX_ARGUMENTS = 20_000  # characters of a call's arguments kept (the rest cut, and said so)


class Otherwise(StrEnum):
    """What decides a high-impact call off production (training, evaluation), where nobody waits for a person."""

    deny = "deny"
    allow = "allow"
    grader = "grader"  # the policy's grader: allowed at or above its threshold


class ApprovalStatus(StrEnum):
    pending = "pending"
    approved = "approved"
    denied = "denied"
    expired = "expired"  # its deadline passed with no decision: the call was denied


class UnknownApprovalError(LookupError):
    def __init__(self, approval_id: int, latest: int | None):
        known = f"the latest is {latest}" if latest is not None else "there are none"
        super().__init__(f"No approval {approval_id} ({known}).")

    def __str__(self) -> str:
        return str(self.args[0])


class NoToolPolicyError(LookupError):
    def __init__(self, deployment: str, known: list[str]):
        super().__init__(
            f"'{deployment}' has no tool policy: any tool is in its scope and none is high-impact (deployments with "
            f"one: {', '.join(known) or 'none'})."
        )

    def __str__(self) -> str:
        return str(self.args[0])


class ApprovalClosedError(RuntimeError):
    """A decision on an approval that is not pending any more."""


class ToolPolicyRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    deployment: str
    allowed: list[str] | None
    high_impact: list[str]
    timeout_s: float
    otherwise: Otherwise
    grader: dict[str, Any] | None
    threshold: float
    updated_at: Timestamp
    updated_by: str
    event_id: int

    def in_scope(self, tool: str) -> bool:
        return self.allowed is None or tool in self.allowed

    @property
    def scope(self) -> str:
        """The tools it may call, as a person reads them."""
        return "any tool" if self.allowed is None else ", ".join(self.allowed) or "none"


class ApprovalRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    deployment: str | None
    episode_id: str | None
    split: str | None
    tool: str
    arguments: str
    call_id: str | None
    status: ApprovalStatus
    requested_at: Timestamp
    deadline: Timestamp
    decided_at: Timestamp | None
    decided_by: str | None
    reason: str | None
    request_event: int
    decision_event: int | None


def _names(field: str, value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    for name in value:
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ValueError(f"{field} holds {name!r}: a tool name is a non-empty string of at most 256 characters")
    return sorted(set(value))


def _check_timeout(timeout_s: float) -> None:
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s was {timeout_s}; it must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds")


def set_policy(
    s: Session,
    deployment: str,
    *,
    high_impact: list[str],
    allowed: list[str] | None = None,
    timeout_s: float = 300.0,
    otherwise: Otherwise | str = Otherwise.deny,
    grader: dict[str, Any] | None = None,
    threshold: float = 0.5,
    actor: str,
    reason: str | None = None,
) -> ToolPolicyRecord:
    """Set the tool policy of ``deployment`` (replacing its previous one), with its audit event ``tools.policy``.
    ``allowed`` None: any tool is in scope. A ``ValueError`` says what is wrong (nothing written)."""
    parse_alias(deployment)
    high, scope = _names("high_impact", high_impact) or [], _names("allowed", allowed)
    if scope is not None and (outside := [t for t in high if t not in scope]):
        raise ValueError(
            f"high-impact tool {outside[0]!r} is not in the allowed tools ({', '.join(scope) or 'none'}): a tool "
            "outside the scope is refused, never asked about"
        )
    _check_timeout(timeout_s)
    try:
        rule = Otherwise(otherwise)
    except ValueError:
        raise ValueError(f"otherwise was {otherwise!r}; it must be one of {', '.join(Otherwise)}") from None
    if (rule is Otherwise.grader) != (grader is not None):
        raise ValueError("a grader is needed exactly when otherwise is 'grader' (it decides off production)")
    if not math.isfinite(threshold):
        raise ValueError(f"threshold was {threshold}; it must be a finite number")
    details = {"allowed": scope, "high_impact": high, "timeout_s": timeout_s, "otherwise": rule.value,
               "grader": grader, "threshold": threshold}  # fmt: skip
    event = audit.append(s, actor=actor, action="tools.policy", subject=deployment, reason=reason, details=details)
    row = s.get(ToolPolicy, deployment) or ToolPolicy(deployment=deployment)
    row.allowed, row.high_impact, row.timeout_s, row.otherwise = scope, high, timeout_s, rule.value
    row.grader, row.threshold, row.updated_at, row.updated_by, row.event_id = (
        grader,
        threshold,
        event.at,
        actor,
        event.id,
    )
    s.add(row)
    s.flush()
    return ToolPolicyRecord.model_validate(row)


def find_policy(s: Session, deployment: str) -> ToolPolicyRecord | None:
    row = s.get(ToolPolicy, deployment)
    return None if row is None else ToolPolicyRecord.model_validate(row)


def get_policy(s: Session, deployment: str) -> ToolPolicyRecord:
    """The policy of ``deployment`` (``NoToolPolicyError`` naming those that have one, if it has none)."""
    if (found := find_policy(s, deployment)) is None:
        raise NoToolPolicyError(deployment, [p.deployment for p in list_policies(s)])
    return found


def list_policies(s: Session) -> list[ToolPolicyRecord]:
    return [ToolPolicyRecord.model_validate(r) for r in s.scalars(select(ToolPolicy).order_by(ToolPolicy.deployment))]


def remove_policy(s: Session, deployment: str, *, actor: str, reason: str | None = None) -> None:
    """Drop ``deployment``'s policy (any tool in scope, none high-impact), audited as ``tools.policy_removed``."""
    get_policy(s, deployment)
    audit.append(s, actor=actor, action="tools.policy_removed", subject=deployment, reason=reason)
    s.delete(s.get(ToolPolicy, deployment))
    s.flush()


def request(
    s: Session,
    *,
    tool: str,
    arguments: str,
    timeout_s: float,
    actor: str,
    deployment: str | None = None,
    episode_id: str | None = None,
    split: str | None = None,
    call_id: str | None = None,
) -> ApprovalRecord:
    """Record a pending approval of one call of ``tool`` (decided by ``timeout_s`` from now, or expired), with its
    audit event ``approval.request``."""
    _check_timeout(timeout_s)
    if len(arguments) > MAX_ARGUMENTS:
        arguments = arguments[:MAX_ARGUMENTS] + f"... [cut: {len(arguments)} characters in all]"
    audit.lock(s)
    now = datetime.now(UTC)
    row = Approval(
        deployment=deployment, episode_id=episode_id, split=split, tool=tool, arguments=arguments, call_id=call_id,
        status=ApprovalStatus.pending.value, requested_at=now, deadline=now + timedelta(seconds=timeout_s),
        request_event=0,
    )  # fmt: skip
    s.add(row)
    s.flush()  # its id, for the event's subject
    details = {"tool": tool, "deployment": deployment, "episode_id": episode_id, "split": split, "call_id": call_id,
               "timeout_s": timeout_s}  # fmt: skip
    event = audit.append(s, actor=actor, action="approval.request", subject=f"approval/{row.id}", details=details)
    row.request_event = event.id
    s.flush()
    return ApprovalRecord.model_validate(row)


def _row(s: Session, approval_id: int, *, lock: bool = False) -> Approval:
    query = select(Approval).where(Approval.id == approval_id)
    row = s.scalars(query.with_for_update() if lock else query).first()
    if row is None:
        raise UnknownApprovalError(approval_id, s.scalar(select(func.max(Approval.id))))
    return row


def get(s: Session, approval_id: int) -> ApprovalRecord:
    return ApprovalRecord.model_validate(_row(s, approval_id))


def decide(
    s: Session, approval_id: int, *, approve: bool | None, actor: str, reason: str | None = None
) -> ApprovalRecord:
    """Approve (``approve=True``), deny (False) or expire (None: its deadline passed) a pending approval, with its
    audit event (``approval.approve``, ``.deny``, ``.expire``). One past its deadline is expired instead (the
    record says so: a caller compares its status with what it asked). One decided before is an
    ``ApprovalClosedError``, and nothing changes."""
    audit.lock(s)  # orders two deciders: the second reads the first's decision
    row = _row(s, approval_id, lock=True)
    if row.status != ApprovalStatus.pending:
        raise ApprovalClosedError(closed_message(ApprovalRecord.model_validate(row)))
    now = datetime.now(UTC)
    if approve is not None and now > _utc(row.deadline):
        approve, actor, reason = None, "timeout", None
    status = {True: ApprovalStatus.approved, False: ApprovalStatus.denied, None: ApprovalStatus.expired}[approve]
    _close(s, row, status, actor, reason, now)
    return ApprovalRecord.model_validate(row)


def closed_message(record: ApprovalRecord) -> str:
    """What a decision on an approval no longer pending is told."""
    by = f" by {record.decided_by}" if record.decided_by else ""
    at = f" at {record.decided_at:%Y-%m-%d %H:%M:%S}" if record.decided_at else ""
    return f"Approval {record.id} ({record.tool}) is {record.status}{by}{at}; a decision is taken once"


_ACTIONS = {ApprovalStatus.approved: "approve", ApprovalStatus.denied: "deny", ApprovalStatus.expired: "expire"}


def _close(s: Session, row: Approval, status: ApprovalStatus, actor: str, reason: str | None, now: datetime) -> None:
    event = audit.append(
        s, actor=actor, action=f"approval.{_ACTIONS[status]}", subject=f"approval/{row.id}", reason=reason,
        details={"tool": row.tool, "deployment": row.deployment, "episode_id": row.episode_id},
    )  # fmt: skip
    row.status, row.decided_at, row.decided_by, row.reason = status.value, now, actor, reason or None
    row.decision_event = event.id
    s.flush()


def expire_due(s: Session) -> int:
    """Expire the pending approvals whose deadline passed (their waiter is gone: a server stopped while one waited);
    how many."""
    now = datetime.now(UTC)
    due = list(s.scalars(select(Approval.id).where(Approval.status == ApprovalStatus.pending.value,
                                                    Approval.deadline < now)))  # fmt: skip
    for approval_id in due:
        decide(s, approval_id, approve=None, actor="timeout")
    return len(due)


def list_approvals(
    s: Session, *, status: ApprovalStatus | None = None, limit: int = 100, offset: int = 0
) -> list[ApprovalRecord]:
    """Approvals, newest first (pending ones oldest first: the order to decide them in)."""
    query = select(Approval)
    if status is not None:
        query = query.where(Approval.status == status.value)
    order = Approval.id.asc() if status is ApprovalStatus.pending else Approval.id.desc()
    return [ApprovalRecord.model_validate(r) for r in s.scalars(query.order_by(order).limit(limit).offset(offset))]


def count_pending(s: Session) -> int:
    return s.scalar(select(func.count()).where(Approval.status == ApprovalStatus.pending.value)) or 0
