"""What is asked and what is answered when a model calls a high-impact tool, and the policies that answer without
a person: ``deny``, ``allow`` and ``GraderApprover`` (a grader's reward against a threshold).

An approver is any async callable from a ``ToolCallRequest`` to a ``Decision``; ``run_agent`` takes one
(``approve=``), and the gateway builds one per deployment from its tool policy. A decision that could not be
reached (a grader that fails, an approval service that does not answer) is a denial that says why: a high-impact
call never runs for want of an answer.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from flywheel.graders import Grader

Verdict = Literal["approved", "denied", "expired", "refused"]
"""``approved`` / ``denied``: by a person or a policy; ``expired``: nobody decided in time (a denial); ``refused``:
the tool is outside the deployment's scope (never asked about)."""


class ToolCallRequest(BaseModel):
    """One tool call a model made that needs a decision."""

    tool: str = Field(min_length=1, max_length=256)
    arguments: str = Field("", max_length=100_000, description="The arguments as the model wrote them (JSON text).")
    call_id: str | None = Field(None, max_length=256)
    deployment: str | None = Field(None, max_length=300, description="The alias the call was made to, if any.")
    episode_id: str | None = Field(None, max_length=64)
    split: str | None = Field(None, max_length=32, description="production, train, val...: who decides")

    def parsed_arguments(self) -> Any:
        """The arguments as JSON (the text itself when it is not JSON)."""
        try:
            return json.loads(self.arguments) if self.arguments.strip() else {}
        except json.JSONDecodeError:
            return self.arguments


class Decision(BaseModel):
    """What became of one call: ``allowed`` runs it; ``by`` is a person, ``policy:<rule>`` or ``timeout``."""

    tool: str
    call_id: str | None = None
    verdict: Verdict
    by: str
    reason: str | None = None
    approval_id: int | None = None  # the stored approval (a person's decision, or one the gateway recorded)

    @property
    def allowed(self) -> bool:
        return self.verdict == "approved"

    def notice(self) -> str:
        """The sentence an agent (and its model) reads for a call that was not allowed."""
        why = f": {self.reason}" if self.reason else ""
        what = {
            "denied": f"was denied by {self.by}{why}",
            "expired": f"got no decision in time{why}",
            "refused": f"is not allowed here{why}",
            "approved": "was approved",
        }[self.verdict]
        return f"The call to {self.tool} {what}. Nothing was done."


class Approver(Protocol):
    async def __call__(self, call: ToolCallRequest) -> Decision: ...


class _Fixed:
    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed

    async def __call__(self, call: ToolCallRequest) -> Decision:
        rule = "allow" if self.allowed else "deny"
        return Decision(tool=call.tool, call_id=call.call_id, verdict="approved" if self.allowed else "denied",
                        by=f"policy:{rule}", reason=f"{rule} off production")  # fmt: skip

    def __repr__(self) -> str:
        return "allow" if self.allowed else "deny"


deny: Approver = _Fixed(False)
"""Denies every high-impact call: the safe default for training and evaluation rollouts."""
allow: Approver = _Fixed(True)
"""Allows every high-impact call (a sandboxed environment where the action cannot hurt)."""


class GraderApprover:
    """Allows a call when ``grader`` (any Flywheel/OpenAI grader) gives it a reward of at least ``threshold``. The
    grader sees the arguments text as the sample's ``output_text`` and the item ``{"tool", "arguments",
    "deployment", "split"}`` (arguments parsed). A grader that fails denies, naming its error."""

    def __init__(self, grader: Grader, threshold: float = 0.5) -> None:
        self.grader, self.threshold = grader, threshold

    async def __call__(self, call: ToolCallRequest) -> Decision:
        from flywheel.graders import grade

        item = {"tool": call.tool, "arguments": call.parsed_arguments(), "deployment": call.deployment,
                "split": call.split}  # fmt: skip
        by = f"policy:grader:{self.grader.name}"
        result = await grade(self.grader, call.arguments, item)
        if result.errors:
            reason = f"the grader failed ({', '.join(sorted(result.errors))})"
            return Decision(tool=call.tool, call_id=call.call_id, verdict="denied", by=by, reason=reason)
        allowed = result.reward >= self.threshold
        reason = f"reward {result.reward:.3g} {'>=' if allowed else '<'} {self.threshold:g}"
        return Decision(
            tool=call.tool, call_id=call.call_id, verdict="approved" if allowed else "denied", by=by, reason=reason
        )
