"""Deterministic tool-call caching: the same call gets the same answer, once computed.

Stabilising the environment (same tool answers across rollouts and steps) removes a source of reward noise that
has nothing to do with the policy, and saves the cost of slow or rate-limited tools. Calls are keyed by tool name
and the canonical JSON of the arguments (sorted keys), so ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}`` hit the same
entry. Only successful results are stored: an error or a timeout may not happen again. With a ``path`` the cache
persists in SQLite, so a later run replays exactly the answers an earlier one saw.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


def call_key(name: str, arguments: Any) -> str:
    return name + "\n" + json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def tool_call_key(call: Any) -> str:
    """The key of a tool call a model wrote: its name and canonical arguments (their raw text if not JSON)."""
    if call.type != "function":
        return call.model_dump_json()
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return call_key(call.function.name, arguments)


class ToolCache:
    def __init__(self, path: str | Path | None = None) -> None:
        self.hits = 0
        self.misses = 0
        self._memory: dict[str, str] = {}
        # Identical calls made at the same time (a group of rollouts of one scenario) run once.
        self._running: dict[str, asyncio.Future[str]] = {}
        self._db: sqlite3.Connection | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False)
            self._db.execute("CREATE TABLE IF NOT EXISTS tool_calls (key TEXT PRIMARY KEY, result TEXT NOT NULL)")
            self._db.commit()

    def get(self, name: str, arguments: dict[str, Any]) -> str | None:
        key = call_key(name, arguments)
        if key in self._memory:
            return self._memory[key]
        if self._db is not None:
            row = self._db.execute("SELECT result FROM tool_calls WHERE key = ?", (key,)).fetchone()
            if row is not None:
                self._memory[key] = row[0]
                return row[0]
        return None

    def put(self, name: str, arguments: dict[str, Any], result: str) -> None:
        key = call_key(name, arguments)
        self._memory[key] = result
        if self._db is not None:
            self._db.execute("INSERT OR REPLACE INTO tool_calls (key, result) VALUES (?, ?)", (key, result))
            self._db.commit()

    async def fetch(self, name: str, arguments: dict[str, Any], run: Callable[[], Awaitable[str]]) -> tuple[str, bool]:
        """The cached result of this call, or ``run()``'s (stored when it succeeds); and whether it was a hit."""
        cached = self.get(name, arguments)
        if cached is not None:
            self.hits += 1
            return cached, True
        key = call_key(name, arguments)
        if key in self._running:  # the same call is under way: share its result (or its error)
            self.hits += 1
            return await asyncio.shield(self._running[key]), True
        self.misses += 1
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._running[key] = future
        try:
            result = await run()
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the waiters were not cancelled: they get an error
                exc = RuntimeError(f"the identical call to {name!r} this one waited for was cancelled")
            future.set_exception(exc)
            future.exception()  # marks it retrieved: nobody else may be waiting for it
            raise
        finally:
            del self._running[key]
        future.set_result(result)
        self.put(name, arguments, result)
        return result, False

    def __len__(self) -> int:
        if self._db is not None:
            return int(self._db.execute("SELECT COUNT(*) FROM tool_calls").fetchone()[0])
        return len(self._memory)

    def stats(self) -> dict[str, float]:
        total = self.hits + self.misses
        return {
            "cache_hits": self.hits,
            "cache_misses": self.misses,
            "cache_hit_rate": self.hits / total if total else 0.0,
        }

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
