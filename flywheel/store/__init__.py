"""The store: one database for what Flywheel records, behind small repository functions per concept.

It owns the schema (SQLAlchemy 2 models in ``schema.py``), its migrations (Alembic, under ``migrations/``, applied
when a store opens) and the functions that read and write each concept (``episodes.py``: episodes and the calls
recorded in them; ``tasks.py``: the rollout queue's tasks and attempts; ``audit.py``: the hash-chained audit
trail; ``deployments.py``: aliases such as ``calc@production`` that point at checkpoints, switched with their
audit event). SQLite under ``FLYWHEEL_HOME`` is the embedded default (WAL: readers never wait for the writer);
``FLYWHEEL_DB=postgresql://...`` (or ``Store(url)``) puts it on a server that several machines share. It knows no
engine and no HTTP: the gateway and the loop write through it, a dashboard reads it.
"""

from flywheel.store.db import Store, default_url
from flywheel.store.episodes import (
    CallRecord,
    EpisodeConflictError,
    EpisodeRecord,
    EpisodeStatus,
    UnknownEpisodeError,
)

__all__ = [
    "CallRecord",
    "EpisodeConflictError",
    "EpisodeRecord",
    "EpisodeStatus",
    "Store",
    "UnknownEpisodeError",
    "default_url",
]
