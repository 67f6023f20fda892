"""ART's ``art.utils`` helpers that training scripts import: ``iterate_dataset``, ``retry``, ``limit_concurrency``
(and ``flywheel.utils.litellm``, ART's ``art.utils.litellm``).

Same signatures, defaults and results as ART's: ``iterate_dataset`` shuffles each epoch with that epoch's number as
the seed (the same order as ART, without reseeding the global ``random``), ``retry`` retries with exponential
back-off, ``limit_concurrency`` bounds concurrent calls per key.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Generic, NamedTuple, ParamSpec, TypeVar

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")


class DatasetBatch(NamedTuple, Generic[T]):
    """One step's items. Read as ART's current ``batch.items`` / ``batch.step``..., or unpacked as its earlier
    tuple ``(items, epoch, step, epoch_step)``."""

    items: list[T]
    epoch: int
    step: int
    epoch_step: int


def iterate_dataset(
    dataset: Sequence[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
) -> Iterator[DatasetBatch[T]]:
    """``groups_per_step`` items at a time over ``num_epochs`` epochs, each epoch shuffled with its number as the
    seed; steps before ``initial_step`` are skipped (resuming), so a resumed run sees the batches it would have."""
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step must be at least 1, got {groups_per_step}")
    if not dataset:
        return
    steps_per_epoch = math.ceil(len(dataset) / groups_per_step)
    bar = (
        tqdm(initial=initial_step, total=steps_per_epoch * num_epochs, desc="Iterating dataset", unit="batch")
        if use_tqdm
        else None
    )
    try:
        for epoch in range(num_epochs):
            order = list(range(len(dataset)))
            random.Random(epoch).shuffle(order)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                start = epoch_step * groups_per_step
                yield DatasetBatch(
                    [dataset[i] for i in order[start : start + groups_per_step]], epoch, step, epoch_step
                )
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], None] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: call the function (sync or async) up to ``max_attempts`` times while it raises one of
    ``exceptions``, sleeping ``delay`` seconds, times ``backoff_factor`` after each failure; the last failure is
    raised. ``on_retry(exception, attempt)`` is called before each retry (default: a logged warning)."""

    def before_retry(func: Callable[..., Any], exception: BaseException, attempt: int) -> None:
        if on_retry is not None:
            on_retry(exception, attempt)
        else:
            logger.warning("Retry %d/%d for %s after error: %s", attempt, max_attempts, func.__name__, exception)

    def decorator(func: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                wait, attempt = delay, 1
                while True:
                    try:
                        return await func(*args, **kwargs)
                    except exceptions as exc:
                        if attempt >= max_attempts:
                            raise
                        before_retry(func, exc, attempt)
                    await asyncio.sleep(wait)
                    wait, attempt = wait * backoff_factor, attempt + 1

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def sync_wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            wait, attempt = delay, 1
            while True:
                try:
                    return func(*args, **kwargs)
                except exceptions as exc:
                    if attempt >= max_attempts:
                        raise
                    before_retry(func, exc, attempt)
                time.sleep(wait)
                wait, attempt = wait * backoff_factor, attempt + 1

        return sync_wrapper

    return decorator


def limit_concurrency(
    n: int, derive_key: Callable[..., str] | None = None
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Decorator for an async function: at most ``n`` calls run at once, per ``derive_key(*args, **kwargs)`` if
    given (e.g. one limit per judge model), else for all calls together."""
    if n < 1:
        raise ValueError(f"limit_concurrency needs n >= 1, got {n}")
    semaphores: dict[str, asyncio.Semaphore] = {}

    def decorator(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(func)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            key = derive_key(*args, **kwargs) if derive_key is not None else "default"
            async with semaphores.setdefault(key, asyncio.Semaphore(n)):
                return await func(*args, **kwargs)

        return wrapper

    return decorator


__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency", "retry"]
