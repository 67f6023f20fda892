"""``flywheel dashboard``: the dashboard (``flywheel.dashboard``) served on its own, over a store and a home."""

from __future__ import annotations

from typing import Annotated

import typer

from flywheel.cli.common import Home, console, fail, open_store


def dashboard(
    host: Annotated[
        str, typer.Option(help="Where to listen (a loopback address: the dashboard has no keys).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8300,
    home: Home = None,
    store: Annotated[
        str | None, typer.Option(help="The store's database (default: $FLYWHEEL_DB, else SQLite in the home).")
    ] = None,
):
    """Serve the dashboard (runs, their curves, checkpoints and rollouts; live while they train) at
    http://HOST:PORT/ui/. flywheel serve also has it, at /ui behind its admin keys."""
    import uvicorn

    from flywheel.dashboard.app import create_dashboard_app
    from flywheel.gateway.auth import is_loopback
    from flywheel.home import default_home
    from flywheel.store.db import default_url, shown_url

    if not is_loopback(host):
        fail(
            f"Refusing to serve the dashboard on {host}: it has no API keys, and it shows every run's trajectories. "
            "Bind to 127.0.0.1 (reach it through an SSH tunnel), or use flywheel serve's /ui, behind its admin keys."
        )
    where = home or default_home()
    opened = open_store(store or default_url(where))
    console.print(f"Dashboard: http://{host}:{port}/ui/ (runs of {shown_url(opened.url)}, checkpoints in {where})")
    uvicorn.run(create_dashboard_app(opened, where), host=host, port=port, log_level="warning")
