"""The episode API over HTTP: create an episode and get its base URL, post its outcome, read it back, export it.

Routes (JSON; errors in OpenAI's ``{"error": {...}}`` shape):

- ``POST /episodes`` ``{task_id, split?, model?, metadata?}`` -> 201, the episode with its ``base_url`` and
  ``usage`` (as every route that returns an episode: its calls, tokens, latency and cost at the gateway's prices,
  ``store/costs.py``; a list's counts the calls committed so far, the other routes wait for its queued calls)
- ``GET /episodes?task_id=&split=&status=&limit=&offset=`` -> ``{"data": [episode, ...]}``
- ``GET /episodes/{id}`` -> the episode; ``GET /episodes/{id}/calls`` -> its recorded calls
- ``POST /episodes/{id}/reward`` ``{reward?, metrics?, call_rewards?}`` -> the episode (still open)
- ``POST /episodes/{id}/finish`` ``{reward?, metrics?, call_rewards?}`` -> the episode, finished (it needs a reward)
- ``POST /episodes/{id}/abandon`` ``{reason?}`` -> the episode, abandoned (it never trains)
- ``POST /episodes/{id}/feedback`` ``{kind, value, note?, source?, key?}`` -> 201 (200: that key was already posted),
  outcome feedback arriving later (resolved, a rating, a KPI), in any state; ``GET`` -> ``{"data": [...]}``
- ``GET /episodes/{id}/trajectory`` -> a ``flywheel.Trajectory``; ``GET /episodes/{id}/transitions`` -> JSON lines
- ``GET /groups?task_id=&split=`` -> a ``flywheel.TrajectoryGroup`` of the task's finished episodes

An episode with a text-only call (an upstream returned no token ids) is refused for these (409) unless the caller
passes ``?text_only=allow``: for SFT, graders and evaluation, not RL.

An unknown id is a 404; an outcome that contradicts a closed episode's, or a call in one, a 409; a malformed body
a 400. Posting the same outcome twice is accepted and changes nothing. An episode's outcome, its calls and its
exports wait for its calls that the gateway answered and has not written yet (``Gateway.settled``); an episode that
lost one (answered, never written) is abandoned, and its outcome is a 409 that says which call.

Free text reaches the store through the gateway's redactor (``Gateway.redact``): metadata (as its episode's split
says), an abandon's reason, a feedback's note and source (always). Ids are never redacted, since two ids redacted
alike would become one (two tasks' groups merged, a second feedback taken for a repost of the first): a task id (of
an episode whose split is redacted) or a feedback key in which the redactor finds personal data is a 400.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flywheel.agents.transitions import to_transitions
from flywheel.gateway.export import episode_trajectory, task_group
from flywheel.gateway.recorder import Gateway
from flywheel.gateway.schemas import Episode, EpisodeRecord, EpisodeStatus
from flywheel.store import episodes
from flywheel.store.arms import RESERVED_META_PREFIX
from flywheel.store.costs import Usage, usage
from flywheel.store.feedback import add_feedback, feedback_of


class NewEpisode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(min_length=1, max_length=256, description="Episodes of one task form a training group.")
    split: str = Field("train", min_length=1, max_length=32)
    model: str | None = Field(None, max_length=256)
    metadata: dict[str, Any] = {}

    @field_validator("metadata")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any]) -> dict[str, Any]:
        """The gateway's own meta keys (an episode's arm, a shadow's origin) cannot be set, nor collided with."""
        if reserved := sorted(k for k in value if k.startswith(RESERVED_META_PREFIX)):
            raise ValueError(
                f"metadata key '{reserved[0]}' is reserved: keys starting with '{RESERVED_META_PREFIX}' are the "
                "gateway's"
            )
        return value


class Outcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float | None = None
    metrics: dict[str, float | int | bool] = {}
    call_rewards: dict[int, float] = Field({}, description="Intermediate rewards by call id.")

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError(f"reward was {value}; rewards must be finite numbers")
        return value


class NewFeedback(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str = Field(min_length=1, max_length=64, description="resolved, rating, kpi/<name>, ...")
    value: float
    note: str | None = Field(None, max_length=2000)
    source: str | None = Field(None, max_length=256)
    key: str | None = Field(None, min_length=1, max_length=256, description="Your id for it: a repost is harmless.")

    @field_validator("value")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"value was {value}; feedback values must be finite numbers")
        return value


class Abandon(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(None, max_length=2000)


def refuse_personal_id(gateway: Gateway, field: str, value: str | None, split: str | None = None) -> None:
    """A 400 at ``field`` if the redactor finds personal data in the id ``value`` (stored for an episode of
    ``split``: None, any). The message names what it found, never the value."""
    if value is None or not gateway.redacts(split):
        return
    assert gateway.redactor is not None  # redacts() says there is one
    if found := gateway.redactor(value)[1]:
        kinds = ", ".join(sorted(found))
        message = (
            f"{field} holds personal data ({kinds}); ids are stored as given, never redacted: use an opaque id (a "
            "ticket number, a hash)"
        )
        raise RequestValidationError([{"type": "value_error", "loc": ("body", field), "msg": message, "input": None}])


def episode_url(root: str, episode_id: str) -> str:
    """The OpenAI base URL of an episode on the server at ``root``."""
    return f"{root}/episodes/{episode_id}/v1"


def episode_body(episode: EpisodeRecord, root: str, used: Usage) -> Episode:
    return Episode.of(episode, episode_url(root, episode.id), used)


def root_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


TextOnly = Annotated[
    Literal["refuse", "allow"],
    Query(description="'allow': episodes with text-only calls too (for SFT, graders, evaluation; not RL)."),
]


def episode_router(gateway: Gateway) -> APIRouter:
    router = APIRouter(tags=["episodes"])
    run = gateway.store.run

    async def body_of(episode: EpisodeRecord, request: Request) -> Episode:
        """An episode as the API returns it: with its usage, priced at the gateway's prices."""
        used = (await run(usage, [episode.id], gateway.prices))[episode.id]
        return episode_body(episode, root_url(request), used)

    @router.post("/episodes", status_code=201)
    async def create(body: NewEpisode, request: Request):
        refuse_personal_id(gateway, "task_id", body.task_id, body.split)
        meta, _ = gateway.redact(body.metadata, body.split)
        episode = await run(episodes.create_episode, body.task_id, split=body.split, model=body.model, meta=meta)
        return episode_body(episode, root_url(request), Usage(currency=gateway.prices.currency))

    @router.get("/episodes")
    async def list_(
        request: Request,
        task_id: str | None = None,
        split: str | None = None,
        status: EpisodeStatus | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        offset: Annotated[int, Query(ge=0)] = 0,
    ):
        found = await run(
            episodes.list_episodes, task_id=task_id, split=split, status=status, limit=limit, offset=offset
        )
        used = await run(usage, [e.id for e in found], gateway.prices)
        return {"object": "list", "data": [episode_body(e, root_url(request), used[e.id]) for e in found]}

    @router.get("/episodes/{episode_id}")
    async def get(episode_id: str, request: Request):
        await gateway.settled(episode_id)
        return await body_of(await run(episodes.get_episode, episode_id), request)

    @router.get("/episodes/{episode_id}/calls")
    async def calls(episode_id: str):
        await gateway.settled(episode_id)
        return {"object": "list", "data": [c.model_dump(mode="json") for c in await run(episodes.calls, episode_id)]}

    async def outcome(episode_id: str, body: Outcome, request: Request, finish: bool):
        await gateway.settled(episode_id)
        gateway.refuse_lost(episode_id)
        episode = await run(
            episodes.set_outcome,
            episode_id,
            reward=body.reward,
            metrics=body.metrics,
            call_rewards=body.call_rewards,
            finish=finish,
        )
        if finish:
            gateway.forget(episode)
        return await body_of(episode, request)

    @router.post("/episodes/{episode_id}/reward")
    async def reward(episode_id: str, body: Outcome, request: Request):
        return await outcome(episode_id, body, request, finish=False)

    @router.post("/episodes/{episode_id}/finish")
    async def finish(episode_id: str, body: Outcome, request: Request):
        return await outcome(episode_id, body, request, finish=True)

    @router.post("/episodes/{episode_id}/abandon")
    async def abandon(episode_id: str, body: Abandon, request: Request):
        await gateway.settled(episode_id)
        reason = gateway.redact(body.reason)[0] if body.reason is not None else None
        episode = await run(episodes.abandon, episode_id, reason)
        gateway.forget(episode)
        return await body_of(episode, request)

    @router.post("/episodes/{episode_id}/feedback", status_code=201)
    async def feedback(episode_id: str, body: NewFeedback):
        refuse_personal_id(gateway, "key", body.key)
        note, source = gateway.redact([body.note, body.source])[0]
        record, created = await run(
            add_feedback, episode_id, kind=body.kind, value=body.value, note=note, source=source, key=body.key
        )
        return JSONResponse(record.model_dump(mode="json"), status_code=201 if created else 200)

    @router.get("/episodes/{episode_id}/feedback")
    async def feedback_list(episode_id: str):
        return {"object": "list", "data": [f.model_dump(mode="json") for f in await run(feedback_of, episode_id)]}

    def trajectory_of(s, episode_id: str, text_only: str):
        calls = episodes.calls(s, episode_id)
        return episode_trajectory(episodes.get_episode(s, episode_id), calls, text_only=text_only == "allow")

    @router.get("/episodes/{episode_id}/trajectory")
    async def trajectory(episode_id: str, text_only: TextOnly = "refuse"):
        await gateway.settled(episode_id)
        return JSONResponse((await run(trajectory_of, episode_id, text_only)).model_dump(mode="json"))

    @router.get("/episodes/{episode_id}/transitions")
    async def transitions(
        episode_id: str, gamma: Annotated[float, Query(ge=0, le=1)] = 1.0, text_only: TextOnly = "refuse"
    ):
        await gateway.settled(episode_id)
        rows = to_transitions(await run(trajectory_of, episode_id, text_only), gamma=gamma)
        lines = "".join(row.model_dump_json(by_alias=True) + "\n" for row in rows)
        return Response(lines, media_type="application/x-ndjson")

    @router.get("/gateway/stats")
    async def stats(request: Request):
        """What the gateway did since it started: redactions by kind, canary and shadow traffic, lost and late calls.
        ``calls``: the calls it recorded and how many of them it redacted (a redacted call keeps no token ids: its
        episode is text-only from there on and leaves RL training; a high share says redaction starves training)."""
        traffic = getattr(request.app.state, "traffic", None)
        recorded, redacted = gateway.recorded_calls, gateway.redacted_calls
        return {
            "redacted": dict(gateway.redactions),
            "calls": {
                "recorded": recorded,
                "redacted": redacted,
                "redacted_share": redacted / recorded if recorded else 0.0,
            },
            "lost_calls": gateway.lost_calls,
            "lost_calls_unmarked": gateway.unmarked_calls,  # not yet marked in the store (it did not answer)
            "late_calls": gateway.late_calls,  # answered after their episode closed: dropped
            "traffic": dataclasses.asdict(traffic.counts) if traffic is not None else {},
        }

    @router.get("/groups")
    async def group(task_id: str, split: str | None = None, text_only: TextOnly = "refuse"):
        await gateway.settled()  # every episode's queued calls: the task's are among them
        group = await run(task_group, task_id, split, text_only=text_only == "allow")
        return JSONResponse(group.model_dump(mode="json"))

    return router
