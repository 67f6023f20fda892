"""The support agent: a short system prompt, the episode's rollout through ``flywheel.agents.run_agent`` on any
OpenAI-compatible model, and the scripted expert whose episodes are the SFT warm start's demonstrations.

A rollout opens a ``SupportDesk`` for its ticket, lets the model call the desk's tools (up to ``max_turns``
turns), grades the desk's record with the grader stack and puts the reward and every metric on the trajectory.
The expert is a policy, not a model: it knows the ticket's ground truth, reads the real tools' results (ids,
amounts, policy) to write each next call, calls a tool again after a transient failure, and is served to the same
agent loop through an object with the OpenAI client's ``chat.completions.create``, so a demonstration is exactly
a conversation the loop produces, failures and retries included.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionMessageToolCall
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_tool_call import Function

from flywheel.agents.air import AIRConfig
from flywheel.agents.tool_loop import run_agent
from flywheel.approvals.policy import Approver, allow
from flywheel.examples.support.db import HOLD_FLAGS
from flywheel.examples.support.grading import episode_metrics, grade_episode
from flywheel.examples.support.tickets import Ticket
from flywheel.examples.support.tools import SupportDesk
from flywheel.graders.stack import GraderStack
from flywheel.model import Model
from flywheel.types import Trajectory

SYSTEM_PROMPT = (
    "You are a customer support agent. Read the ticket, look up the account and orders, read the policy, then "
    "refund, ship a replacement or answer, and reply to the customer. Escalate to a human if the account has a "
    "fraud_hold or closed flag, if the refund is over your refund limit, or if the ticket does not say which "
    "order. If a tool times out or fails with 503, call it again. Never reply with another customer's data. "
    "When done, answer: Done."
)
MAX_TURNS = 10


def task_messages(ticket: Ticket) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"New ticket: {ticket.id}"},
    ]


async def rollout(
    model: Model | str,
    ticket: Ticket,
    db_path: Path,
    stack: GraderStack,
    *,
    client: AsyncOpenAI | Any | None = None,
    failure_rate: float = 0.1,
    seed: int = 0,
    temperature: float = 1.0,
    max_turns: int = MAX_TURNS,
    max_tokens: int = 160,
    sampling_seed: int | None = None,
    air: AIRConfig | None = None,
    approve: Approver = allow,
) -> Trajectory:
    """One episode on ``ticket``; reward from ``stack``, metrics from ``grading.episode_metrics``. ``client``: an
    OpenAI client (default: the model's) or the expert's. ``seed`` draws the desk's transient failures,
    ``sampling_seed`` (None: unseeded) the model's tokens; ``air``: automatic intermediate rewards on the turns
    (``flywheel.agents.air``: a transient failure is a call that did not execute); ``approve``: what decides each
    ``issue_refund`` call before it runs (``allow`` in training: the desk is a sandbox whose own checks refuse and
    count an over-policy refund; a ``flywheel.approvals.HumanApprover`` in front of real customers)."""
    sampling = {} if sampling_seed is None else {"seed": sampling_seed}
    with SupportDesk(db_path, ticket, failure_rate=failure_rate, seed=seed) as desk:
        traj = await run_agent(
            client,
            model,
            task_messages(ticket),
            desk.tools(),
            max_turns,
            temperature=temperature,
            max_tokens=max_tokens,
            tool_timeout=30.0,
            air=air,
            approve=approve,
            metadata={"ticket_id": ticket.id, "kind": ticket.kind, "resolution": ticket.resolution},
            **sampling,
        )
        record = desk.record(int(traj.metrics["tool_calls"]))
    result = await grade_episode(stack, ticket, record)
    traj.reward = result.reward
    traj.metrics.update(episode_metrics(ticket, record, result))
    return traj


# --------------------------------------------------------------------------- #
# The scripted expert
# --------------------------------------------------------------------------- #

_TRANSIENT = re.compile(r"503|did not answer")


def _exchanges(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """(tool name, arguments, result text) of every call so far, in order."""
    results = {m["tool_call_id"]: m["content"] for m in messages if m.get("role") == "tool"}
    done = []
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            done.append((fn["name"], json.loads(fn["arguments"]), results.get(call["id"], "")))
    return done


def expert_action(ticket: Ticket, messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The expert's next call (name, arguments) given the conversation, or None when the ticket is resolved."""
    exchanges = _exchanges(messages)
    if exchanges and _TRANSIENT.search(exchanges[-1][2]) and exchanges[-1][2].startswith("Error:"):
        name, arguments, _ = exchanges[-1]
        return name, arguments  # a transient failure: the same call again
    ok: dict[str, Any] = {}
    for name, _, result in exchanges:
        if not result.startswith("Error:"):
            try:
                ok[name] = json.loads(result)
            except json.JSONDecodeError:
                ok[name] = result
    tid = ticket.id
    if "send_reply" in ok or "escalate" in ok:
        return None
    if "read_ticket" not in ok:
        return "read_ticket", {"ticket_id": tid}
    if "lookup_account" not in ok:
        return "lookup_account", {"email": ok["read_ticket"]["from"]}
    account = ok["lookup_account"]
    first_name = account["name"].split()[0]
    held = [f for f in account["flags"] if f in HOLD_FLAGS]
    if held and ticket.kind != "status":
        return "escalate", {"ticket_id": tid, "reason": f"account flag: {held[0]}"}
    if "list_orders" not in ok:
        return "list_orders", {"customer_id": account["customer_id"]}
    if ticket.kind == "unspecified":
        return "escalate", {"ticket_id": tid, "reason": "missing information: the ticket does not say which order"}
    order = next(o for o in ok["list_orders"] if o["order_id"] == ticket.order_id)
    oid, item = order["order_id"], order["item"]
    if ticket.kind == "status":
        reply = f"Hi {first_name}, your order {oid} ({item}) is {order['status']}."
        return "send_reply", {"ticket_id": tid, "message": reply}
    if "read_policy" not in ok:
        return "read_policy", {"category": order["category"]}
    policy = ok["read_policy"]
    if ticket.kind == "replacement":
        if "ship_replacement" not in ok:
            return "ship_replacement", {"order_id": oid}
        reply = f"Hi {first_name}, a replacement for your {item} (order {oid}) is on its way."
        return "send_reply", {"ticket_id": tid, "message": reply}
    amount = min(order["amount"], policy["max_refund"])
    if amount > policy["your_refund_limit"]:
        reason = f"a refund of ${amount} is over my refund limit of ${policy['your_refund_limit']}"
        return "escalate", {"ticket_id": tid, "reason": reason}
    if "issue_refund" not in ok:
        return "issue_refund", {"order_id": oid, "amount": amount}
    reply = f"Hi {first_name}, we refunded ${amount} for your {item} (order {oid})."
    return "send_reply", {"ticket_id": tid, "message": reply}


class _Completions:
    def __init__(self, ticket: Ticket) -> None:
        self.ticket, self.turn = ticket, 0

    async def create(self, *, messages: list[dict[str, Any]], **_: Any) -> ChatCompletion:
        action = expert_action(self.ticket, messages)
        self.turn += 1
        if action is None:
            message = ChatCompletionMessage(role="assistant", content="Done.")
        else:
            name, arguments = action
            call = ChatCompletionMessageToolCall(
                id=f"call_{self.turn}", type="function", function=Function(name=name, arguments=json.dumps(arguments))
            )
            message = ChatCompletionMessage(role="assistant", content="", tool_calls=[call])
        choice = Choice(index=0, message=message, finish_reason="stop" if action is None else "tool_calls")
        return ChatCompletion(
            id=f"expert-{self.turn}", choices=[choice], created=0, model="expert", object="chat.completion"
        )


class _Chat:
    def __init__(self, ticket: Ticket) -> None:
        self.completions = _Completions(ticket)


class ExpertClient:
    """The expert behind the OpenAI client's ``chat.completions.create`` for one ticket (the loop's only call)."""

    def __init__(self, ticket: Ticket) -> None:
        self.chat = _Chat(ticket)


async def expert_rollout(
    ticket: Ticket, db_path: Path, stack: GraderStack, *, failure_rate: float, seed: int
) -> Trajectory:
    """The expert's episode on ``ticket``, through the real tools and graded like the model's."""
    return await rollout(
        "expert", ticket, db_path, stack, client=ExpertClient(ticket), failure_rate=failure_rate, seed=seed
    )


def demonstration(trajectory: Trajectory) -> Trajectory:
    """An expert episode as an SFT example (plain messages: the expert's turns carry no token ids)."""
    return Trajectory(messages_and_choices=trajectory.messages(), tools=trajectory.tools)
