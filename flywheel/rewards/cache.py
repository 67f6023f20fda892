"""A disk cache of judge responses, so that re-judging the same trajectories costs no judge call.

Entries live in one SQLite file in WAL mode (readers never block the writer; concurrent writers from several
threads or processes wait on SQLite's lock instead of corrupting anything). Each process keeps one connection per
file, shared by its threads under a lock: SQLite answers "database is locked" at once, without waiting, when
connections race to set up a new file or when one opens while the last one closes, so connections are not
opened per request. The key is a SHA-256 of everything
that determines the judge's answer: the judge model, the full request (which contains the rubric and the
trajectories), the response schema and the sampling parameters. Only responses that passed validation are stored.

Location: the ``cache`` argument of ``ruler``/``ruler_score_group`` (a directory, a ``JudgeCache``, or False to
disable), else ``$FLYWHEEL_JUDGE_CACHE``, else ``$FLYWHEEL_HOME/judge-cache`` (``./.flywheel/judge-cache``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

CACHE_ENV = "FLYWHEEL_JUDGE_CACHE"
_FILE = "judge-responses.sqlite3"
_BUSY_TIMEOUT_S = 60.0  # how long a writer waits for another one before SQLite gives up


def default_cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    # same rule as LocalBackend's project directory, without importing the engine
    return Path(os.environ.get("FLYWHEEL_HOME") or ".flywheel") / "judge-cache"


class JudgeCache:
    """Judge responses on disk, keyed by ``JudgeCache.key(...)``; safe to share between processes."""

    def __init__(self, directory: str | Path | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.path = self.directory / _FILE

    @staticmethod
    def key(**parts: Any) -> str:
        """A stable hash of JSON-serialisable parts (dict order does not matter)."""
        canonical = json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def _execute(self, sql: str, parameters: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with _LOCK:
            return _connection(self.path).execute(sql, parameters).fetchall()

    def get_sync(self, key: str) -> str | None:
        rows = self._execute("SELECT response FROM responses WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def put_sync(self, key: str, response: str, *, model: str) -> None:
        self._execute(
            "INSERT OR REPLACE INTO responses (key, model, response, created) VALUES (?, ?, ?, ?)",
            (key, model, response, time.time()),
        )

    async def get(self, key: str) -> str | None:
        # off the event loop: a lookup may wait on another process's write lock
        return await asyncio.to_thread(self.get_sync, key)

    async def put(self, key: str, response: str, *, model: str) -> None:
        await asyncio.to_thread(self.put_sync, key, response, model=model)

    def __len__(self) -> int:
        return int(self._execute("SELECT COUNT(*) FROM responses")[0][0])

    def __repr__(self) -> str:
        return f"JudgeCache({str(self.directory)!r})"


_LOCK = threading.Lock()
_CONNECTIONS: dict[tuple[int, Path], sqlite3.Connection] = {}  # keyed by pid too: a forked child opens its own


def _connection(path: Path) -> sqlite3.Connection:
    """This process's connection to ``path`` (call with ``_LOCK`` held), opened and set up on first use."""
    key = (os.getpid(), path.resolve())
    if key not in _CONNECTIONS:
        path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        for attempt in range(50):  # another process setting up the same new file: a short wait, then again
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                connection.execute(
                    "CREATE TABLE IF NOT EXISTS responses "
                    "(key TEXT PRIMARY KEY, model TEXT NOT NULL, response TEXT NOT NULL, created REAL NOT NULL)"
                )
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or attempt == 49:
                    connection.close()
                    raise
                time.sleep(0.02 * (attempt + 1))
        _CONNECTIONS[key] = connection
    return _CONNECTIONS[key]


def resolve_cache(cache: JudgeCache | str | Path | bool | None) -> JudgeCache | None:
    """``True``/``None``: the default location; ``False``: no cache; a path: a cache there."""
    if cache is False:
        return None
    if cache is None or cache is True:
        return JudgeCache()
    return cache if isinstance(cache, JudgeCache) else JudgeCache(cache)
