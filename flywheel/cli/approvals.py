"""``flywheel approvals list | show | approve | deny | policy | policies | unset``: high-impact tool calls waiting
for a person, and deployments' tool policies, from the command line (``flywheel.approvals``).

A decision taken here reaches the server's waiting call at its next look at the store (within a second). Bad input
(an unknown id, an approval decided before or past its deadline, a policy that contradicts itself) is one line and
exit status 2, with nothing written.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flywheel.cli.common import Actor, Db, Why, console, fail, open_store, require_actor

if TYPE_CHECKING:
    from flywheel.store.approvals import ApprovalRecord

approvals_app = typer.Typer(
    help="High-impact tool calls waiting for a person; deployments' tool scopes and high-impact tools.",
    no_args_is_help=True,
)
SHOWN_ARGUMENTS = 60  # characters of a call's arguments in the list


def _when(at: datetime | None) -> str:
    return "" if at is None else at.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [name.strip() for name in text.split(",") if name.strip()]


@approvals_app.command("list")
def list_command(
    status: Annotated[
        str, typer.Option(help="pending, approved, denied, expired, or all.", show_default=True)
    ] = "pending",
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    db: Db = None,
):
    """The approvals (pending ones oldest first: the order to decide them in; others newest first)."""
    from flywheel.store import approvals
    from flywheel.store.approvals import ApprovalStatus

    if status != "all" and status not in ApprovalStatus.__members__:
        fail(f"--status must be one of {', '.join(ApprovalStatus)} or all, not {status!r}.")
    store = open_store(db)
    try:
        with store.session() as s:
            approvals.expire_due(s)
        with store.session() as s:
            found = approvals.list_approvals(s, status=None if status == "all" else ApprovalStatus(status), limit=limit)
    finally:
        store.close()
    if not found:
        console.print(f"No {'' if status == 'all' else status + ' '}approvals.")
        return
    table = Table("id", "tool", "arguments", "deployment", "episode", "requested", "status", "by", "until/at")
    for a in found:
        shown = a.arguments if len(a.arguments) <= SHOWN_ARGUMENTS else a.arguments[: SHOWN_ARGUMENTS - 1] + "…"
        until = a.deadline if a.status == ApprovalStatus.pending else a.decided_at
        table.add_row(str(a.id), a.tool, escape(shown), a.deployment or "", a.episode_id or "", _when(a.requested_at),
                      a.status, a.decided_by or "", _when(until))  # fmt: skip
    console.print(table)


def _show(a: ApprovalRecord) -> None:
    try:
        arguments = json.dumps(json.loads(a.arguments), indent=2)
    except ValueError:
        arguments = a.arguments
    console.print(f"[bold]Approval {a.id}[/]: {a.tool} ({a.status})", highlight=False)
    for label, value in (("deployment", a.deployment), ("episode", a.episode_id), ("split", a.split),
                         ("requested", _when(a.requested_at)), ("deadline", _when(a.deadline)),
                         ("decided", f"{_when(a.decided_at)} by {a.decided_by}" if a.decided_at else None),
                         ("reason", a.reason)):  # fmt: skip
        if value:
            console.print(f"  {label}: {escape(str(value))}", highlight=False)
    console.print(escape(arguments), highlight=False)


@approvals_app.command("show")
def show(approval_id: Annotated[int, typer.Argument(metavar="ID")], db: Db = None):
    """One approval with the call's arguments in full."""
    from flywheel.store import approvals
    from flywheel.store.approvals import UnknownApprovalError

    store = open_store(db)
    try:
        with store.session() as s:
            _show(approvals.get(s, approval_id))
    except UnknownApprovalError as exc:
        fail(str(exc))
    finally:
        store.close()


def _decide(approval_id: int, approve: bool, why: str | None, actor: str | None, db: str | None) -> None:
    from flywheel.store import approvals
    from flywheel.store.approvals import ApprovalClosedError, ApprovalStatus, UnknownApprovalError

    who = require_actor(actor)
    store = open_store(db)
    try:
        with store.session() as s:
            record = approvals.decide(s, approval_id, approve=approve, actor=who, reason=why)
    except (UnknownApprovalError, ApprovalClosedError) as exc:
        fail(str(exc))
    finally:
        store.close()
    if record.status == ApprovalStatus.expired:
        fail(approvals.closed_message(record))
    console.print(f"Approval {record.id} ({record.tool}) {record.status} by {who}.", highlight=False)


@approvals_app.command("approve")
def approve(
    approval_id: Annotated[int, typer.Argument(metavar="ID")], why: Why = None, actor: Actor = None, db: Db = None
):
    """Let a waiting call run (it goes on to the agent as the model made it)."""
    _decide(approval_id, True, why, actor, db)


@approvals_app.command("deny")
def deny(
    approval_id: Annotated[int, typer.Argument(metavar="ID")], why: Why = None, actor: Actor = None, db: Db = None
):
    """Stop a waiting call: the agent is told it was denied, by whom and why (--why)."""
    _decide(approval_id, False, why, actor, db)


@approvals_app.command("policy")
def policy(
    deployment: Annotated[str, typer.Argument(metavar="MODEL@STAGE", help="The deployment, e.g. calc@production.")],
    high_impact: Annotated[str, typer.Option(help="Tools whose calls need approval, comma-separated.")],
    allow: Annotated[
        str | None, typer.Option(help="The scope: the only tools it may call, comma-separated (default: any).")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds a person has to decide; then the call is denied.")] = 300.0,
    otherwise: Annotated[
        str, typer.Option(help="Off production (training, evaluation): deny, allow or grader.")
    ] = "deny",
    grader: Annotated[
        Path | None, typer.Option(help="With --otherwise grader: the grader (JSON) that decides.", show_default=False)
    ] = None,
    threshold: Annotated[float, typer.Option(help="The grader's least reward that allows a call.")] = 0.5,
    why: Why = None,
    actor: Actor = None,
    db: Db = None,
):
    """Set a deployment's tool policy (replacing the one it had), audited."""
    from flywheel.store import approvals
    from flywheel.store.deployments import InvalidAliasError

    who = require_actor(actor)
    spec = None
    if grader is not None:
        from flywheel.graders import parse_grader

        try:
            spec = json.loads(grader.read_text(encoding="utf-8"))
            parse_grader(spec, str(grader))  # one that could not decide is refused now, not at its first call
        except (OSError, ValueError) as exc:
            fail(f"--grader {grader}: {exc}")
    store = open_store(db)
    try:
        with store.session() as s:
            record = approvals.set_policy(
                s, deployment, high_impact=_names(high_impact) or [], allowed=_names(allow), timeout_s=timeout,
                otherwise=otherwise, grader=spec, threshold=threshold, actor=who, reason=why,
            )  # fmt: skip
    except (InvalidAliasError, ValueError) as exc:
        fail(str(exc))
    finally:
        store.close()
    console.print(
        f"{deployment}: may call {record.scope}; {', '.join(record.high_impact) or 'no tool'} needs a person's approval in "
        f"production (within {record.timeout_s:g} s), decided by '{record.otherwise}' elsewhere.",
        highlight=False,
    )


@approvals_app.command("policies")
def policies(db: Db = None):
    """Every deployment's tool policy."""
    from flywheel.store import approvals

    store = open_store(db)
    try:
        with store.session() as s:
            found = approvals.list_policies(s)
    finally:
        store.close()
    if not found:
        console.print("No tool policies: every deployment may call any tool, and none needs approval.")
        return
    table = Table("deployment", "allowed", "high-impact", "timeout", "otherwise", "set by", "at")
    for p in found:
        table.add_row(p.deployment, p.scope, ", ".join(p.high_impact), f"{p.timeout_s:g} s", p.otherwise,
                      p.updated_by, _when(p.updated_at))  # fmt: skip
    console.print(table)


@approvals_app.command("unset")
def unset(
    deployment: Annotated[str, typer.Argument(metavar="MODEL@STAGE")],
    why: Why = None,
    actor: Actor = None,
    db: Db = None,
):
    """Remove a deployment's tool policy (any tool, none needing approval), audited."""
    from flywheel.store import approvals
    from flywheel.store.approvals import NoToolPolicyError

    who = require_actor(actor)
    store = open_store(db)
    try:
        with store.session() as s:
            approvals.remove_policy(s, deployment, actor=who, reason=why)
    except NoToolPolicyError as exc:
        fail(str(exc))
    finally:
        store.close()
    console.print(f"{deployment}: no tool policy now.")
