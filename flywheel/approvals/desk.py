"""The approval desk: where high-impact calls wait for a person, on the server, over the store.

``ApprovalDesk.ask`` records a pending approval and waits for its decision until its deadline (then it is expired:
a denial). A decision taken in this process (the HTTP routes, the dashboard) wakes its waiter at once; one taken
elsewhere (``flywheel approvals approve`` in another process, another replica) is seen at the next poll of the
store. ``review`` is the gateway's part: a model's tool calls through a deployment checked against its tool policy:
out of scope is refused, a high-impact call in production waits for a person, off production the policy's rule
decides (recorded too, so every decision is in the audit trail), a shadow's calls are never run and need none.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable

from openai.types.chat import ChatCompletionMessage
from sqlalchemy.orm import Session

from flywheel.approvals.policy import Approver, Decision, GraderApprover, ToolCallRequest, allow, deny
from flywheel.store import Store, approvals
from flywheel.store.approvals import ApprovalRecord, ApprovalStatus, Otherwise, ToolPolicyRecord

POLL_S = 1.0  # how often a waiter reads the store for a decision taken in another process
PRODUCTION = "production"
SHADOW = "shadow"
GATEWAY = "gateway"  # the audit actor of what the gateway records itself


def decision_of(record: ApprovalRecord) -> Decision:
    """The decision a closed approval holds."""
    return Decision(tool=record.tool, call_id=record.call_id, verdict=record.status.value,  # type: ignore[arg-type]
                    by=record.decided_by or "", reason=record.reason, approval_id=record.id)  # fmt: skip


class ToolNotInScopeError(PermissionError):
    """A request that offers the model a tool its deployment may not call (a 403 naming it and the scope)."""

    def __init__(self, policy: ToolPolicyRecord, tool: str) -> None:
        super().__init__(f"{policy.deployment} may not call the tool '{tool}': its tools are {policy.scope}.")

    def __str__(self) -> str:
        return str(self.args[0])


def refuse_out_of_scope(policy: ToolPolicyRecord, tools: list[dict] | None) -> None:
    """Raise ``ToolNotInScopeError`` for the first offered tool outside ``policy``'s scope."""
    for offered in tools or []:
        name = (offered.get("function") or {}).get("name") or offered.get("name") or ""
        if not policy.in_scope(name):
            raise ToolNotInScopeError(policy, name)


def screened(message: ChatCompletionMessage, finish: str, decisions: list[Decision | None]) -> tuple[ChatCompletionMessage, str]:  # fmt: skip
    """The reply an agent may have: the calls that were not allowed taken out, and their notices (who decided and
    why) as its text; the finish reason ``stop`` when no call is left."""
    calls = message.tool_calls or []
    stopped = [d for d in decisions if d is not None and not d.allowed]
    if not stopped:
        return message, finish
    kept = [c for c, d in zip(calls, decisions) if d is None or d.allowed]
    content = "\n".join(part for part in (message.content, *(d.notice() for d in stopped)) if part)
    message = message.model_copy(update={"content": content, "tool_calls": kept or None})
    return message, "tool_calls" if kept else "stop"


class ApprovalDesk:
    """Pending approvals and their waiters, over ``store``. ``redact``: what the arguments of a call of a split go
    through before they are stored (the gateway's redactor)."""

    def __init__(
        self, store: Store, redact: Callable[[str, str | None], str] | None = None, poll_s: float = POLL_S
    ) -> None:
        self.store, self.redact, self.poll_s = store, redact, poll_s
        self._woken: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)

    async def policy(self, deployment: str) -> ToolPolicyRecord | None:
        return await self.store.run(approvals.find_policy, deployment)

    def _fields(self, call: ToolCallRequest) -> dict:
        """``approvals.request``'s fields for ``call``: its arguments redacted as its split's calls are (one asked
        under a deployment's alias: as production's, whatever its split)."""
        split = None if call.deployment is not None else call.split
        arguments = self.redact(call.arguments, split) if self.redact is not None else call.arguments
        return call.model_dump(exclude={"arguments"}) | {"arguments": arguments}

    async def request(self, call: ToolCallRequest, timeout_s: float, actor: str = GATEWAY) -> ApprovalRecord:
        return await self.store.run(approvals.request, **self._fields(call), timeout_s=timeout_s, actor=actor)

    async def decide(self, approval_id: int, *, approve: bool, by: str, reason: str | None = None) -> ApprovalRecord:
        """A person's decision (``ApprovalClosedError`` if it was taken or expired before); its waiter wakes."""
        record = await self.store.run(approvals.decide, approval_id, approve=approve, actor=by, reason=reason)
        self._wake(approval_id)
        if record.status == ApprovalStatus.expired:  # its deadline had passed: expired now, not decided
            raise approvals.ApprovalClosedError(approvals.closed_message(record))
        return record

    def _wake(self, approval_id: int) -> None:
        if (event := self._woken.get(approval_id)) is not None:
            event.set()

    async def wait(self, approval_id: int, seconds: float) -> ApprovalRecord:
        """The approval once decided, or as it is after ``seconds`` (pending, or expired if its deadline passed)."""
        end = time.monotonic() + seconds
        event = self._woken[approval_id]
        try:
            while True:
                record = await self.store.run(approvals.get, approval_id)
                if record.status != ApprovalStatus.pending:
                    return record
                left = min(end - time.monotonic(), record.deadline.timestamp() - time.time())
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(event.wait(), min(self.poll_s, left))
                except TimeoutError:
                    pass
        finally:
            self._woken.pop(approval_id, None)
        if record.deadline.timestamp() <= time.time():
            return await self._expire(approval_id)
        return record

    async def _expire(self, approval_id: int) -> ApprovalRecord:
        try:
            return await self.store.run(approvals.decide, approval_id, approve=None, actor="timeout")
        except approvals.ApprovalClosedError:  # decided (or expired) by another process meanwhile
            return await self.store.run(approvals.get, approval_id)

    async def ask(self, call: ToolCallRequest, timeout_s: float, actor: str = GATEWAY) -> Decision:
        """Request a person's approval of ``call`` and wait for it (at most ``timeout_s``: then it is expired)."""
        record = await self.request(call, timeout_s, actor)
        return decision_of(await self.wait(record.id, timeout_s + self.poll_s))

    async def record(self, call: ToolCallRequest, decision: Decision) -> Decision:
        """Store a policy's ``decision`` on ``call`` as an approval decided at once: the request and its decision in
        one unit of work (both in the audit trail; never a pending one left behind)."""
        fields = self._fields(call)

        def decided(s: Session) -> ApprovalRecord:
            asked = approvals.request(s, **fields, timeout_s=1.0, actor=decision.by)
            return approvals.decide(s, asked.id, approve=decision.allowed, actor=decision.by, reason=decision.reason)

        return decision.model_copy(update={"approval_id": (await self.store.run(decided)).id})

    async def screen(
        self, policy: ToolPolicyRecord, message: ChatCompletionMessage, finish: str, *, episode_id: str | None,
        split: str | None,
    ) -> tuple[ChatCompletionMessage, str, list[Decision]]:  # fmt: skip
        """A model's reply through ``policy``'s deployment: the reply its agent may have (``screened``) and the
        decisions taken on its calls."""
        where = {"deployment": policy.deployment, "episode_id": episode_id, "split": split}
        tool_calls = message.tool_calls or []
        asked = {
            i: ToolCallRequest(tool=c.function.name, arguments=c.function.arguments, call_id=c.id, **where)
            for i, c in enumerate(tool_calls)
            if c.type == "function"
        }
        found = dict(zip(asked, await self.review(policy, list(asked.values()))))
        decisions = [found.get(i) for i in range(len(tool_calls))]
        message, finish = screened(message, finish, decisions)
        return message, finish, [d for d in decisions if d is not None]

    async def review(self, policy: ToolPolicyRecord, calls: list[ToolCallRequest]) -> list[Decision | None]:
        """Each call's decision under ``policy`` (None: not high-impact, it passes), decided concurrently."""
        return list(await asyncio.gather(*(self._review(policy, call) for call in calls)))

    async def _review(self, policy: ToolPolicyRecord, call: ToolCallRequest) -> Decision | None:
        if not policy.in_scope(call.tool):
            decision = Decision(tool=call.tool, call_id=call.call_id, verdict="refused", by=f"scope:{policy.deployment}",
                                reason=f"{policy.deployment} may call only {policy.scope}")  # fmt: skip
            return await self.record(call, decision)
        if call.tool not in policy.high_impact or call.split == SHADOW:
            return None
        if call.split in (None, PRODUCTION):
            return await self.ask(call, policy.timeout_s)
        return await self.record(call, await _otherwise(policy)(call))


def _otherwise(policy: ToolPolicyRecord) -> Approver:
    if policy.otherwise is Otherwise.grader:
        from flywheel.graders import parse_grader

        assert policy.grader is not None  # set_policy requires it
        return GraderApprover(parse_grader(policy.grader), policy.threshold)
    return allow if policy.otherwise is Otherwise.allow else deny
