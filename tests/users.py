"""Simulated production users for the loop's concurrency and kill tests: a few at once, each running episodes
through a real gateway over HTTP (the episode API through httpx, the calls through the real openai SDK): an
episode of the split ``production`` whose metadata carry its item (what the loop's intake takes into its pool), one
or two chat calls, a rating posted as feedback, the finish. What each user got an answer for is counted here, client
side, to be compared with what the store holds; any error a user sees is kept, never retried."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openai

from flywheel.gateway.client import EpisodeClient
from flywheel.store import EpisodeStatus, Store, episodes, feedback


@dataclass
class Sent:
    """One episode as its user saw it."""

    item: str  # its item's id
    calls: int = 0  # chat calls answered
    feedback: int = 0  # feedback posts answered
    finished_at: float | None = None  # time.monotonic() when its finish was answered


@dataclass
class Users:
    """``users`` at once against the server at ``root``; ``model()`` names the model of each new episode's calls
    (an alias such as ``calc@production`` once one is deployed, say)."""

    root: str
    model: Callable[[], str]
    users: int = 3
    prefix: str = "user"
    pause: float = 0.2  # seconds between a user's episodes
    sent: dict[str, Sent] = field(default_factory=dict)  # episode id -> what its user got answered
    errors: list[str] = field(default_factory=list)  # whatever a user saw go wrong
    _numbers: itertools.count = field(default_factory=itertools.count)

    async def run(self, stop: threading.Event) -> None:
        """Until ``stop`` is set (from any thread); each user ends its episode first."""
        async with EpisodeClient(self.root, timeout=300) as episode_client:
            await asyncio.gather(*(self._user(episode_client, stop) for _ in range(self.users)))

    async def _user(self, episode_client: EpisodeClient, stop: threading.Event) -> None:
        while not stop.is_set():
            n = next(self._numbers)
            item = {"id": f"{self.prefix}-{n}", "question": f"Name a colour, please ({n}).", "fail": False}
            try:
                await self._episode(episode_client, item, n)
            except Exception as exc:  # an answer a user would have seen: kept for the test to show
                self.errors.append(f"{item['id']}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(self.pause)

    async def _episode(self, episode_client: EpisodeClient, item: dict, n: int) -> None:
        e = await episode_client.create(f"{self.prefix}-{n}", split="production", metadata={"item": item})
        sent = self.sent[e.id] = Sent(item=item["id"])
        messages: list[dict] = [{"role": "user", "content": item["question"]}]
        async with openai.AsyncOpenAI(base_url=e.base_url, api_key="-", max_retries=0, timeout=300) as client:
            for turn in range(1 + n % 2):  # every other episode has a second turn, on the first answer
                reply = await client.chat.completions.create(
                    model=self.model(), messages=messages, max_tokens=6, temperature=1
                )
                sent.calls += 1
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
                messages += [{"role": "user", "content": "Another one?"}] if turn == 0 and n % 2 else []
        await episode_client.feedback(e.id, "rating", float(n % 5), key=f"rating-{e.id}")
        sent.feedback += 1
        await episode_client.finish(e.id, 1.0)
        sent.finished_at = time.monotonic()

    def finished_before(self, moment: float) -> set[str]:
        """The items of the episodes whose finish was answered before ``moment`` (``time.monotonic()``)."""
        return {s.item for s in self.sent.values() if s.finished_at is not None and s.finished_at < moment}

    async def until_finished(self, count: int, timeout: float = 300) -> None:
        """Wait until ``count`` episodes are finished (or a user saw an error: the test shows it)."""
        deadline = time.monotonic() + timeout
        while sum(s.finished_at is not None for s in self.sent.values()) < count and not self.errors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} episodes finished in {timeout:.0f} s")
            await asyncio.sleep(0.2)


def differences(store: Store, users: Users) -> list[str]:
    """How the store's production episodes of these users differ from what they were answered (none: every episode,
    call and feedback each user got an answer for is stored once, and nothing else of theirs): one line each."""
    found = []
    with store.session() as s:
        listed = episodes.list_episodes(s, split="production", limit=100_000)
        stored = {e.id: e for e in listed if e.task_id.startswith(f"{users.prefix}-")}
        if extra := sorted(stored.keys() - users.sent.keys()):
            found.append(f"{len(extra)} stored episode(s) no user was answered for: {extra[:5]}")
        for episode_id, sent in sorted(users.sent.items()):
            episode = stored.get(episode_id)
            if episode is None:
                found.append(f"{episode_id} ({sent.item}): lost")
                continue
            calls, posted = len(episodes.calls(s, episode_id)), len(feedback.feedback_of(s, episode_id))
            finished = episode.status == EpisodeStatus.finished
            if (calls, posted, finished) != (sent.calls, sent.feedback, sent.finished_at is not None):
                found.append(
                    f"{episode_id} ({sent.item}): {calls} call(s), {posted} feedback, {episode.status.value} stored;"
                    f" {sent.calls}, {sent.feedback}, {'finished' if sent.finished_at else 'open'} answered"
                )
    return found
