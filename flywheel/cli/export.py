"""``flywheel export transitions RUN``: a run's saved trajectories as one JSONL row per LLM call
(``flywheel.agents.transitions``), to a file or to stdout (so everything else it prints goes to stderr)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from flywheel.cli.common import fail, stderr_console

export_app = typer.Typer(help="Export a run's data for other tools.", no_args_is_help=True)


@export_app.command("transitions")
def export_transitions(
    run: Annotated[str, typer.Argument(help="A model directory, or PROJECT/NAME under $FLYWHEEL_HOME.")],
    split: Annotated[str, typer.Option(help="Which saved trajectories: train, val, ...")] = "train",
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="JSONL file, '-' for stdout [default: RUN/transitions/SPLIT.jsonl]"),
    ] = None,
    gamma: Annotated[float, typer.Option(min=0.0, max=1.0, help="Discount of the returns.")] = 1.0,
) -> None:
    """Write one JSONL row per LLM call: {trajectory_id, t, input, output, reward, return, ...}."""
    from flywheel.agents.transitions import run_directory, run_transitions, write_transitions

    try:
        run_dir = run_directory(run)
        rows = run_transitions(run_dir, split, gamma=gamma)
        if output == "-":
            count = 0
            for row in rows:
                sys.stdout.write(row.to_json() + "\n")
                count += 1
            target = "stdout"
        else:
            path = Path(output) if output else run_dir / "transitions" / f"{split}.jsonl"
            count = write_transitions(path, rows)
            target = str(path)
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc), to=stderr_console)
    stderr_console.print(f"{count} transitions written to {target}")
