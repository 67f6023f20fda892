"""The asynchronous pipeline: rollouts for the next ``async_steps`` steps run while a step trains.

A synchronous loop alternates: gather the groups of step ``i``, train on them, gather step ``i + 1``'s... and the
sampler idles while the trainer works, the trainer while the slowest rollout of the step finishes. A
``RolloutPipeline`` keeps the rollouts of iterations ``i + 1 .. i + async_steps`` running while the caller trains on
iteration ``i`` (ART's ``PipelineTrainer``, PipelineRL, AReaL), so each group is up to ``async_steps`` steps stale:
train with ``TrainConfig(max_staleness_steps=async_steps)``, which drops a group answered by older weights whole
and reports ``staleness_mean`` / ``staleness_max`` / ``stale_groups`` (``train/staleness.py``), and keep the truncated
importance ratio on (``importance_sampling_cap``, the default): it corrects for the older weights. ``async_steps=0``
is the synchronous loop exactly (iteration ``i + 1``'s rollouts start when the caller asks for them).

The caller keeps its loop and its data position::

    async with RolloutPipeline(rollouts, async_steps=1, start=start, stop=steps) as pipe:
        async for i, groups in pipe:  # rollouts(i)'s result: gathered while the earlier steps trained
            await model.train(groups, config=TrainConfig(max_staleness_steps=1), extra={"next": i + 1})

``rollouts(i)`` makes iteration ``i``'s groups (a ``gather_trajectory_groups`` call, say) from nothing but ``i`` and
the caller's own state: a run killed while iterations ``i + 1 ..`` were in flight restarts at the position its last
checkpoint kept (``checkpoint_extra()``), and their unfinished rollouts, lost with the process, train nowhere. On
the embedded engine a training step holds the engine, so only the rollouts' agent, tool and grading time and the
step's tail (the engine batching the next step's rollouts beside the last of this one's) overlap with training;
on vLLM servers (``VLLMBackend``) sampling goes on through the step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class RolloutPipeline(Generic[T]):
    """Iterations ``start .. stop - 1`` (``stop`` None: without end) of ``rollouts``, each yielded as
    ``(i, rollouts(i)'s result)`` in order, with the next ``async_steps`` iterations' already started. Leaving the
    ``async with`` block cancels the iterations still in flight; an exception of an iteration's rollouts is raised
    where that iteration is yielded."""

    def __init__(
        self, rollouts: Callable[[int], Awaitable[T]], *, async_steps: int = 1, start: int = 0, stop: int | None = None
    ):
        if async_steps < 0:
            raise ValueError(f"async_steps is {async_steps}: the iterations to run ahead, 0 or more")
        self.rollouts, self.async_steps, self.next, self.stop = rollouts, async_steps, start, stop
        self._running: dict[int, asyncio.Task[T]] = {}

    def _start(self, first: int, last: int) -> None:
        """Start the iterations ``first .. last`` (within ``stop``) not started yet."""
        for i in range(first, last + 1 if self.stop is None else min(last + 1, self.stop)):
            if i not in self._running:
                self._running[i] = asyncio.ensure_future(self.rollouts(i))

    @property
    def in_flight(self) -> list[int]:
        """The iterations started and not yet yielded."""
        return sorted(self._running)

    def __aiter__(self) -> RolloutPipeline[T]:
        return self

    async def __anext__(self) -> tuple[int, T]:
        i = self.next
        if self.stop is not None and i >= self.stop:
            raise StopAsyncIteration
        self._start(i, i)
        task = self._running[i]
        try:
            result = await task
        finally:
            if task.done():
                del self._running[i]
        self.next = i + 1
        self._start(i + 1, i + self.async_steps)  # running while the caller trains on iteration i
        return i, result

    async def aclose(self) -> None:
        """Cancel the iterations in flight and wait for them to end."""
        running, self._running = list(self._running.values()), {}
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    async def __aenter__(self) -> RolloutPipeline[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
