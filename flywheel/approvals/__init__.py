"""Human approval for high-impact tool calls, and tool scopes per deployment.

It owns what is asked and answered when a model calls a tool that can hurt (``policy``: ``ToolCallRequest``,
``Decision``, the ``deny``/``allow``/``GraderApprover`` policies that decide without a person in training and
evaluation), the desk where production calls wait for a person on the server (``desk``: the gateway's review of
each call through a deployment against its tool policy), the HTTP routes people and agents use (``routes``), and
the client an agent that runs its own tools asks through (``human``: ``HumanApprover``). ``run_agent`` takes an
approver for tools declared ``high_impact``; the store keeps policies and approvals (``flywheel.store.approvals``),
each request and decision an audit event; ``flywheel approvals`` and the dashboard are where people decide.
"""

from flywheel.approvals.human import HumanApprover
from flywheel.approvals.policy import Approver, Decision, GraderApprover, ToolCallRequest, allow, deny

__all__ = ["Approver", "Decision", "GraderApprover", "HumanApprover", "ToolCallRequest", "allow", "deny"]
