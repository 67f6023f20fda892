"""``flywheel deploy | promote | rollback | deployments | audit [verify]``: deployments (aliases such as
``calc@production`` that the gateway serves) and the audit trail, from the command line.

A model's checkpoints are its directory's under ``$FLYWHEEL_HOME`` (``flywheel.checkpoints.layout``:
``<project>/models/<name>/checkpoints/``); an alias is pointed only at a step that has one. Bad input (a malformed
alias, an unknown model or step, nothing to roll back to) is one line and exit status 2, with nothing written.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flywheel.checkpoints import layout
from flywheel.cli.common import Actor, Db, Home, Project, Why, console, fail, open_store, require_actor
from flywheel.home import default_home

audit_app = typer.Typer(help="The audit trail: who deployed, promoted or rolled back what, when and why.")


def _checkpoints(model: str, home: Path | None, project: str | None) -> list[int]:
    """The model's complete checkpoints' steps, found under the home's projects."""
    root = home or default_home()
    found = layout.find_models(root, model, project)
    if not found:
        where = layout.checkpoints_dir(layout.model_path(root, project or "<project>", model))
        fail(f"No model '{model}' under {root} (its checkpoints would be in {where}).")
    if len(found) > 1:
        fail(f"'{model}' is a model of several projects ({', '.join(found)}): name one with --project.")
    return layout.steps(next(iter(found.values())))


def _check_step(model: str, step: int, home: Path | None, project: str | None) -> None:
    steps = _checkpoints(model, home, project)
    if step not in steps:
        fail(f"'{model}' has no checkpoint {step} (its checkpoints: {', '.join(map(str, steps)) or 'none'}).")


def _parse(alias: str) -> tuple[str, str]:
    from flywheel.store import deployments
    from flywheel.store.deployments import InvalidAliasError

    try:
        return deployments.parse_alias(alias)
    except InvalidAliasError as exc:
        fail(str(exc))


def _share(share: float | None) -> str:
    return "" if share is None else f", {share:.0%} of its traffic"


def deploy(
    alias: Annotated[str, typer.Argument(metavar="MODEL@STAGE", help="The alias, e.g. calc@production.")],
    step: Annotated[int, typer.Option(help="The checkpoint step it points at.")],
    share: Annotated[
        float | None, typer.Option(help="A canary's or shadow's share of traffic, 0..1.", show_default=False)
    ] = None,
    why: Why = None,
    actor: Actor = None,
    db: Db = None,
    home: Home = None,
    project: Project = None,
):
    """Point a deployment (MODEL@STAGE) at one of the model's checkpoints; the gateway serves it from the next
    request on. The switch and its audit event are one transaction."""
    from flywheel.store import audit, deployments

    model, _ = _parse(alias)
    who = require_actor(actor)
    if share is not None and not 0 <= share <= 1:
        fail(f"--share must be from 0 to 1, not {share}.")
    _check_step(model, step, home, project)
    store = open_store(db)
    try:
        with store.session() as s:
            audit.lock(s)
            current = deployments.find(s, alias)
            if current is not None and (current.step, current.share) == (step, share):
                console.print(f"{alias} already points at step {step}{_share(share)}: nothing changed.")
                return
            record = deployments.deploy(s, alias, step, actor=who, share=share, reason=why)
    except ValueError as exc:
        fail(str(exc))
    finally:
        store.close()
    console.print(f"{alias} -> step {record.step}{_share(record.share)} (audit event {record.event_id})")


def promote(
    model: Annotated[str, typer.Argument(help="The model (its deployments are MODEL@STAGE).")],
    source: Annotated[str, typer.Option("--from", help="The stage whose step is promoted.")] = "canary",
    target: Annotated[str, typer.Option("--to", help="The stage that gets it (all of its traffic).")] = "production",
    why: Why = None,
    actor: Actor = None,
    db: Db = None,
    home: Home = None,
    project: Project = None,
):
    """Point MODEL@TO at the checkpoint MODEL@FROM has (audited as a promotion)."""
    from flywheel.store import audit, deployments
    from flywheel.store.deployments import UnknownDeploymentError

    _parse(f"{model}@{source}")
    _parse(f"{model}@{target}")
    who = require_actor(actor)
    store = open_store(db)
    try:
        with store.session() as s:
            audit.lock(s)  # what is read here is what gets promoted
            origin = deployments.get(s, f"{model}@{source}")
            _check_step(model, origin.step, home, project)
            record = deployments.promote(s, model, actor=who, source=source, target=target, reason=why)
    except (UnknownDeploymentError, ValueError) as exc:
        fail(str(exc))
    finally:
        store.close()
    console.print(f"{record.name} -> step {record.step}, promoted from {origin.name} (audit event {record.event_id})")


def rollback(
    alias: Annotated[str, typer.Argument(metavar="MODEL@STAGE", help="The deployment to roll back.")],
    why: Why = None,
    actor: Actor = None,
    db: Db = None,
    home: Home = None,
    project: Project = None,
):
    """Point a deployment back at the step it had before its latest change (its history is the audit chain's;
    rolling back again goes further back)."""
    from flywheel.store import audit, deployments
    from flywheel.store.deployments import NoRollbackError, UnknownDeploymentError

    model, _ = _parse(alias)
    who = require_actor(actor)
    store = open_store(db)
    try:
        with store.session() as s:
            audit.lock(s)  # what is read here is what gets changed
            current = deployments.get(s, alias)
            step, share = deployments.rollback_target(s, alias)
            _check_step(model, step, home, project)
            record = deployments.deploy(
                s, alias, step, actor=who, share=share, reason=why, action="rollback",
                details={"undoes": current.event_id},
            )  # fmt: skip
    except (UnknownDeploymentError, NoRollbackError, ValueError) as exc:
        fail(str(exc))
    finally:
        store.close()
    console.print(f"{alias} -> step {record.step}{_share(record.share)}, back from step {current.step} "
                  f"(audit event {record.event_id})")  # fmt: skip


def _when(at: datetime) -> str:
    return at.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _details(details: dict) -> str:
    """An event's details in a line: a deployment's move as ``step 2 -> 3``, the rest as ``key=value``."""
    parts = []
    if "step" in details:
        before = details.get("previous_step")
        parts.append(f"step {details['step']}" if before is None else f"step {before} -> {details['step']}")
    if details.get("share") is not None:
        parts.append(f"share {details['share']:.0%}")
    hidden = {"model", "stage", "step", "previous_step", "share", "previous_share"}
    parts += [f"{k}={v}" for k, v in details.items() if k not in hidden and v is not None]
    return ", ".join(parts)


@audit_app.callback(invoke_without_command=True)
def show(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, help="The latest events shown.")] = 20,
    subject: Annotated[str | None, typer.Option(help="Only the events of this subject (e.g. calc@production).")] = None,
    db: Db = None,
):
    """The latest audit events, oldest first."""
    if ctx.invoked_subcommand is not None:
        return
    from flywheel.store import audit
    from flywheel.store.db import shown_url

    store = open_store(db)
    try:
        with store.session() as s:
            events = audit.events(s, subject=subject, limit=limit)
    finally:
        store.close()
    table = Table(title="Audit trail" if events else f"Audit trail: no events in {shown_url(store.url)}")
    for column in ("id", "when", "actor", "action", "subject"):
        table.add_column(column, no_wrap=True)
    table.add_column("details")
    table.add_column("why")
    for e in events:
        table.add_row(
            str(e.id), _when(e.at), e.actor, e.action, e.subject, escape(_details(e.details)), escape(e.reason or "")
        )
    console.print(table)


@audit_app.command()
def verify(
    db: Db = None,
    anchor: Annotated[
        Path | None,
        typer.Option(
            help="The anchor file to check the chain against (default: $FLYWHEEL_AUDIT_ANCHOR, else"
            " audit-anchor.jsonl next to a SQLite store or in $FLYWHEEL_HOME), e.g. a witness's copy.",
            show_default=False,
        ),
    ] = None,
    key_file: Annotated[
        Path | None,
        typer.Option(
            help="A file holding the audit key to check the events' MACs with (default: $FLYWHEEL_AUDIT_KEY or"
            " $FLYWHEEL_AUDIT_KEY_FILE; without a key MACs are not checked).",
            show_default=False,
        ),
    ] = None,
):
    """Check the audit chain, against the anchor file and the audit key too: exit 0 if every event is as appended
    (the head's count and hash are printed, for a witness to keep), 1 naming the first row that is not, 2 if the
    store, the key or the anchor file cannot be read."""
    from flywheel.store import audit

    store = open_store(db)
    try:
        witness = audit.Witness.configured(store.engine, key_file=key_file, anchor=anchor)
        with store.session() as s:
            report = audit.verify(s, witness)
    except ValueError as exc:  # the key or the anchor file
        fail(str(exc))
    finally:
        store.close()
    if not report.ok:
        fail(f"Audit chain broken at row {report.bad_id}: {report.message}", 1)
    console.print(escape(report.message), soft_wrap=True)


def show_deployments(
    model: Annotated[str | None, typer.Argument(help="Only this model's deployments.")] = None,
    db: Db = None,
):
    """The deployments and the checkpoint step each points at now."""
    from flywheel.store import deployments
    from flywheel.store.db import shown_url

    store = open_store(db)
    try:
        with store.session() as s:
            found = deployments.list_deployments(s, model)
    finally:
        store.close()
    table = Table(title="Deployments" if found else f"Deployments: none in {shown_url(store.url)}")
    for column in ("deployment", "step", "share", "since", "by", "audit event"):
        table.add_column(column)
    for d in found:
        share = "" if d.share is None else f"{d.share:.0%}"
        table.add_row(d.name, str(d.step), share, _when(d.updated_at), d.updated_by, str(d.event_id))
    console.print(table)
