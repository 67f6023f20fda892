"""The traffic policy of a model's deployments: which checkpoint answers a request for ``MODEL@production``, and
which calls are mirrored to a shadow.

- Canary: while ``MODEL@canary`` exists with a share ``s > 0``, a share ``s`` of production's *episodes* is
  answered by the canary's checkpoint (by production's, counted, if that one cannot be served). An episode's side
  is a hash of its id (``arm_hash``): every call of it goes to the same side, in every gateway process and after a
  restart; a call with no episode is drawn at random. Only production traffic is split: an episode of another
  split (a held-out evaluation, a training group) is always answered by production, so that production's own
  evaluation never measures the canary. The recorded call names the canary (``deployment``,
  ``step``) and the episode's ``meta["flywheel_arm"]`` the deployment that answered it
  (``flywheel/store/arms.py``). The canary removed or its share set to 0: production answers from the next
  request on.
- Shadow: while ``MODEL@shadow`` exists with a share ``s > 0``, the calls of a share ``s`` of the episodes that
  production answers (another hash), of the production split only, are also sent to the shadow's checkpoint, after the user's answer is sent,
  and recorded in the production episode's shadow episode (split ``shadow``, ``meta["flywheel_shadow_of"]``), so
  that the candidate's answers can be graded on the same contexts (only the mirror records there: outside calls
  into it are refused). A shadow's failure is logged and counted, never seen by the user; at most
  ``max_in_flight`` shadow calls run at once, and one more is dropped (and counted).

One store read per aliased request (the model's deployments, as resolving the alias already took), and one per
episode while a canary or a shadow takes a share (its split, remembered); what follows the answer (marking the episode's arm, mirroring) runs in tasks of its own after the response is sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from flywheel.store import Store, arms
from flywheel.store.deployments import DeploymentRecord, UnknownDeploymentError, list_deployments, parse_alias
from flywheel.store.episodes import splits_of

log = logging.getLogger(__name__)
T = TypeVar("T")

PRODUCTION, CANARY, SHADOW = "production", "canary", "shadow"
SHADOW_IN_FLIGHT = 4  # shadow calls at once, by default: the rest are dropped
MARKED_EPISODES = 4096  # episodes whose arm (or split) this process remembers having recorded (or read)
PRODUCTION_SPLIT = "production"  # the episodes a canary and a shadow take a share of (the loop's intake_split)


def arm_hash(episode_id: str, salt: str) -> float:
    """A number in [0, 1) that an episode id always gives (the same in every process): the episode is on a
    deployment's side when it is below its share. ``salt`` keeps the canary's and the shadow's draws apart."""
    digest = hashlib.sha256(f"{salt}:{episode_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _share(deployment: DeploymentRecord | None) -> float:
    return 0.0 if deployment is None or deployment.share is None else deployment.share


@dataclass(frozen=True)
class Route:
    """Where one request goes: the deployment that answers it, and the shadow it is mirrored to, if any."""

    asked: str  # the alias the request named (calc@production)
    answer: DeploymentRecord  # the deployment that answers it (calc@production, or calc@canary)
    shadow: DeploymentRecord | None = None  # mirror the call to it, after the answer
    fallback: DeploymentRecord | None = None  # a canary's production, if the canary's checkpoint cannot be served

    @property
    def deployment(self) -> str:
        """The alias that answered, as the call is recorded (``calls.deployment``)."""
        return self.answer.name


@dataclass
class TrafficCounts:
    """What the policy did since the process started."""

    canary: int = 0  # production requests the canary answered
    canary_unserved: int = 0  # of those, answered by production instead: the canary's checkpoint could not be served
    followed: int = 0  # answers to episodes' aliased calls whose follow-up (arm, shadow) has started
    mirrored: int = 0  # shadow calls answered and recorded
    shadow_failed: int = 0  # shadow calls that failed (logged)
    shadow_dropped: int = 0  # shadow calls not made: max_in_flight were running
    arm_failed: int = 0  # episodes' arms that could not be recorded (logged)
    peak_in_flight: int = 0  # the most shadow calls that ran at once


@dataclass
class TrafficPolicy:
    """The gateway's traffic policy over ``store``'s deployments (one per app; safe on one event loop)."""

    store: Store
    max_in_flight: int = SHADOW_IN_FLIGHT
    counts: TrafficCounts = field(default_factory=TrafficCounts)
    _in_flight: int = 0
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _marked: OrderedDict[str, str] = field(default_factory=OrderedDict)  # episode -> its arm, as recorded
    _splits: OrderedDict[str, str | None] = field(default_factory=OrderedDict)  # episode -> its split (None: unknown)

    async def route(self, model: str, episode_id: str | None = None) -> Route:
        """The route of a request for the alias ``model`` (``UnknownDeploymentError`` if there is none) in
        ``episode_id`` (None: a plain call)."""
        name, stage = parse_alias(model)
        found = {d.stage: d for d in await self.store.run(list_deployments, name)}
        if stage not in found:
            raise UnknownDeploymentError(model, sorted(d.name for d in found.values()))
        asked = found[stage]
        if stage != PRODUCTION:
            return Route(model, asked)
        canary, shadow = found.get(CANARY), found.get(SHADOW)
        if _share(canary) == 0 and _share(shadow) == 0:
            return Route(model, asked)
        if episode_id is not None and await self._split(episode_id) != PRODUCTION_SPLIT:
            return Route(model, asked)  # an evaluation or a training episode: production's own answers
        draw = random.random() if episode_id is None else arm_hash(episode_id, CANARY)
        if canary is not None and draw < _share(canary):
            self.counts.canary += 1
            return Route(model, canary, fallback=asked)
        if episode_id is not None and shadow is not None and arm_hash(episode_id, SHADOW) < _share(shadow):
            return Route(model, asked, shadow)
        return Route(model, asked)

    async def _split(self, episode_id: str) -> str | None:
        """The split of ``episode_id`` (None: no such episode), read once and remembered (a split never changes)."""
        if episode_id not in self._splits:
            _remember(self._splits, episode_id, (await self.store.run(splits_of, [episode_id])).get(episode_id))
        return self._splits[episode_id]

    def fall_back(self, route: Route) -> Route | None:
        """The route to production for a request the canary was to answer but cannot (its checkpoint is not
        served and cannot be loaded): logged and counted; None for a route with no production to fall back on."""
        if route.fallback is None:
            return None
        self.counts.canary_unserved += 1
        log.warning("the canary %s (step %d) cannot be served: production answers", route.deployment, route.answer.step)
        return Route(route.asked, route.fallback)

    async def after(
        self,
        route: Route,
        episode_id: str | None,
        mirror: Callable[[str, str], Awaitable[object]],
    ) -> None:
        """After the answer to a call in ``episode_id`` is sent: record the episode's arm (once per process) and
        mirror the call to the route's shadow, each in a task of its own (a keep-alive connection's next request
        waits for nothing). ``mirror(shadow alias, shadow episode id)`` makes the shadow's call."""
        if episode_id is None:
            return
        self.counts.followed += 1
        if self._marked.get(episode_id) != route.deployment:
            self._spawn(self._mark(episode_id, route.deployment))
        if route.shadow is None:
            return
        if self._in_flight >= self.max_in_flight:
            self.counts.shadow_dropped += 1
            return
        self._in_flight += 1
        self.counts.peak_in_flight = max(self.counts.peak_in_flight, self._in_flight)
        self._spawn(self._mirror(route.shadow, episode_id, mirror))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mark(self, episode_id: str, arm: str) -> None:
        try:
            marked = await self.store.run(arms.mark_arm, episode_id, arm)
        except Exception:
            self.counts.arm_failed += 1
            log.exception("could not record that %s answered episode %s", arm, episode_id)
            return
        _remember(self._marked, episode_id, marked)

    async def _mirror(
        self, shadow: DeploymentRecord, episode_id: str, mirror: Callable[[str, str], Awaitable[object]]
    ) -> None:
        try:
            episode = await self.store.run(arms.shadow_episode, episode_id, shadow.name)
            await mirror(shadow.name, episode.id)
            self.counts.mirrored += 1
        except Exception:
            self.counts.shadow_failed += 1
            log.warning("the shadow %s failed on a call of episode %s", shadow.name, episode_id, exc_info=True)
        finally:
            self._in_flight -= 1

    async def drain(self, followed: int = 0) -> None:
        """Wait until ``followed`` answers have been followed up and the work that started has ended (from any
        event loop: it polls; at most a minute). An answer is followed up once sent: after its client may read it."""
        async with asyncio.timeout(60):
            while self.counts.followed < followed or self._tasks:  # noqa: ASYNC110  (on the server's loop)
                await asyncio.sleep(0.01)


def _remember(memory: OrderedDict[str, T], episode_id: str, value: T) -> None:
    """Keep ``episode_id``'s value, the most recent ``MARKED_EPISODES`` of them."""
    memory[episode_id] = value
    memory.move_to_end(episode_id)
    while len(memory) > MARKED_EPISODES:
        memory.popitem(last=False)
