"""A run's history: the rows of metrics of each training step and evaluation of a model, in the order they were written,
and the trajectories saved with a step (the trained ones, an evaluation's). ``flywheel.checkpoints.run.RunStore`` writes
them here and exports them to the model's ``history.jsonl`` and ``trajectories/<split>/<step>.jsonl``; what its crash
recovery keeps or drops, and the branches a restore gives up, are changed here.

A run is a ``RunKey``: the project, the model's name and the id its directory keeps, so that two machines training
one name into a shared store keep their rows apart. Rows stored before runs had ids have the run "" until their
directory adopts them (``adopt``).

Rows are JSON objects with at least ``step`` (0 when absent) and usually ``split`` and ``time``; they are stored
whole as JSON text, NaN and infinities included (a metric may be NaN; the file has always held them so).
Trajectories are stored as the JSON text they are exported as.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from flywheel.store.db import write_lock
from flywheel.store.schema import RunHistoryRow, RunTrajectory

HISTORY = RunHistoryRow.__table__
TRAJECTORIES = RunTrajectory.__table__
Row = dict[str, Any]
BEFORE_IDS = ""  # the run of rows stored before runs had ids


class RunKey(NamedTuple):
    """A run: a model's project and name, and the id its directory keeps (``flywheel.checkpoints.run.RunStore``)."""

    project: str
    model: str
    run: str


def _run(table: type[RunHistoryRow | RunTrajectory], key: RunKey):
    """The conditions that pick the run's rows in ``table`` (its live line and its branches)."""
    return table.project == key.project, table.model == key.model, table.run == key.run


def _line(table: type[RunHistoryRow | RunTrajectory], key: RunKey, branch: str | None = None):
    """The conditions that pick one line of the run in ``table``: its live line, or an abandoned ``branch``."""
    return *_run(table, key), table.branch.is_(None) if branch is None else table.branch == branch


def rows(s: Session, key: RunKey, *, branch: str | None = None) -> list[Row]:
    """The run's rows in order: its live line, or those of an abandoned ``branch``."""
    query = select(RunHistoryRow.row).where(*_line(RunHistoryRow, key, branch))
    return [json.loads(text) for text in s.scalars(query.order_by(RunHistoryRow.id))]


def has_rows(s: Session, key: RunKey) -> bool:
    """Whether the store holds any row of the run (its live line or a branch)."""
    query = select(RunHistoryRow.id).where(*_run(RunHistoryRow, key)).limit(1)
    return s.scalars(query).first() is not None


def add(s: Session, key: RunKey, new: list[Row]) -> None:
    """Append rows to the run's live line, in order (one insert)."""
    if not new:
        return
    write_lock(s)
    values = [
        {
            "project": key.project, "model": key.model, "run": key.run, "step": int(r.get("step", 0)),
            "split": r.get("split"), "time": r.get("time"), "row": json.dumps(r), "branch": None,
        }
        for r in new
    ]  # fmt: skip
    s.execute(insert(HISTORY), values)


def replace(s: Session, key: RunKey, kept: list[Row]) -> None:
    """Make the run's live line exactly ``kept`` (recovery after a crash: rows of steps being redone go)."""
    write_lock(s)
    s.execute(delete(RunHistoryRow).where(*_line(RunHistoryRow, key)))
    add(s, key, kept)


def abandon_above(s: Session, key: RunKey, step: int, branch: str) -> None:
    """Move the live rows and trajectories of steps above ``step`` to ``branch`` (training goes on from ``step``)."""
    write_lock(s)
    for table in (RunHistoryRow, RunTrajectory):
        s.execute(update(table).where(*_line(table, key), table.step > step).values(branch=branch))


def has_trajectories(s: Session, key: RunKey) -> bool:
    """Whether the store holds any trajectory of the run (its live line or a branch)."""
    query = select(RunTrajectory.id).where(*_run(RunTrajectory, key)).limit(1)
    return s.scalars(query).first() is not None


def add_trajectories(s: Session, key: RunKey, split: str, step: int, texts: list[str]) -> None:
    """Save trajectories (their JSON text) with a step of the run's live line, in order (one insert)."""
    if not texts:
        return
    write_lock(s)
    values = [
        {
            "project": key.project, "model": key.model, "run": key.run, "split": split, "step": step,
            "trajectory": text, "branch": None,
        }
        for text in texts
    ]  # fmt: skip
    s.execute(insert(TRAJECTORIES), values)


def trajectories(
    s: Session, key: RunKey, split: str, step: int | None = None, *, branch: str | None = None
) -> list[tuple[int, str]]:
    """``(step, JSON text)`` of the run's trajectories of ``split`` (of one ``step``), in the order saved."""
    query = select(RunTrajectory.step, RunTrajectory.trajectory).where(*_line(RunTrajectory, key, branch))
    query = query.where(RunTrajectory.split == split)
    if step is not None:
        query = query.where(RunTrajectory.step == step)
    return [(k, text) for k, text in s.execute(query.order_by(RunTrajectory.id))]


def trajectory_splits(s: Session, key: RunKey) -> list[str]:
    """The splits the run's live line saved trajectories with, sorted."""
    query = select(RunTrajectory.split).where(*_line(RunTrajectory, key)).distinct()
    return sorted(s.scalars(query))


def last_saved(s: Session, key: RunKey) -> tuple[str, int, int] | None:
    """The split and step of the live line's last saved trajectories, and how many that step of that split has:
    what a kill may have left the export without."""
    query = select(RunTrajectory.split, RunTrajectory.step).where(*_line(RunTrajectory, key))
    last = s.execute(query.order_by(RunTrajectory.id.desc()).limit(1)).first()
    if last is None:
        return None
    split, step = last
    count = select(func.count()).where(
        *_line(RunTrajectory, key), RunTrajectory.split == split, RunTrajectory.step == step
    )
    return split, step, s.scalar(count) or 0


def drop_trajectories_above(s: Session, key: RunKey, step: int) -> None:
    """Delete the live line's trajectories of steps above ``step`` (recovery: those steps are redone)."""
    write_lock(s)
    s.execute(delete(RunTrajectory).where(*_line(RunTrajectory, key), RunTrajectory.step > step))


def adopt(s: Session, key: RunKey) -> None:
    """Give the run the rows and trajectories of its project and model stored before runs had ids (its directory
    is from then: they are its own, unless another machine trained that name into this store too)."""
    write_lock(s)
    before = key._replace(run=BEFORE_IDS)
    for table in (RunHistoryRow, RunTrajectory):
        s.execute(update(table).where(*_run(table, before)).values(run=key.run))


class RunSummary(NamedTuple):
    """A run's live line at a glance: how many rows, its last step, the first and last rows' times."""

    key: RunKey
    rows: int
    last_step: int
    first_time: float | None
    last_time: float | None


def runs(s: Session) -> list[RunSummary]:
    """Every run with rows on its live line, the one written to last first."""
    query = (
        select(
            RunHistoryRow.project,
            RunHistoryRow.model,
            RunHistoryRow.run,
            func.count(),
            func.max(RunHistoryRow.step),
            func.min(RunHistoryRow.time),
            func.max(RunHistoryRow.time),
        )
        .where(RunHistoryRow.branch.is_(None))
        .group_by(RunHistoryRow.project, RunHistoryRow.model, RunHistoryRow.run)
        .order_by(func.max(RunHistoryRow.id).desc())
    )
    return [RunSummary(RunKey(p, m, r), n, last, first, latest) for p, m, r, n, last, first, latest in s.execute(query)]


def split_rows(s: Session, split: str) -> list[tuple[RunKey, Row]]:
    """The live rows of ``split`` of every run, each with its run, in order."""
    query = select(RunHistoryRow.project, RunHistoryRow.model, RunHistoryRow.run, RunHistoryRow.row).where(
        RunHistoryRow.branch.is_(None), RunHistoryRow.split == split
    )
    return [(RunKey(p, m, r), json.loads(text)) for p, m, r, text in s.execute(query.order_by(RunHistoryRow.id))]


def trajectory_counts(s: Session, key: RunKey) -> list[tuple[str, int, int]]:
    """``(split, step, how many)`` of the trajectories of the run's live line, by split and step."""
    query = (
        select(RunTrajectory.split, RunTrajectory.step, func.count())
        .where(*_line(RunTrajectory, key))
        .group_by(RunTrajectory.split, RunTrajectory.step)
        .order_by(RunTrajectory.split, RunTrajectory.step)
    )
    return [(split, step, n) for split, step, n in s.execute(query)]


def trajectory_page(
    s: Session, key: RunKey, split: str, step: int | None, *, limit: int | None = None, offset: int = 0
) -> list[tuple[int, int, str]]:
    """``(id, step, JSON text)`` of the live line's trajectories of ``split`` (of one ``step``) after the first
    ``offset`` (at most ``limit``), in the order saved; the id names one in ``trajectory``."""
    query = select(RunTrajectory.id, RunTrajectory.step, RunTrajectory.trajectory).where(
        *_line(RunTrajectory, key), RunTrajectory.split == split
    )
    if step is not None:
        query = query.where(RunTrajectory.step == step)
    query = query.order_by(RunTrajectory.id).limit(limit).offset(offset)
    return [(i, k, text) for i, k, text in s.execute(query)]


def trajectory(s: Session, trajectory_id: int) -> tuple[RunKey, str, int, str | None, str] | None:
    """One saved trajectory by id: its run, split, step, branch (None on the live line) and JSON text; None if no
    trajectory has that id."""
    row = s.get(RunTrajectory, trajectory_id)
    if row is None:
        return None
    return RunKey(row.project, row.model, row.run), row.split, row.step, row.branch, row.trajectory
