"""Run many rollouts concurrently, with a progress bar and a budget for failures."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tqdm.auto import tqdm

from flywheel.types import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)

AfterEach = Callable[[TrajectoryGroup], Any]  # -> group | None | list[group], or an awaitable of these


class _Progress:
    """Counts results and shows the running reward mean, exception count and a few metric means."""

    def __init__(self, total: int, desc: str | None, max_exceptions: int | float):
        self.bar = tqdm(total=total, desc=desc, disable=desc is None)
        self.limit = max_exceptions if max_exceptions >= 1 or max_exceptions == 0 else max_exceptions * total
        self.rewards: list[float] = []
        self.metrics: dict[str, list[float]] = {}
        self.exceptions = 0

    def record(self, result: Trajectory | BaseException) -> None:
        if isinstance(result, BaseException):
            self.exceptions += 1
            if self.exceptions > self.limit:
                raise result
        else:
            self.rewards.append(result.reward)
            for key, value in result.metrics.items():
                self.metrics.setdefault(key, []).append(float(value))
        postfix = {"reward": sum(self.rewards) / len(self.rewards)} if self.rewards else {}
        postfix |= {k: sum(v) / len(v) for k, v in list(self.metrics.items())[:4]}
        postfix["exceptions"] = self.exceptions
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)


async def _run_all(
    awaitables: list[Awaitable[Trajectory]],
    progress: _Progress,
    max_concurrency: int | None,
    on_result: Callable[[int, Trajectory | BaseException], Awaitable[None] | None],
) -> None:
    """Await every rollout (at most ``max_concurrency`` at once); stop everything at the first over-budget error."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int, aw: Awaitable[Trajectory]) -> None:
        try:
            if limit:
                async with limit:
                    result: Trajectory | BaseException = await aw
            else:
                result = await aw
        except Exception as exc:  # noqa: BLE001 - a rollout failure is data until the budget runs out
            result = exc
        progress.record(result)
        outcome = on_result(i, result)
        if inspect.isawaitable(outcome):
            await outcome

    tasks = [asyncio.ensure_future(one(i, aw)) for i, aw in enumerate(awaitables)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for aw in awaitables:  # coroutines that never started must be closed, not garbage-collected unawaited
            if inspect.iscoroutine(aw) and inspect.getcoroutinestate(aw) == inspect.CORO_CREATED:
                aw.close()
        progress.bar.close()


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
    after_each: AfterEach | None = None,
) -> list[TrajectoryGroup]:
    """Run all rollouts of all groups concurrently and return the finished groups in input order.

    ``max_exceptions`` is a count, or a fraction (< 1) of all rollouts; failures within it are recorded on
    their group, one more re-raises the rollout's own exception. ``after_each(group)`` runs as each group
    finishes and may return a group, ``None`` (drop it) or a list of groups.
    """
    groups = [g if isinstance(g, TrajectoryGroup) else await g for g in groups]
    owners: list[int] = []
    awaitables: list[Awaitable[Trajectory]] = []
    for gi, group in enumerate(groups):
        for aw in group.take_pending():
            owners.append(gi)
            awaitables.append(aw)
    remaining = [owners.count(gi) for gi in range(len(groups))]
    finished: dict[int, list[TrajectoryGroup]] = {}

    async def finish(gi: int) -> None:
        group: Any = groups[gi]
        if after_each is not None:
            try:
                group = after_each(group)
                if inspect.isawaitable(group):
                    group = await group
            except Exception as exc:
                raise RuntimeError(f"after_each failed on group {gi}: {exc}") from exc
        finished[gi] = [] if group is None else list(group) if isinstance(group, list) else [group]

    async def on_result(i: int, result: Trajectory | BaseException) -> None:
        gi = owners[i]
        groups[gi].add_result(result)
        remaining[gi] -= 1
        if remaining[gi] == 0:
            await finish(gi)

    progress = _Progress(len(awaitables), pbar_desc, max_exceptions)
    for gi, n in enumerate(remaining):  # groups that were already complete
        if n == 0:
            await finish(gi)
    await _run_all(awaitables, progress, max_concurrency, on_result)
    return [g for gi in range(len(groups)) for g in finished[gi]]


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
) -> list[Trajectory]:
    """Run rollouts concurrently; return the successful trajectories in input order (failures within the
    budget are logged and skipped)."""
    awaitables = list(trajectories)
    results: dict[int, Trajectory] = {}

    def on_result(i: int, result: Trajectory | BaseException) -> None:
        if isinstance(result, BaseException):
            log.warning("rollout %d failed: %r", i, result)
        else:
            results[i] = result

    await _run_all(awaitables, _Progress(len(awaitables), pbar_desc, max_exceptions), max_concurrency, on_result)
    return [results[i] for i in sorted(results)]
