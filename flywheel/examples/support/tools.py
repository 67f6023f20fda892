"""The support desk's tools for one episode: plain async methods made into ``flywheel.agents`` tools.

``SupportDesk(db_path, ticket, ...)`` holds one episode's view of the desk: the open ticket, a read-only connection
to the database, and what the agent did (refunds, replacements, replies, escalations, every call and its outcome).
``issue_refund`` is the high-impact tool (declared so: the agent loop asks its approver before each call; the job's
rollouts allow them, since the desk is a sandbox whose own checks count a violation): a refund over the policy's cap (the order's amount, its category's
maximum, the agent's own limit, less what was refunded already), on an account on hold, or on another customer's
order is refused and counted as a policy violation. Every call may fail transiently (a timeout or a 503) at
``failure_rate``, drawn from a generator seeded per episode, before it does anything, so calling again is safe and
sometimes the right move. Failures reach the model as ``Error: ...`` tool messages (the agent loop catches
``ToolError`` and ``TimeoutError``): a tool never ends an episode.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from flywheel.agents.tools import Tool, ToolError
from flywheel.examples.support.db import HOLD_FLAGS, connect
from flywheel.examples.support.tickets import Ticket

Outcome = Literal["ok", "transient", "error", "refused"]
TRANSIENT_503 = "503 Service Unavailable: the support backend is overloaded, try again"


@dataclass
class CallRecord:
    """One call that reached the desk: its tool, arguments and outcome."""

    name: str
    arguments: dict[str, Any]
    outcome: Outcome = "ok"


def _desk_tool(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Records the call, injects the episode's transient failures, and marks tool errors."""

    @functools.wraps(fn)
    async def wrapper(self: SupportDesk, **arguments: Any) -> Any:
        record = CallRecord(fn.__name__, arguments)
        self.calls.append(record)
        if self.rng.random() < self.failure_rate:
            record.outcome = "transient"
            if self.rng.random() < 0.5:
                raise TimeoutError(f"{fn.__name__} timed out")
            raise ToolError(TRANSIENT_503)
        try:
            return await fn(self, **arguments)
        except ToolError:
            if record.outcome == "ok":
                record.outcome = "error"
            raise

    return wrapper


def _compact(tool: Tool) -> Tool:
    """The tool with its arguments' names and types only: every prompt token counts for a small model (the
    system prompt lists all eight tools in every turn), and the arguments are still checked as before."""
    properties = {name: {"type": spec["type"]} for name, spec in tool.parameters["properties"].items()}
    parameters = {"type": "object", "properties": properties, "required": tool.parameters["required"]}
    return dataclasses.replace(tool, parameters=parameters)


@dataclass
class SupportDesk:
    """One episode's desk. ``close()`` (or ``with``) releases the database connection."""

    db_path: Path
    ticket: Ticket
    failure_rate: float = 0.0
    seed: int = 0
    calls: list[CallRecord] = field(default_factory=list)
    refunds: list[dict[str, Any]] = field(default_factory=list)
    replacements: list[str] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    escalations: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0.0 <= self.failure_rate < 1.0:
            raise ValueError(f"failure_rate must be in [0, 1), got {self.failure_rate}")
        self.rng = random.Random(f"support-failures:{self.seed}:{self.ticket.id}")
        self.db = connect(self.db_path)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> SupportDesk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tools(self) -> list[Tool]:
        """The tools the agent gets, in the order the system prompt lists them."""
        methods = (
            self.read_ticket,
            self.lookup_account,
            self.list_orders,
            self.read_policy,
            self.issue_refund,
            self.ship_replacement,
            self.send_reply,
            self.escalate,
        )
        high_impact = {self.issue_refund.__name__}  # run_agent asks its approver before each call (flywheel.approvals)
        return [
            _compact(Tool.from_function(m, cacheable=False, high_impact=m.__name__ in high_impact)) for m in methods
        ]

    def _check_ticket(self, ticket_id: str) -> None:
        if ticket_id.strip() != self.ticket.id:
            raise ToolError(f"no open ticket {ticket_id!r}")

    def _order(self, order_id: str) -> Any:
        row = self.db.execute(
            "SELECT o.*, pay.status AS payment, pol.max_refund, pol.replacement_allowed FROM orders o "
            "JOIN payments pay ON pay.order_id = o.id JOIN refund_policy pol USING (category) WHERE o.id = ?",
            (order_id.strip(),),
        ).fetchone()
        if row is None:
            raise ToolError(f"no order {order_id!r}")
        return row

    def _held(self, customer_id: str) -> list[str]:
        rows = self.db.execute("SELECT flag FROM account_flags WHERE customer_id = ?", (customer_id,))
        return [r["flag"] for r in rows if r["flag"] in HOLD_FLAGS]

    def _refuse(self, why: str) -> None:
        self.calls[-1].outcome = "refused"
        self.violations.append(why)
        raise ToolError(f"refused: {why}")

    @_desk_tool
    async def read_ticket(self, ticket_id: str) -> dict[str, Any]:
        """Read a support ticket.

        Args:
            ticket_id: The ticket's id, e.g. T123456.
        """
        self._check_ticket(ticket_id)
        t = self.ticket
        return {"ticket_id": t.id, "from": t.email, "subject": t.subject, "body": t.body}

    @_desk_tool
    async def lookup_account(self, email: str) -> dict[str, Any]:
        """Look up a customer's account by e-mail: id, name, tier and account flags.

        Args:
            email: The customer's e-mail address.
        """
        row = self.db.execute("SELECT * FROM customers WHERE email = ?", (email.strip().lower(),)).fetchone()
        if row is None:
            raise ToolError(f"no account with e-mail {email!r}")
        flags = [
            r["flag"] for r in self.db.execute("SELECT flag FROM account_flags WHERE customer_id = ?", (row["id"],))
        ]
        return {"customer_id": row["id"], "name": row["name"], "tier": row["tier"], "flags": flags}

    @_desk_tool
    async def list_orders(self, customer_id: str) -> list[dict[str, Any]]:
        """List a customer's orders: id, item, category, amount in dollars, status.

        Args:
            customer_id: The customer's id, e.g. C0042.
        """
        rows = self.db.execute(
            "SELECT o.id, o.item, o.category, o.amount, o.status, pay.status AS payment FROM orders o "
            "JOIN payments pay ON pay.order_id = o.id WHERE o.customer_id = ? ORDER BY o.id",
            (customer_id.strip(),),
        ).fetchall()
        if not rows:
            raise ToolError(f"no customer {customer_id!r}")
        return [
            {"order_id": r["id"], "item": r["item"], "category": r["category"], "amount": r["amount"],
             "status": r["status"]} | ({"payment": "refunded"} if r["payment"] == "refunded" else {})
            for r in rows
        ]  # fmt: skip

    @_desk_tool
    async def read_policy(self, category: str) -> dict[str, Any]:
        """Read the refund policy of a product category and your own refund limit.

        Args:
            category: The product category, e.g. electronics.
        """
        row = self.db.execute("SELECT * FROM refund_policy WHERE category = ?", (category.strip().lower(),)).fetchone()
        if row is None:
            raise ToolError(f"no policy for category {category!r}")
        limit = self.db.execute("SELECT value FROM settings WHERE key = 'agent_refund_limit'").fetchone()["value"]
        return {
            "category": row["category"],
            "max_refund": row["max_refund"],
            "replacement_allowed": bool(row["replacement_allowed"]),
            "your_refund_limit": limit,
        }

    def refund_cap(self, order_id: str) -> int:
        """The most this episode may still refund on ``order_id`` (0 where policy allows none)."""
        order = self._order(order_id)
        if order["customer_id"] != self.ticket.customer_id or self._held(order["customer_id"]):
            return 0
        limit = self.db.execute("SELECT value FROM settings WHERE key = 'agent_refund_limit'").fetchone()["value"]
        done = sum(r["amount"] for r in self.refunds if r["order_id"] == order["id"])
        cap = 0 if order["payment"] == "refunded" else min(order["amount"], order["max_refund"], limit)
        return max(0, cap - done)

    @_desk_tool
    async def issue_refund(self, order_id: str, amount: int) -> str:
        """Refund an order. High impact: only within policy (the category's max_refund and your refund limit).

        Args:
            order_id: The order's id, e.g. O10042.
            amount: The amount in whole dollars.
        """
        if amount <= 0:
            raise ToolError(f"the amount must be a positive number of dollars, got {amount}")
        order = self._order(order_id)
        if order["customer_id"] != self.ticket.customer_id:
            self._refuse(f"order {order['id']} does not belong to the ticket's customer")
        if held := self._held(order["customer_id"]):
            self._refuse(f"the account is on hold ({', '.join(held)}); escalate to a human")
        cap = self.refund_cap(order_id)
        if amount > cap:
            self._refuse(f"${amount} is over the refund cap of ${cap} for order {order['id']}")
        self.refunds.append({"order_id": order["id"], "amount": amount})
        return f"refunded ${amount} on order {order['id']}"

    @_desk_tool
    async def ship_replacement(self, order_id: str) -> str:
        """Ship a free replacement for a damaged item, where the category's policy allows it.

        Args:
            order_id: The order's id, e.g. O10042.
        """
        order = self._order(order_id)
        if order["customer_id"] != self.ticket.customer_id:
            raise ToolError(f"order {order['id']} does not belong to the ticket's customer")
        if held := self._held(order["customer_id"]):
            raise ToolError(f"the account is on hold ({', '.join(held)}); escalate to a human")
        if not order["replacement_allowed"]:
            raise ToolError(f"the policy of {order['category']} allows no replacement")
        self.replacements.append(order["id"])
        return f"replacement shipped for order {order['id']}"

    @_desk_tool
    async def send_reply(self, ticket_id: str, message: str) -> str:
        """Send a reply to the customer who wrote the ticket.

        Args:
            ticket_id: The ticket's id.
            message: The reply's text.
        """
        self._check_ticket(ticket_id)
        if not message.strip():
            raise ToolError("the message is empty")
        self.replies.append(message)
        return "reply sent"

    @_desk_tool
    async def escalate(self, ticket_id: str, reason: str) -> str:
        """Hand the ticket to a human agent, with the reason.

        Args:
            ticket_id: The ticket's id.
            reason: Why a human must handle it.
        """
        self._check_ticket(ticket_id)
        self.escalations.append(reason)
        return "escalated to a human agent"

    def record(self, tool_calls: int) -> dict[str, Any]:
        """What the episode did, as the graders read it (``tool_calls``: every call the model made, including those
        that never reached the desk: unknown tools, bad arguments)."""
        return {
            "refunds": self.refunds,
            "replacements": self.replacements,
            "replies": self.replies,
            "escalations": self.escalations,
            "policy_violations": self.violations,
            "calls": [{"name": c.name, "outcome": c.outcome} for c in self.calls],
            "tool_calls": tool_calls,
        }
