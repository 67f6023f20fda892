"""Deployment arms: which deployment answered each episode (production's, a canary's, a shadow's), so that the loop
can compare a canary with production (and grade a shadow on the same contexts) and roll back.

The gateway (``flywheel/gateway/traffic.py``) records it in two places: every call names the alias that answered it
(``calls.deployment``: ``calc@canary`` for a ``calc@production`` request the canary answered), and the episode's
``meta["flywheel_arm"]`` names the deployment that answered its calls (``"mixed"`` once two have: its canary was
removed or its share changed mid-episode), for grouping episodes without reading their calls. A shadow episode
mirrors one production episode: split ``shadow``, the same task, ``meta["flywheel_shadow_of"]`` its production
episode's id, created by the first call mirrored, under an id derived from that episode's (so two gateway processes
create one). That id can be computed by whoever knows the production episode's: the gateway's episode-scoped routes
refuse it (``is_shadow_episode_id``), so that only its own mirror records there. The gateway's meta keys start with
``flywheel_`` (``RESERVED_META_PREFIX``), which an episode's creator may not use.

``arms`` reads them back per arm over a time window (or since an audit event, e.g. the canary's deploy): each
episode's id, reward, status, outcome feedback by kind, and usage (calls, tokens, latency, and cost at the prices
given: ``store/costs.py``); each arm's cost per episode.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from flywheel.store.costs import Prices, Usage, usage
from flywheel.store.db import in_chunks
from flywheel.store.episodes import EpisodeRecord, EpisodeStatus, Timestamp, _episode, get_episode
from flywheel.store.schema import AuditEvent, Call, Episode, Feedback

RESERVED_META_PREFIX = "flywheel_"  # the gateway's meta keys: refused in a creator's metadata
ARM_KEY = "flywheel_arm"  # meta: the deployment that answered the episode's calls
SHADOW_OF_KEY = "flywheel_shadow_of"  # a shadow episode's meta: its production episode's id
MIXED = "mixed"  # meta[ARM_KEY] of an episode that more than one deployment answered
SHADOW_SPLIT = "shadow"
SHADOW_ID_PREFIX = "sh_"  # a shadow episode's id; an episode created through the API has another ("ep_")


def mark_arm(s: Session, episode_id: str, arm: str) -> str:
    """Record that ``arm`` (a deployment's alias) answered a call of the episode: its ``meta["arm"]`` becomes
    ``arm``, or ``"mixed"`` if another had answered before. Returns what it is now; an unknown episode:
    ``UnknownEpisodeError``. Any state: the arm of a call that ran is a fact, whatever happened to its episode."""
    row = _episode(s, episode_id)
    if row.meta.get(ARM_KEY) in (arm, MIXED):
        return row.meta[ARM_KEY]
    row = _episode(s, episode_id, lock=True)  # read again under the lock: another process may have marked it
    before = row.meta.get(ARM_KEY)
    row.meta = {**row.meta, ARM_KEY: arm if before in (None, arm) else MIXED}
    s.flush()
    return row.meta[ARM_KEY]


def shadow_episode_id(episode_id: str) -> str:
    """The id of the shadow episode of ``episode_id``: derived from it, so anyone who knows that id can compute it
    (which is why the gateway's episode-scoped routes refuse it: ``is_shadow_episode_id``)."""
    return SHADOW_ID_PREFIX + hashlib.sha256(f"flywheel-shadow:{episode_id}".encode()).hexdigest()[:40]


def is_shadow_episode_id(episode_id: str) -> bool:
    """Whether ``episode_id`` is a shadow episode's: one only the gateway's own mirror may record in."""
    return episode_id.startswith(SHADOW_ID_PREFIX)


def shadow_episode(s: Session, episode_id: str, shadow: str) -> EpisodeRecord:
    """The shadow episode of production episode ``episode_id`` (created on first use, answered by the deployment
    ``shadow``); one per episode even when two processes create it at once."""
    sid = shadow_episode_id(episode_id)
    if (found := s.get(Episode, sid)) is not None:
        return EpisodeRecord.model_validate(found)
    origin = get_episode(s, episode_id)
    row = Episode(
        id=sid, task_id=origin.task_id, split=SHADOW_SPLIT, model=shadow, status=EpisodeStatus.open, reward=None,
        metrics={}, meta={SHADOW_OF_KEY: episode_id, ARM_KEY: shadow}, created_at=datetime.now(UTC), finished_at=None,
    )  # fmt: skip
    try:
        with s.begin_nested():
            s.add(row)
    except IntegrityError:  # another process created it first
        if (found := s.get(Episode, sid)) is None:
            raise
        return EpisodeRecord.model_validate(found)
    return EpisodeRecord.model_validate(row)


class ArmEpisode(BaseModel):
    """One episode of an arm: what the loop compares."""

    id: str
    task_id: str
    split: str
    status: EpisodeStatus
    reward: float | None
    feedback: dict[str, list[float]]  # kind -> values, in the order they arrived
    steps: list[int]  # the checkpoint steps that answered its calls in the window
    shadow_of: str | None  # a shadow episode's production episode
    created_at: Timestamp
    usage: Usage = Field(default_factory=Usage)  # all its calls (those outside the window too), at the report's prices


class Arm(BaseModel):
    deployment: str  # the alias that answered (calc@production, calc@canary, calc@shadow)
    episodes: list[ArmEpisode]

    @property
    def rewards(self) -> list[float]:
        """The rewards of its finished episodes."""
        return [e.reward for e in self.episodes if e.status == EpisodeStatus.finished and e.reward is not None]

    @property
    def cost_per_episode(self) -> float | None:
        """The mean cost of its episodes (None without any)."""
        return sum(e.usage.cost for e in self.episodes) / len(self.episodes) if self.episodes else None


class ArmsReport(BaseModel):
    model: str
    since: Timestamp | None
    until: Timestamp | None
    arms: dict[str, Arm]  # by deployment
    mixed: list[ArmEpisode]  # answered by more than one deployment in the window: in no arm


def arms(
    s: Session,
    model: str,
    *,
    since: datetime | None = None,
    since_event: int | None = None,
    until: datetime | None = None,
    prices: Prices | None = None,
) -> ArmsReport:
    """The episodes each of ``model``'s deployments answered calls of between ``since`` (or the time of audit event
    ``since_event``, e.g. the canary's current ``event_id``) and ``until``, per deployment: an episode is in the arm
    of the deployment that answered its calls in the window (``mixed`` if several did). Removed aliases' calls count
    too: the calls name them. Each episode's usage is priced at ``prices`` (None: no prices, every cost 0)."""
    if since_event is not None:
        event = s.get(AuditEvent, since_event)
        if event is None:
            raise ValueError(f"there is no audit event {since_event} to count from")
        since = _utc(event.at) if since is None else max(_utc(since), _utc(event.at))
    since, until = (None if t is None else _utc(t) for t in (since, until))
    query = select(Call.episode_id, Call.deployment, Call.step).where(
        Call.deployment.startswith(f"{model}@", autoescape=True)
    )
    if since is not None:
        query = query.where(Call.created_at >= since)
    if until is not None:
        query = query.where(Call.created_at < until)
    answered: dict[str, set[str]] = defaultdict(set)
    steps: dict[str, set[int]] = defaultdict(set)
    for episode_id, deployment, step in s.execute(query.order_by(Call.id)):
        answered[episode_id].add(deployment)
        if step is not None:
            steps[episode_id].add(step)
    ids = sorted(answered)
    episodes: dict[str, Episode] = {}
    feedback: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for chunk in in_chunks(ids):
        episodes |= {row.id: row for row in s.scalars(select(Episode).where(Episode.id.in_(chunk)))}
        rows = s.execute(
            select(Feedback.episode_id, Feedback.kind, Feedback.value)
            .where(Feedback.episode_id.in_(chunk))
            .order_by(Feedback.id)
        )
        for episode_id, kind, value in rows:
            feedback[episode_id][kind].append(value)
    used = usage(s, ids, prices or Prices())
    report = ArmsReport(model=model, since=since, until=until, arms={}, mixed=[])
    for episode_id in sorted(ids, key=lambda i: (_utc(episodes[i].created_at), i)):
        row = episodes[episode_id]
        meta: dict[str, Any] = row.meta
        episode = ArmEpisode(
            id=row.id, task_id=row.task_id, split=row.split, status=EpisodeStatus(row.status), reward=row.reward,
            feedback={k: list(v) for k, v in feedback[episode_id].items()}, steps=sorted(steps[episode_id]),
            shadow_of=meta.get(SHADOW_OF_KEY), created_at=row.created_at, usage=used[episode_id],
        )  # fmt: skip
        if len(answered[episode_id]) > 1:
            report.mixed.append(episode)
        else:
            (deployment,) = answered[episode_id]
            report.arms.setdefault(deployment, Arm(deployment=deployment, episodes=[])).episodes.append(episode)
    return report


def _utc(value: datetime) -> datetime:
    """In UTC (what both databases compare in); SQLite gives back no time zone: it was UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
