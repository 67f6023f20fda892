"""Run many rollouts concurrently, with a progress bar, a concurrency limit and a budget for failures."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any

from openai.types.chat.chat_completion import Choice
from tqdm.auto import tqdm

from flywheel.types import Trajectory, TrajectoryGroup, completion_token_count

logger = logging.getLogger(__name__)

AfterEachResult = TrajectoryGroup | list[TrajectoryGroup] | None
AfterEach = Callable[[TrajectoryGroup], AfterEachResult | Awaitable[AfterEachResult]]
RolloutResult = Trajectory | list[Trajectory]

MAX_METRICS_SHOWN = 4  # the progress bar has one line; a few metric means fit on it next to the reward


def _where(exception: Exception) -> str:
    """`` calling <url>`` for an error of a request (the openai SDK's and httpx's errors keep it): a connection error
    then names the service it could not reach."""
    with contextlib.suppress(RuntimeError):  # httpx's .request raises when the error has none
        request = getattr(exception, "request", None)
        if request is not None and getattr(request, "url", None):
            return f" calling {request.method} {request.url}"
    return ""


def _name_the_service(exception: Exception) -> None:
    """Notes on ``exception`` the service its request called (``_where``), once: a rollout's error that ends a
    gather then says in its own traceback which service failed, not only "Connection error."."""
    where = _where(exception)
    note = f"the rollout failed{where}"
    if where and note not in getattr(exception, "__notes__", []):
        exception.add_note(note)


def _close_unstarted(awaitables: Iterable[Awaitable[Any]]) -> None:
    """Closes the coroutines among these that never ran (no "was never awaited" warning) and cancels futures."""
    for awaitable in awaitables:
        if inspect.iscoroutine(awaitable):
            awaitable.close()
        elif isinstance(awaitable, asyncio.Future):
            awaitable.cancel()


class _Gathering:
    """The state of one gather call: every task it started, the progress bar and the exception budget."""

    def __init__(
        self,
        items: list[TrajectoryGroup | Awaitable[TrajectoryGroup]],
        *,
        pbar_desc: str | None,
        max_exceptions: int | float,
        max_concurrency: int | None,
        after_each: AfterEach | None,
        max_metrics: int | None = MAX_METRICS_SHOWN,
        pbar_total_completion_tokens: bool = False,
    ) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1 (or None for no limit), got {max_concurrency}")
        self.items = items
        self.after_each = after_each
        self.max_exceptions = max_exceptions
        self.slots: contextlib.AbstractAsyncContextManager[Any] = (
            asyncio.Semaphore(max_concurrency) if max_concurrency is not None else contextlib.nullcontext()
        )
        self.tasks: list[asyncio.Task[Any]] = []
        # Everything this call may await, so that whatever it never got to can be closed if it stops early.
        self.awaitables: list[Awaitable[Any]] = []
        for item in items:
            self.awaitables += item._pending if isinstance(item, TrajectoryGroup) else [item]
        self.total = sum(len(item._pending) for item in items if isinstance(item, TrajectoryGroup))
        self.exceptions = 0
        self.reward_sum = 0.0
        self.finished = 0
        self.metric_totals: dict[str, tuple[float, int]] = {}  # key -> (sum, count), for running means
        self.max_metrics = max_metrics
        self.completion_tokens: int | None = 0 if pbar_total_completion_tokens else None
        self.bar = tqdm(total=self.total, desc=pbar_desc, disable=pbar_desc is None)

    async def run(self) -> list[list[TrajectoryGroup]]:
        """The groups each input item became (after ``after_each``), in input order."""
        return await self.run_all(self.group(i, item) for i, item in enumerate(self.items))

    async def run_all(self, coroutines: Iterable[Coroutine[Any, Any, Any]]) -> list[Any]:
        """Runs these as tasks of this call; on the first error, stops and closes everything else it started."""
        try:
            return await asyncio.gather(*(self.spawn(coroutine) for coroutine in coroutines))
        except BaseException:
            # Stop what is still running and wait until it has stopped, so that nothing outlives this call
            # (no "Task was destroyed but it is pending"), then close the rollouts that never started.
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            _close_unstarted(self.awaitables)
            raise
        finally:
            self.bar.close()

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine)
        self.tasks.append(task)
        return task

    async def group(self, index: int, item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> list[TrajectoryGroup]:
        """Finishes one group: resolves it, runs its pending rollouts, then applies ``after_each``."""
        start = time.monotonic()
        group = item if isinstance(item, TrajectoryGroup) else await self.resolve(item)
        if group._pending:
            results = await asyncio.gather(*(self.spawn(self.rollout(r)) for r in group._pending))
            group._complete(results)
        rolled = time.monotonic()
        if self.after_each is None:
            group._timing = (start, rolled, rolled)
            return [group]
        try:
            kept = self.after_each(group)
            if inspect.isawaitable(kept):
                kept = await kept
        except Exception as exc:
            raise RuntimeError(f"after_each failed on group {index}: {exc!r}") from exc
        groups = [] if kept is None else kept if isinstance(kept, list) else [kept]
        for g in groups:
            g._timing = (start, rolled, time.monotonic())
        return groups

    async def resolve(self, awaitable: Awaitable[TrajectoryGroup]) -> TrajectoryGroup:
        """Awaits something that makes a group. Its rollouts count once known; if it fails, it counts as one
        failed rollout and becomes an empty group recording the error, so the output stays aligned with the input."""
        try:
            group = await awaitable
        except Exception as exc:
            self.add_to_total(1)
            self.count_exception(exc)
            return TrajectoryGroup([exc])
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"expected an awaitable of TrajectoryGroup, got one of {type(group).__name__}")
        if group._pending:
            self.awaitables += group._pending
            self.add_to_total(len(group._pending))
        else:  # it ran its rollouts itself
            self.add_to_total(len(group))
            for trajectory in group.trajectories:
                self.count_trajectory(trajectory)
        return group

    async def rollout(self, awaitable: Awaitable[RolloutResult]) -> RolloutResult | Exception:
        """Runs one rollout within the concurrency limit; returns its exception while the budget allows. A rollout
        may make one trajectory or a list of them (anything else is refused by its caller)."""
        try:
            async with self.slots:
                result = await awaitable
        except Exception as exc:
            self.count_exception(exc)
            return exc
        made = [result] if isinstance(result, Trajectory) else result if isinstance(result, list) else []
        for trajectory in made:
            if isinstance(trajectory, Trajectory):
                self.record(trajectory)
        self.advance()
        return result

    def add_to_total(self, n: int) -> None:
        self.total += n
        self.bar.total = self.total
        self.bar.refresh()

    def count_exception(self, exception: Exception) -> None:
        """Records a failed rollout; re-raises it (with its own traceback) once the budget is exceeded."""
        self.exceptions += 1
        allowed = self.max_exceptions * self.total if 0 < self.max_exceptions < 1 else self.max_exceptions
        if self.exceptions > allowed:
            _name_the_service(exception)
            raise exception
        logger.warning(
            "rollout failed (%d exceptions, %g allowed): %r%s", self.exceptions, allowed, exception, _where(exception)
        )
        self.advance()

    def count_trajectory(self, trajectory: Trajectory) -> None:
        self.record(trajectory)
        self.advance()

    def record(self, trajectory: Trajectory) -> None:
        """Adds a finished trajectory to the running means shown on the bar."""
        self.finished += 1
        self.reward_sum += trajectory.reward
        for key, value in trajectory.metrics.items():
            if key in self.metric_totals or self.max_metrics is None or len(self.metric_totals) < self.max_metrics:
                total, count = self.metric_totals.get(key, (0.0, 0))
                self.metric_totals[key] = (total + float(value), count + 1)
        if self.completion_tokens is not None:
            self.completion_tokens += sum(
                completion_token_count(item) for item in trajectory.messages_and_choices if isinstance(item, Choice)
            )

    def advance(self) -> None:
        postfix: dict[str, float | int] = {}
        if self.finished:
            postfix["reward"] = self.reward_sum / self.finished
            postfix.update({key: total / count for key, (total, count) in self.metric_totals.items()})
        if self.completion_tokens is not None:
            postfix["completion_tokens"] = self.completion_tokens
        postfix["exceptions"] = self.exceptions
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
    after_each: AfterEach | None = None,
    max_metrics: int | None = MAX_METRICS_SHOWN,
    pbar_total_completion_tokens: bool = True,
) -> list[TrajectoryGroup]:
    """Runs the rollouts of all groups concurrently and returns the finished groups in input order.

    - ``max_concurrency``: at most this many rollouts in flight at once (None: no limit).
    - ``max_exceptions``: how many rollouts may fail, as a count or, below 1, a fraction of all rollouts (those of
      groups still being made by an awaitable count once it returns them). A failure
      within it is recorded on its group (which keeps one trajectory fewer); the first one beyond it cancels
      everything still running and is re-raised, traceback intact. Exceptions already recorded on groups passed
      in are kept but not counted.
    - ``after_each(group)``, sync or async, runs as each group finishes and returns the group, None (drop it)
      or a list of groups (kept in its place). If it raises, a RuntimeError naming the group's index is raised.
    - ``pbar_desc``: the progress bar's label; None hides it. ``max_metrics``: how many trajectory metrics' means
      it shows next to the reward (None: all); ``pbar_total_completion_tokens``: it also shows the tokens sampled.
    - A rollout may return a list of trajectories (e.g. one per agent of a game): they all join its group.
    """
    gathering = _Gathering(
        list(groups),
        pbar_desc=pbar_desc,
        max_exceptions=max_exceptions,
        max_concurrency=max_concurrency,
        after_each=after_each,
        max_metrics=max_metrics,
        pbar_total_completion_tokens=pbar_total_completion_tokens,
    )
    return [group for kept in await gathering.run() for group in kept]


async def gather_trajectories(
    trajectories: Iterable[Awaitable[RolloutResult]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = True,
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
) -> list[RolloutResult | BaseException]:
    """Runs rollouts concurrently and returns, in input order, what each one returned (a trajectory, or a list of
    them) or, as ART does, the exception it raised, in its place, while ``max_exceptions`` allows (with the
    default 0 the first failure cancels the rest and is raised). Options as in ``gather_trajectory_groups``."""
    awaitables = list(trajectories)
    gathering = _Gathering(
        [],
        pbar_desc=pbar_desc,
        max_exceptions=max_exceptions,
        max_concurrency=max_concurrency,
        after_each=None,
        pbar_total_completion_tokens=pbar_total_completion_tokens,
    )
    gathering.awaitables += awaitables
    gathering.add_to_total(len(awaitables))
    results = await gathering.run_all(gathering.rollout(awaitable) for awaitable in awaitables)
    for result in results:
        made = result if isinstance(result, list) else [result]
        if not all(isinstance(item, Trajectory | BaseException) for item in made):
            raise TypeError(f"a rollout returned {type(result).__name__}, expected a Trajectory or a list of them")
    return results


@dataclasses.dataclass
class GatherContext:
    """ART's ``art.gather`` internals, for scripts that write a gather of their own (ART's self-play example
    gathers rollouts that each return a tuple of trajectories, then groups them by position): inside
    ``set_gather_context(context)``, each ``wrap_group_awaitable(rollout)`` counts its trajectories' rewards and
    metrics on ``pbar`` (set it before awaiting, as ART's scripts do) and its failure against ``max_exceptions``."""

    pbar: Any = None  # a tqdm bar, or None
    pbar_total_completion_tokens: bool = False
    max_exceptions: int | float = 0
    max_metrics: int | None = None
    increment_pbar: bool = True
    metric_sums: dict[str, float] = dataclasses.field(default_factory=dict)
    metric_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    exceptions: int = 0

    def record(self, trajectory: Trajectory) -> None:
        values = {"reward": trajectory.reward, **trajectory.metrics}
        if self.pbar_total_completion_tokens:
            values["completion_tokens"] = sum(
                completion_token_count(c) for c in trajectory.messages_and_choices if isinstance(c, Choice)
            )
        for key, value in values.items():
            self.metric_sums[key] = self.metric_sums.get(key, 0.0) + value
            self.metric_counts[key] = self.metric_counts.get(key, 0) + 1

    def update_pbar(self, n: int) -> None:
        if self.pbar is None:
            return
        if self.increment_pbar:
            self.pbar.update(n)
        keys = list(self.metric_sums)[: self.max_metrics]
        postfix: dict[str, float] = {key: self.metric_sums[key] / self.metric_counts[key] for key in keys}
        self.pbar.set_postfix({**postfix, "exceptions": self.exceptions})

    def too_many_exceptions(self) -> bool:
        """Over the budget: a count, or below 1 a fraction of the bar's total."""
        if 0 < self.max_exceptions < 1 and self.pbar is not None and self.pbar.total:
            return self.exceptions / self.pbar.total > self.max_exceptions
        return self.exceptions > self.max_exceptions


_gather_context: contextvars.ContextVar[GatherContext | None] = contextvars.ContextVar("gather_context", default=None)


@contextlib.contextmanager
def set_gather_context(context: GatherContext) -> Iterator[None]:
    """``context`` is the one ``wrap_group_awaitable`` counts on, inside the block (and the tasks it starts)."""
    token = _gather_context.set(context)
    try:
        yield
    finally:
        _gather_context.reset(token)


async def wrap_group_awaitable(awaitable: Awaitable[Iterable[Trajectory]]) -> Any:
    """Awaits a rollout that returns trajectories (a group, a list or a tuple of them) and counts them on the
    current ``GatherContext``; a failure is counted too, and returns None while its budget allows (else raised)."""
    context = _gather_context.get()
    if context is None:
        raise RuntimeError("wrap_group_awaitable is used inside `with set_gather_context(GatherContext(...)):`")
    try:
        result = await awaitable
    except Exception as exc:
        context.exceptions += 1
        context.update_pbar(0)
        if context.too_many_exceptions():
            _name_the_service(exc)
            raise
        logger.warning("rollout failed (%d exceptions): %r%s", context.exceptions, exc, _where(exc))
        return None
    trajectories = list(result)
    for trajectory in trajectories:
        context.record(trajectory)
    context.update_pbar(len(trajectories))
    return result


class _Batching:
    """The tasks of one ``trajectory_group_batches`` call, and the progress bar and exception budget of the batch
    being filled (a new ``GatherContext`` per batch)."""

    def __init__(
        self, batch_size: int, max_exceptions: int | float, pbar_desc: str | None, pbar_total_completion_tokens: bool
    ) -> None:
        self.batch_size = batch_size
        self.allowed = max_exceptions * batch_size if 0 < max_exceptions < 1 else max_exceptions
        self.pbar_desc = pbar_desc
        self.pbar_total_completion_tokens = pbar_total_completion_tokens
        self.tasks: set[asyncio.Task[Any]] = set()
        self.context = self.new_context()

    def new_context(self) -> GatherContext:
        bar = None if self.pbar_desc is None else tqdm(desc=self.pbar_desc, total=self.batch_size)
        return GatherContext(
            pbar=bar, pbar_total_completion_tokens=self.pbar_total_completion_tokens, max_metrics=MAX_METRICS_SHOWN
        )

    def next_batch(self) -> None:
        self.close_bar()
        self.context = self.new_context()

    def close_bar(self) -> None:
        if self.context.pbar is not None:
            self.context.pbar.close()

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def stop(self) -> None:
        """Cancels whatever still runs and waits until it has stopped."""
        running = list(self.tasks)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self.close_bar()

    def failed(self, exception: Exception) -> None:
        """Counts a failure against the batch's budget; re-raises it once the budget is exceeded."""
        self.context.exceptions += 1
        self.context.update_pbar(0)
        if self.context.exceptions > self.allowed:
            _name_the_service(exception)
            raise exception
        logger.warning(
            "rollout failed (%d exceptions in this batch, %g allowed): %r%s",
            self.context.exceptions,
            self.allowed,
            exception,
            _where(exception),
        )

    async def group(self, item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> TrajectoryGroup | None:
        """The finished group (its failed rollouts recorded on it), or None if making it failed within budget."""
        try:
            group = item if isinstance(item, TrajectoryGroup) else await item
        except Exception as exc:
            self.failed(exc)
            return None
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"expected an awaitable of TrajectoryGroup, got one of {type(group).__name__}")
        if group._pending:
            group._complete(await asyncio.gather(*(self.spawn(self.rollout(r)) for r in group._pending)))
        for trajectory in group.trajectories:
            self.context.record(trajectory)
        self.context.update_pbar(1)
        return group

    async def rollout(self, awaitable: Awaitable[RolloutResult]) -> RolloutResult | Exception:
        try:
            return await awaitable
        except Exception as exc:
            self.failed(exc)
            return exc


async def trajectory_group_batches(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
    pbar_desc: str | None = "batches",
    pbar_total_completion_tokens: bool = True,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """ART's ``art.trajectory_group_batches``: runs the groups with at most ``batch_size * max_concurrent_batches``
    of them in flight and yields them in lists of ``batch_size``, in the order they finish (the last list may be
    shorter); the groups keep running while the caller trains on a batch.

    - ``skip_batches``: the first ``batch_size * skip_batches`` groups are not run (a resumed run).
    - ``max_batch_exceptions``: how many rollouts may fail per batch, as a count or, below 1, a fraction of
      ``batch_size``. A failed rollout within it is recorded on its group; a group whose awaitable fails is left
      out. The first failure beyond it stops everything still running and is raised, traceback intact.
    - ``pbar_desc``: each batch's progress bar (None: none), with ``pbar_total_completion_tokens`` as in
      ``gather_trajectory_groups``.
    """
    if batch_size < 1 or max_concurrent_batches < 1 or skip_batches < 0:
        raise ValueError(
            "trajectory_group_batches needs batch_size >= 1, max_concurrent_batches >= 1 and skip_batches >= 0, got "
            f"batch_size={batch_size}, max_concurrent_batches={max_concurrent_batches}, skip_batches={skip_batches}"
        )
    items = list(groups)
    skipped, unstarted = items[: batch_size * skip_batches], items[batch_size * skip_batches :]
    batching = _Batching(batch_size, max_batch_exceptions, pbar_desc, pbar_total_completion_tokens)
    pending: set[asyncio.Task[TrajectoryGroup | None]] = set()
    batch: list[TrajectoryGroup] = []
    try:
        while unstarted or pending:
            while unstarted and len(pending) < batch_size * max_concurrent_batches:
                pending.add(batching.spawn(batching.group(unstarted.pop(0))))
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            batch += [group for task in done if (group := task.result()) is not None]
            if len(batch) >= batch_size:
                if unstarted or pending:  # what finishes while the caller trains counts for the next batch
                    batching.next_batch()
                yield batch[:batch_size]
                batch = batch[batch_size:]
        if batch:
            yield batch
    finally:  # also when the caller stops early: nothing outlives the iteration, nothing is left unawaited
        await batching.stop()
        _close_unstarted(
            awaitable
            for item in skipped + unstarted
            for awaitable in (item._pending if isinstance(item, TrajectoryGroup) else [item])
        )


def phase_seconds(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """Wall time the gathering of these groups spent rolling out and scoring (``after_each``): the length of the
    union of each phase's intervals over the groups, since groups run concurrently. Empty if none was gathered."""
    timings = [g._timing for g in groups if g._timing is not None]
    if not timings:
        return {}
    return {
        "rollout_seconds": _covered([(t[0], t[1]) for t in timings]),
        "score_seconds": _covered([(t[1], t[2]) for t in timings]),
    }


def _covered(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total
