"""The dashboard served: its API and its static page at ``/ui``, mounted on an app (``flywheel serve``'s) or as an
app of its own (``flywheel dashboard``)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from flywheel.approvals.desk import ApprovalDesk
from flywheel.approvals.routes import ERRORS as APPROVAL_ERRORS
from flywheel.dashboard.api import UnknownRunError, UnknownTrajectoryError, dashboard_router
from flywheel.dashboard.approvals_api import approvals_ui_router
from flywheel.dashboard.loop_api import UnknownLoopItemError, loop_router
from flywheel.server.errors import error_response
from flywheel.store import Store

STATIC = Path(__file__).parent / "static"
ROOT = "/ui"


def mount(app: FastAPI, store: Store, home: Path) -> None:
    """Add the dashboard to ``app``: its API under ``/ui/api`` (runs; the loop under ``/ui/api/loop``; approvals
    under ``/ui/api/approvals``, decided through ``app.state.approvals``, the server's desk, if it has one; with
    their 404s and 409s) and its page at ``/ui/``."""
    app.include_router(dashboard_router(store, home))
    app.include_router(loop_router(store))
    app.include_router(approvals_ui_router(getattr(app.state, "approvals", None) or ApprovalDesk(store)))

    for error, handler in APPROVAL_ERRORS.items():
        app.add_exception_handler(error, handler)

    @app.exception_handler(UnknownRunError)
    @app.exception_handler(UnknownLoopItemError)
    @app.exception_handler(UnknownTrajectoryError)
    async def _unknown(_: Request, exc: LookupError):
        return error_response(404, str(exc.args[0]), "invalid_request_error", code="not_found")

    app.mount(ROOT, StaticFiles(directory=STATIC, html=True), name="dashboard")


def create_dashboard_app(store: Store, home: Path) -> FastAPI:
    """The dashboard alone (``flywheel dashboard``): ``/`` leads to the page at ``/ui/``; the API's schema is at
    ``/openapi.json`` (FastAPI's /docs pages are off: they load their scripts from a CDN)."""
    app = FastAPI(title="Flywheel dashboard", docs_url=None, redoc_url=None)

    @app.get("/", include_in_schema=False)
    async def _root() -> RedirectResponse:
        return RedirectResponse(f"{ROOT}/")

    mount(app, store, home)
    return app
