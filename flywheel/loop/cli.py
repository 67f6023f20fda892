"""``flywheel loop CONFIG``: run the flywheel loop on a local backend and print what it decided."""

from __future__ import annotations

import asyncio
import getpass
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

console = Console()


def _problems(exc: ValidationError, source: Path) -> str:
    lines = [f"  {'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors(include_url=False)]
    return f"{source}: invalid ({len(lines)} problem{'s' * (len(lines) != 1)}):\n" + "\n".join(lines)


def loop_command(
    config: Annotated[Path, typer.Argument(help="The loop's configuration (YAML or JSON).")],
    home: Annotated[Path | None, typer.Option(help="Projects directory (default $FLYWHEEL_HOME).")] = None,
    actor: Annotated[str | None, typer.Option(help="Who runs it, for the audit trail (default: $USER).")] = None,
) -> None:
    """Run the flywheel loop: production episodes become training tasks, the model trains through the gateway's
    runners, and every few steps a candidate meets the promotion gate (a passing one goes to MODEL@canary)."""
    from flywheel.backend import LocalBackend
    from flywheel.graders.spec import GraderSpecError
    from flywheel.loop.driver import Loop, LoopConfig

    try:
        loop_config = LoopConfig.load(config)
        # the stack, the held-out set and the seed tasks are read before any model loads
        loop = Loop(loop_config, LocalBackend(path=home), actor=actor or getpass.getuser())
    except ValidationError as exc:
        typer.echo(_problems(exc, config), err=True)
        raise typer.Exit(2) from None
    except (GraderSpecError, OSError, ValueError) as exc:
        typer.echo(f"{config}: {exc}", err=True)
        raise typer.Exit(2) from None

    async def run():
        try:
            return await loop.run()
        finally:
            await loop.backend.close()

    report = asyncio.run(run())
    console.print(f"{len(report.steps)} iterations, step {report.steps[-1] if report.steps else 0}; "
                  f"{report.intake} tasks from production episodes", highlight=False)  # fmt: skip
    table = Table(title="Candidates")
    for column in ("step", "against", "lift [95% interval]", "decision", "deployed"):
        table.add_column(column)
    for c in report.candidates:
        lift = c.decision.lift
        failed = ", ".join(ch.name for ch in c.decision.failed)
        table.add_row(
            str(c.step), c.production, f"{lift.mean:+.3f} [{lift.low:+.3f}, {lift.high:+.3f}]",
            "promote" if c.decision.promote else f"hold ({failed})", c.deployed or "-",
        )  # fmt: skip
    console.print(table)
