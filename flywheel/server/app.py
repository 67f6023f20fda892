"""The server: an OpenAI-compatible API (``/v1/models``, ``/v1/chat/completions``: ``chat.ChatService``) over the
in-process engines, with the gateway's routes (episodes, the rollout queue, approvals), the graders' routes, API keys
and body limits, and every error in OpenAI's shape (``refusals``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request

from flywheel.approvals.desk import ApprovalDesk
from flywheel.approvals.routes import ERRORS as APPROVAL_ERRORS
from flywheel.approvals.routes import approvals_router
from flywheel.gateway.api import episode_router
from flywheel.gateway.auth import ApiKeyAuth, ApiKeys, TokenBudgets, request_role
from flywheel.gateway.queue import queue_router
from flywheel.gateway.recorder import Gateway
from flywheel.gateway.traffic import SHADOW_IN_FLIGHT, TrafficPolicy
from flywheel.gateway.upstream import Relay, Upstream
from flywheel.inference.registry import ModelRegistry
from flywheel.server.chat import ChatService, json_body
from flywheel.server.graders import graders_router
from flywheel.server.limits import MAX_BODY_BYTES, BodyLimit
from flywheel.server.refusals import install as install_refusals


def create_app(
    registry: ModelRegistry,
    gateway: Gateway | None = None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    auth: ApiKeys | None = None,
    upstream: Upstream | None = None,
    shadow_in_flight: int = SHADOW_IN_FLIGHT,
    budgets: TokenBudgets | None = None,
    listed: Callable[[], list[dict[str, Any]]] | None = None,
) -> FastAPI:
    """The OpenAI-compatible API over ``registry``'s engines; with a ``gateway``, also the episode API and the
    episode-scoped routes (``/episodes/{id}/v1/...``, or ``/v1/...`` with an ``X-Flywheel-Episode`` header) whose
    calls it records. With ``auth`` keys, each request needs a key of its route's role (``flywheel.gateway.auth``);
    without any, every route is open. With an ``upstream``, a model the registry does not serve is asked of it
    (``flywheel.gateway.upstream``: relayed, and recorded in an episode). A gateway's deployments are served by
    its traffic policy (``flywheel.gateway.traffic``: canary, shadow; at most ``shadow_in_flight`` shadow calls at
    once), which is ``app.state.traffic``. With keys, an agent key may not have a checkpoint loaded that no
    deployment points at, and each request's ``n`` x ``max_tokens`` is capped by its key's role (``budgets``, by
    default ``TokenBudgets.configured()``). ``listed``: more models ``/v1/models`` lists (``/v1/models``' objects),
    which the registry's loader serves on their first request (fine-tuned ones). At shutdown, the gateway's calls
    still queued are written first."""
    budgets = budgets or TokenBudgets.configured()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if gateway is not None:  # every call answered is in the store before the server exits
            if threading.main_thread().is_alive():
                await asyncio.to_thread(gateway.drain)
            else:  # stopped at interpreter exit (a script that never closed its backend): no new threads then
                gateway.drain()

    app = FastAPI(title="Flywheel OpenAI-compatible API", lifespan=lifespan)
    relay = Relay(upstream, gateway) if upstream is not None else None
    traffic = app.state.traffic = TrafficPolicy(gateway.store, shadow_in_flight) if gateway is not None else None
    desk = app.state.approvals = (
        ApprovalDesk(gateway.store, lambda text, split: gateway.redact(text, split)[0]) if gateway is not None else None
    )
    service = ChatService(registry, gateway, relay=relay, traffic=traffic, desk=desk, budgets=budgets)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if auth:  # added last, so it runs first: a refused request's body is never read
        app.add_middleware(ApiKeyAuth, keys=auth)

    install_refusals(app)

    @app.get("/v1/models")
    async def list_models():
        models = [
            {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owned_by} for m in registry.all()
        ]
        if listed is not None:
            local = {m["id"] for m in models}
            models += [m for m in await asyncio.to_thread(listed) if m["id"] not in local]
        if relay is not None:  # the local engine's names first: it answers them
            local = {m["id"] for m in models}
            models += [m for m in await relay.models() if m["id"] not in local]
        return {"object": "list", "data": models}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    app.include_router(graders_router())
    if gateway is not None:
        app.include_router(episode_router(gateway))
        app.include_router(queue_router(gateway))
    if desk is not None:
        app.include_router(approvals_router(desk))
        for error, handler in APPROVAL_ERRORS.items():
            app.add_exception_handler(error, handler)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, x_flywheel_episode: Annotated[str | None, Header()] = None):
        return await service.answer(await json_body(request), x_flywheel_episode, request_role(request))

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def episode_chat_completions(episode_id: str, request: Request):
        return await service.answer(await json_body(request), episode_id, request_role(request))

    @app.get("/episodes/{episode_id}/v1/models")
    async def episode_models(episode_id: str):
        return await list_models()

    return app
