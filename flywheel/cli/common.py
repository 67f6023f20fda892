"""What the commands share: the console, stopping with one line and an exit code, opening the store, and the
options several commands take.

Nothing here imports more than typer and rich at import time (the store loads when a command opens it), so that
``flywheel --help`` stays quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from flywheel.store import Store

console = Console()
"""Where the commands print (stdout)."""
stderr_console = Console(stderr=True)
"""For a command whose stdout may carry its data (``flywheel export transitions -o -``)."""

Actor = Annotated[
    str | None, typer.Option(envvar="USER", show_default=False, help="Who does it (the audit event's actor; $USER).")
]
Why = Annotated[str | None, typer.Option(help="Why (the audit event's reason).")]
Db = Annotated[
    str | None, typer.Option(help="The store's database (default: $FLYWHEEL_DB, else SQLite in $FLYWHEEL_HOME).")
]
Home = Annotated[
    Path | None, typer.Option(help="Where models' checkpoints are (default: $FLYWHEEL_HOME, else ./.flywheel).")
]
Project = Annotated[str | None, typer.Option(help="The model's project, if its name is a model of several.")]
VLLMApiKey = Annotated[
    str | None, typer.Option(envvar="FLYWHEEL_VLLM_API_KEY", show_default=False, help="The vLLM servers' key.")
]


def fail(message: str, code: int = 2, *, plain: bool = False, to: Console = console) -> NoReturn:
    """Stop the command: ``message`` as one line, then exit status ``code`` (2 unless the command says otherwise:
    input it cannot use, with nothing written).

    The line is red on ``to`` (the console), or with ``plain`` as it is on stderr (the commands scripts read:
    ``graders``, ``eval``, ``loop``)."""
    if plain:
        typer.echo(message, err=True)
    else:
        to.print(f"[red]{escape(message)}[/]", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def require_actor(actor: str | None) -> str:
    """The actor of a change (``--actor``, else ``$USER``); without one, exit 2: every change names its actor."""
    if not actor:
        fail("Who is doing this? Give --actor NAME (or set $USER): every change names its actor.")
    return actor


def open_store(url: str | None, *, plain: bool = False, prefix: str | None = None) -> Store:
    """The store at ``url`` (None: ``$FLYWHEEL_DB``, else SQLite in ``$FLYWHEEL_HOME``), or exit 2 with one line
    saying why it cannot be opened (after ``prefix``, e.g. the loop's config file; ``plain`` as in ``fail``)."""
    from flywheel.store import Store
    from flywheel.store.db import StoreUnavailableError

    try:
        return Store(url)
    except StoreUnavailableError as exc:
        fail(str(exc) if prefix is None else f"{prefix}: {exc}", plain=plain)
