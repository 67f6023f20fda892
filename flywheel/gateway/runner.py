"""A runner: claims attempts from a gateway's rollout queue, runs an agent against each attempt's episode URL, and
posts its reward. Light (httpx; no torch): it runs wherever the agent does.

Usage::

    async def agent(task: dict, base_url: str) -> float:  # or {"reward": r, "metrics": {...}}
        client = AsyncOpenAI(base_url=base_url, api_key="-")  # every call is recorded in the attempt's episode
        ...
        return reward

    await Runner("http://trainer:8000", agent, concurrency=8).run()

or ``flywheel runner --url http://trainer:8000 --agent my_module:agent --concurrency 8``. Inside the agent,
``current_lease()`` is the attempt it runs (``.model``: the name the task says to call; ``.episode_id``, ``.tries``).

While the agent runs, the runner renews the lease every third of it. An exception in the agent fails the attempt
with the exception's text (the queue requeues it, one try counted). A lease that is lost (it expired and the attempt
went back to the queue) cancels the agent: its result would be refused. Stopping the runner (cancelling ``run``)
gives its attempts back at once, as failures, rather than when their leases expire.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpx

from flywheel.gateway.client import GatewayError, Lease, QueueClient

log = logging.getLogger("flywheel.runner")

Agent = Callable[[dict[str, Any], str], Awaitable[float | dict[str, Any]]]
_lease: ContextVar[Lease] = ContextVar("flywheel_runner_lease")


def current_lease() -> Lease:
    """The attempt the calling agent runs (a ``LookupError`` outside a runner's agent)."""
    try:
        return _lease.get()
    except LookupError:
        raise LookupError("current_lease() is only known inside an agent that a Runner runs") from None


@dataclass
class RunnerStats:
    claimed: int = 0
    completed: int = 0
    failed: int = 0  # the agent raised (or returned no reward): given back
    lost: int = 0  # the lease ended first: the result was not taken


def load_agent(spec: str) -> Agent:
    """``module:function`` -> the function (a ``ValueError`` that says what is wrong)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"--agent {spec!r}: expected module:function, e.g. my_agents:solve")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--agent {spec!r}: cannot import {module_name!r}: {exc}") from exc
    agent = getattr(module, name, None)
    if not callable(agent):
        raise ValueError(f"--agent {spec!r}: module {module_name!r} has no function {name!r}")
    return agent


def _outcome(value: Any) -> tuple[float, dict[str, Any]]:
    """The agent's answer as (reward, metrics)."""
    reward, metrics = (value.get("reward"), value.get("metrics") or {}) if isinstance(value, dict) else (value, {})
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise TypeError(
            f"the agent returned {value!r}: expected a finite reward, or {{'reward': r, 'metrics': {{...}}}}"
        )
    return float(reward), metrics


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


class Runner:
    """Runs ``agent`` on the queue of the gateway at ``url``, ``concurrency`` attempts at a time."""

    def __init__(
        self,
        url: str,
        agent: Agent,
        *,
        runner_id: str | None = None,
        lease_seconds: float = 60.0,
        concurrency: int = 1,
        poll_interval: float = 1.0,
        api_key: str | None = None,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency was {concurrency}; a runner runs at least 1 attempt at a time")
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds was {lease_seconds}; a lease lasts a positive number of seconds")
        self.url, self.agent, self.api_key = url, agent, api_key
        self.runner_id = runner_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.lease_seconds, self.concurrency, self.poll_interval = lease_seconds, concurrency, poll_interval
        self.stats = RunnerStats()

    async def run(self, *, max_attempts: int | None = None) -> RunnerStats:
        """Claim and run attempts until ``max_attempts`` have been claimed (by default, until cancelled). An empty
        queue, or a server out of reach, is waited for (``poll_interval``); a request the server refuses (a wrong
        key, say) ends the run with its ``GatewayError``."""
        reserved = 0

        async def worker(queue: QueueClient) -> None:
            nonlocal reserved
            while max_attempts is None or reserved < max_attempts:
                reserved += 1  # this worker's claim, counted before it is made: others see it at once
                try:
                    lease = await queue.claim(self.runner_id, lease_seconds=self.lease_seconds)
                except (httpx.TransportError, GatewayError) as exc:
                    if isinstance(exc, GatewayError) and exc.status < 500:
                        raise
                    log.warning("claim failed (%s); retrying in %g s", _describe(exc), self.poll_interval)
                    lease = None
                if lease is None:
                    reserved -= 1
                    await asyncio.sleep(self.poll_interval)
                    continue
                self.stats.claimed += 1
                await self._run_attempt(queue, lease)

        async with QueueClient(self.url, api_key=self.api_key) as queue:
            try:
                async with asyncio.TaskGroup() as workers:  # one worker's error stops the others
                    for _ in range(self.concurrency):
                        workers.create_task(worker(queue))
            except ExceptionGroup as errors:
                raise errors.exceptions[0] from None
        return self.stats

    async def _run_attempt(self, queue: QueueClient, lease: Lease) -> None:
        log.info(
            "attempt %s of task %s (try %d): episode %s", lease.id, lease.task_id, lease.tries + 1, lease.episode_id
        )
        lost = asyncio.Event()
        agent = asyncio.create_task(self._agent(lease))
        beat = asyncio.create_task(self._heartbeat(queue, lease, agent, lost))
        try:
            reward, metrics = _outcome(await agent)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]  # the runner is stopping
                agent.cancel()
                await self._give_back(queue, lease, "the runner stopped")  # requeued now, not at the lease's end
                raise
            if lost.is_set():
                self.stats.lost += 1
            else:
                await self._give_back(queue, lease, "the agent was cancelled")
            return
        except Exception as exc:
            log.warning("attempt %s: the agent failed: %s", lease.id, _describe(exc))
            await self._give_back(queue, lease, _describe(exc))
            return
        finally:
            beat.cancel()
        try:
            await queue.complete(lease.id, lease.episode_id, reward, metrics=metrics)
        except GatewayError as exc:
            if exc.status == 409:
                self.stats.lost += 1
                log.warning("attempt %s: result refused: %s", lease.id, exc)
            else:  # the result itself is refused (metrics that are not numbers, say): give the attempt back
                await self._give_back(queue, lease, f"result refused: {exc}")
            return
        except httpx.TransportError as exc:  # its lease will expire and the attempt be requeued
            self.stats.lost += 1
            log.warning("attempt %s: result not delivered: %s", lease.id, _describe(exc))
            return
        self.stats.completed += 1
        log.info("attempt %s: reward %g", lease.id, reward)

    async def _agent(self, lease: Lease) -> float | dict[str, Any]:
        _lease.set(lease)  # in the agent's task's own context
        return await self.agent(lease.payload, lease.base_url)

    async def _heartbeat(self, queue: QueueClient, lease: Lease, agent: asyncio.Task, lost: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                await queue.heartbeat(lease.id, lease.episode_id)
            except GatewayError as exc:
                if exc.status in (404, 409):  # the lease is over: the attempt is someone else's now
                    log.warning("attempt %s: lease lost (%s); stopping its agent", lease.id, exc)
                    lost.set()
                    agent.cancel()
                    return
                log.warning("attempt %s: heartbeat refused (%s)", lease.id, exc)
            except httpx.TransportError as exc:
                log.warning("attempt %s: heartbeat not delivered (%s)", lease.id, _describe(exc))

    async def _give_back(self, queue: QueueClient, lease: Lease, reason: str) -> None:
        self.stats.failed += 1
        try:
            async with asyncio.timeout(10):
                await queue.fail(lease.id, lease.episode_id, reason)
        except (GatewayError, httpx.TransportError, TimeoutError) as exc:  # its lease will expire instead
            log.warning("attempt %s: could not give it back (%s)", lease.id, _describe(exc))
