"""``HumanApprover``: an approver that asks a person through a Flywheel server's approvals (``POST /approvals``,
then long polls of its decision), for an agent that runs its own tools (``run_agent(..., approve=...)``) in
production. The person decides in the dashboard or with ``flywheel approvals``. A server that cannot be reached, or
that refuses the request, is a denial that says so: the call never runs unapproved."""

from __future__ import annotations

import time

import httpx

from flywheel.approvals.policy import Decision, ToolCallRequest
from flywheel.gateway.client import error_message

POLL_S = 20.0  # one long poll (the server waits at most 30 s)


class HumanApprover:
    """Ask a person on the server at ``base_url`` (its root: ``http://127.0.0.1:8000``, not ``/v1``); wait at most
    ``timeout_s`` for the decision, then the call is denied (expired). ``api_key``: an agent key, when the server
    has keys. ``deployment`` and ``split`` are recorded with each request (who asked, for what)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        deployment: str | None = None,
        split: str = "production",
    ) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.deployment, self.split = deployment, split
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def __call__(self, call: ToolCallRequest) -> Decision:
        call = call.model_copy(
            update={"deployment": call.deployment or self.deployment, "split": call.split or self.split}
        )
        body = call.model_dump() | {"timeout_s": self.timeout_s}
        end = time.monotonic() + self.timeout_s + POLL_S
        try:
            async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=POLL_S + 10) as http:
                created = await http.post("/approvals", json=body)
                created.raise_for_status()
                approval_id = created.json()["id"]
                while True:
                    wait = max(0.0, min(POLL_S, end - time.monotonic()))
                    answer = await http.get(f"/approvals/{approval_id}/decision", params={"wait": wait})
                    answer.raise_for_status()
                    state = answer.json()
                    if state["status"] != "pending" or wait == 0:
                        break
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            reason = f"the approval service at {self.base_url} failed: {_why(exc)}"
            return Decision(tool=call.tool, call_id=call.call_id, verdict="denied", by="approver", reason=reason)
        if state["status"] == "pending":  # the server's clock and ours disagree by more than a poll: deny
            state = {"status": "expired", "decided_by": "timeout", "reason": None}
        verdict = {"approved": "approved", "denied": "denied"}.get(state["status"], "expired")
        return Decision(tool=call.tool, call_id=call.call_id, verdict=verdict, by=state["decided_by"] or "timeout",  # type: ignore[arg-type]
                        reason=state["reason"], approval_id=approval_id)  # fmt: skip


def _why(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"{exc.response.status_code}: {error_message(exc.response, text_limit=200)}"
    return f"{type(exc).__name__}: {exc}"
