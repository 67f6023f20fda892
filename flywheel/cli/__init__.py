"""The ``flywheel`` command line: ``app``, the entry point, with one module per command group.

``serving`` (prepare, serve, runner), ``jobs`` (train, demo), ``deployments`` (deploy, promote, rollback,
deployments, audit), ``approvals``, ``review``, ``graders`` (graders, eval), ``judge``, ``loop``, ``export`` and ``dashboard``;
``common`` holds what they share. Heavy dependencies (torch, the engine, the backend, the trainer, the store) load
inside the command that needs them, so that ``flywheel --help`` and ``flywheel GROUP --help`` load none of them.
"""

from __future__ import annotations

import typer

from flywheel.cli import dashboard, deployments, finetuning, graders, jobs, loop, serving
from flywheel.cli.approvals import approvals_app
from flywheel.cli.export import export_app
from flywheel.cli.judge import judge_app
from flywheel.cli.review import review_app

__all__ = ["app"]

app = typer.Typer(
    help="Flywheel: make LLM agents better with reinforcement learning from outcomes.", no_args_is_help=True
)
app.add_typer(export_app, name="export")
app.add_typer(graders.graders_app, name="graders")
app.add_typer(judge_app, name="judge")
app.command("eval")(graders.eval_command)
app.command()(deployments.deploy)
app.command()(deployments.promote)
app.command()(deployments.rollback)
app.command("deployments")(deployments.show_deployments)
app.add_typer(deployments.audit_app, name="audit")
app.command("loop")(loop.loop_command)
app.add_typer(review_app, name="review")
app.add_typer(approvals_app, name="approvals")
app.command()(serving.prepare)
app.command()(serving.serve)
app.command()(jobs.demo)
app.command()(jobs.train)
app.command()(serving.runner)
app.add_typer(finetuning.jobs_app, name="jobs")
app.command()(dashboard.dashboard)
