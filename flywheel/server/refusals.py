"""What each exception a route of the server lets out becomes, in OpenAI's error shape (``errors.error_response``):
the table ``REFUSALS`` (status, type, param, code), installed on an app by ``install``. A client's mistake is a 4xx
that says what was wrong and where; the server's own trouble (an engine closed, a vLLM server or the database not
answering) a 5xx that says whether retrying helps; never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flywheel.approvals.desk import ToolNotInScopeError
from flywheel.gateway.auth import TokenBudgetError
from flywheel.gateway.export import NotTrainableError
from flywheel.gateway.recorder import GatewayBusyError, transient
from flywheel.inference.engine import ContextOverflowError, EngineClosedError
from flywheel.inference.guided import GrammarError
from flywheel.inference.protocol import SamplerUnavailableError
from flywheel.inference.registry import UnknownModelError
from flywheel.server.errors import error_response
from flywheel.store import EpisodeConflictError, UnknownEpisodeError
from flywheel.store.deployments import UnknownDeploymentError

log = logging.getLogger(__name__)
CLIENT, SERVER = "invalid_request_error", "server_error"


class ModelNotAllowedError(UnknownModelError):
    """An agent key asked for a model that is not served now and that no deployment points at: having it loaded
    (which evicts the oldest checkpoint engine: production's or the canary's, maybe) needs a runner key."""

    def __init__(self, name: str, known: list[str]):
        super().__init__(name, known)
        self.args = (
            f"An agent key may ask only for the models served now ({', '.join(known) or 'none'}) and deployment "
            f"aliases (MODEL@production, ...); '{name}' is neither: loading another checkpoint needs a runner key.",
        )


@dataclass(frozen=True)
class Refusal:
    """What an exception becomes: ``param`` (else the exception's own ``param``, if it has one), ``message`` (else
    its text), ``retry_after`` seconds for a 503 worth retrying."""

    status: int
    code: str | None = None
    param: str | None = None
    type: str = CLIENT
    message: Callable[[Any], str] = str
    retry_after: Callable[[Any], int] | None = None

    def response(self, exc: Exception) -> JSONResponse:
        param = self.param or getattr(exc, "param", None)
        response = error_response(self.status, self.message(exc), self.type, param=param, code=self.code)
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(self.retry_after(exc))
        return response


REFUSALS: dict[type[Exception], Refusal] = {
    UnknownModelError: Refusal(404, "model_not_found", "model"),
    UnknownDeploymentError: Refusal(404, "model_not_found", "model"),
    ModelNotAllowedError: Refusal(403, "model_not_allowed", "model"),
    TokenBudgetError: Refusal(400, "token_budget_exceeded"),  # its param: n or max_tokens
    ContextOverflowError: Refusal(400, "context_length_exceeded", "messages"),
    GrammarError: Refusal(400, message=lambda exc: f"Invalid '{exc.param}': {exc}"),
    ToolNotInScopeError: Refusal(403, "tool_not_allowed", "tools"),
    UnknownEpisodeError: Refusal(404, "episode_not_found", "episode_id"),
    EpisodeConflictError: Refusal(409, "episode_closed", "episode_id"),
    NotTrainableError: Refusal(409, "episode_not_trainable", "episode_id"),
    ValueError: Refusal(400),
    EngineClosedError: Refusal(503, "engine_closed", type=SERVER),  # the backend closed (or shut down) while it ran
    SamplerUnavailableError: Refusal(502, "sampler_unavailable", type=SERVER),  # a vLLM server failed
    # its calls not written yet: the database is slow or down
    GatewayBusyError: Refusal(503, "gateway_busy", type=SERVER, retry_after=lambda exc: exc.retry_after),
}


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", []) if p != "body"]
    where = ".".join(loc) or None
    message = f"Invalid request: {first.get('msg', 'malformed body')}" + (f" (at '{where}')" if where else "")
    return error_response(400, message, CLIENT, param=where)


async def _refused(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (no such route, a method the route has not, a body that is not JSON), in the same
    shape as every other error."""
    message = {
        404: f"There is no route {request.method} {request.url.path} on this server.",
        405: f"{request.url.path} does not take {request.method}.",
        400: f"Invalid request: {exc.detail} (a JSON body is expected)",
    }.get(exc.status_code, str(exc.detail))
    response = error_response(exc.status_code, message, CLIENT if exc.status_code < 500 else SERVER)
    response.headers.update(exc.headers or {})
    return response


async def _store_down(request: Request, exc: DBAPIError) -> JSONResponse:
    """A read or an outcome the database could not answer: a 503 to retry, or (a schema that is not the server's, a
    constraint) a 500 that is the server's fault, logged."""
    kind = type(exc.orig or exc).__name__
    if not transient(exc):
        log.error("%s %s: the store's database refused it", request.method, request.url.path, exc_info=exc)
        first = str(exc.orig or exc).strip().splitlines()[0][:300] if str(exc.orig or exc).strip() else kind
        message = (f"The store's database refused this request ({kind}: {first}); retrying will not help. The"
                   " server's log has the details.")  # fmt: skip
        return error_response(500, message, SERVER, code="store_error")
    response = error_response(503, f"The store's database did not answer ({kind}): retry shortly.", SERVER,
                              code="store_unavailable")  # fmt: skip
    response.headers["Retry-After"] = "2"
    return response


def install(app: FastAPI) -> None:
    """The error table's handlers on ``app``: an exception gets its closest class's refusal."""
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _refused)
    app.add_exception_handler(DBAPIError, _store_down)
    for error, refusal in REFUSALS.items():

        async def handle(_: Request, exc: Exception, refusal: Refusal = refusal) -> JSONResponse:
            return refusal.response(exc)

        app.add_exception_handler(error, handle)
