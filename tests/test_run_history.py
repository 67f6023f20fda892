"""A run's history rows live in the store (flywheel/store/history.py), on SQLite and PostgreSQL; ``history.jsonl``
is their export. No model: checkpoints are one small tensor (the format does not care how big the weights are)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flywheel.runs import HISTORY, Checkpoint, CheckpointState, RunStore, model_path
from flywheel.store import Store
from flywheel.store import history as history_db
from flywheel.train.config import TrainedWeights


def tiny(step: int, rows: list[dict]) -> Checkpoint:
    return Checkpoint(
        state=CheckpointState(step=step, trained_weights=TrainedWeights(), rows=rows),
        weights={"w": torch.full((2,), float(step))},
    )


def row(step: int, split: str = "train", **metrics) -> dict:
    return {"time": float(step), "step": step, "split": split, **metrics}


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def stored(store: Store, project: str, model: str, branch: str | None = None) -> list[dict]:
    with store.session() as s:
        return history_db.rows(s, project, model, branch=branch)


def exported(run: RunStore) -> list[dict]:
    return [json.loads(line) for line in (run.path / HISTORY).read_text().splitlines()]


def test_history_rows_are_the_stores_and_the_file_is_their_export(store: Store, db_url: str, tmp_path):
    run = RunStore(model_path(tmp_path, "p", "m"), db=db_url)
    r1, r2, r3 = row(1), row(2), row(3)
    val = row(1, "val", **{"val/reward": float("nan")})  # a NaN metric is kept, as the file always kept it
    run.write(tiny(1, [r1]))
    run.append([val])
    run.write(tiny(2, [r2]))
    run.write(tiny(3, [r3]))
    rows = stored(store, "p", "m")
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (1, "val"), (2, "train"), (3, "train")]
    assert math.isnan(rows[1]["val/reward"]) and exported(run)[1]["step"] == 1 and len(exported(run)) == 4
    (run.path / HISTORY).unlink()  # the export is gone: the rows are not
    assert [r["step"] for r in run.history()] == [1, 1, 2, 3]
    run.recover()  # and it is written again
    assert [(r["step"], r["split"]) for r in exported(run)] == [(1, "train"), (1, "val"), (2, "train"), (3, "train")]
    (run.path / HISTORY).write_text(json.dumps(r1) + "\n")  # killed between the store's commit and the export
    run.recover()
    assert len(exported(run)) == 4

    archive = run.abandon_after(1)  # training goes on from step 1: steps 2 and 3 are another branch
    assert archive is not None
    branch = f"abandoned/{archive.name}"
    assert [r["step"] for r in stored(store, "p", "m")] == [1, 1] and [r["step"] for r in exported(run)] == [1, 1]
    assert stored(store, "p", "m", branch=branch) == [r2, r3]
    assert RunStore(model_path(tmp_path, "other", "m"), db=db_url).history() == []  # another project's model


def test_a_history_written_before_the_store_is_imported_once_and_a_pulled_one_replaces_it(
    store: Store, db_url: str, tmp_path
):
    path = model_path(tmp_path, "p", "old")
    path.mkdir(parents=True)
    before = [row(1), row(2)]
    (path / HISTORY).write_text("".join(json.dumps(r) + "\n" for r in before))
    run = RunStore(path, db=db_url)
    run.append([row(3)])  # the old rows go in first, in order
    assert stored(store, "p", "old") == [*before, row(3)] and exported(run) == [*before, row(3)]
    assert RunStore(path, db=db_url).history() == [*before, row(3)]  # imported once: nothing twice
    pulled = [row(1), row(2), row(3), row(4)]  # checkpoint sync brought another machine's file
    (path / HISTORY).write_text("".join(json.dumps(r) + "\n" for r in pulled))
    run.import_history()
    assert run.history() == pulled and stored(store, "p", "old") == pulled
