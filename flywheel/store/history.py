"""A run's history rows: the metrics of each training step and evaluation of a model, ``(project, model)``, in the
order they were written. ``flywheel.runs.RunStore`` writes them here and exports them to the model's
``history.jsonl``; what its crash recovery keeps or drops, and the branches a restore gives up, are changed here.

Rows are JSON objects with at least ``step`` (0 when absent) and usually ``split`` and ``time``; they are stored
whole as JSON text, NaN and infinities included (a metric may be NaN; the file has always held them so).
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session

from flywheel.store.db import write_lock
from flywheel.store.schema import RunHistoryRow

HISTORY = RunHistoryRow.__table__
Row = dict[str, Any]


def _live(project: str, model: str):
    return (RunHistoryRow.project == project, RunHistoryRow.model == model, RunHistoryRow.branch.is_(None))


def rows(s: Session, project: str, model: str, *, branch: str | None = None) -> list[Row]:
    """The run's rows in order: its live line, or those of an abandoned ``branch``."""
    query = select(RunHistoryRow.row).where(RunHistoryRow.project == project, RunHistoryRow.model == model)
    query = query.where(RunHistoryRow.branch.is_(None) if branch is None else RunHistoryRow.branch == branch)
    return [json.loads(text) for text in s.scalars(query.order_by(RunHistoryRow.id))]


def has_rows(s: Session, project: str, model: str) -> bool:
    """Whether the store holds any row of the run (its live line or a branch)."""
    query = select(RunHistoryRow.id).where(RunHistoryRow.project == project, RunHistoryRow.model == model).limit(1)
    return s.scalars(query).first() is not None


def add(s: Session, project: str, model: str, new: list[Row]) -> None:
    """Append rows to the run's live line, in order (one insert)."""
    if not new:
        return
    write_lock(s)
    values = [
        {
            "project": project, "model": model, "step": int(r.get("step", 0)), "split": r.get("split"),
            "time": r.get("time"), "row": json.dumps(r), "branch": None,
        }
        for r in new
    ]  # fmt: skip
    s.execute(insert(HISTORY), values)


def replace(s: Session, project: str, model: str, kept: list[Row]) -> None:
    """Make the run's live line exactly ``kept`` (recovery after a crash: rows of steps being redone go)."""
    write_lock(s)
    s.execute(delete(RunHistoryRow).where(*_live(project, model)))
    add(s, project, model, kept)


def abandon_above(s: Session, project: str, model: str, step: int, branch: str) -> int:
    """Move the live rows of steps above ``step`` to ``branch`` (training goes on from ``step``); how many."""
    write_lock(s)
    query = update(RunHistoryRow).where(*_live(project, model), RunHistoryRow.step > step).values(branch=branch)
    return s.execute(query).rowcount
