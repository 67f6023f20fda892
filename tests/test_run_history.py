"""A run's history rows and trajectories live in the store (flywheel/store/history.py), on SQLite and PostgreSQL;
``history.jsonl`` and ``trajectories/<split>/<step>.jsonl`` are their export. No model: checkpoints are one small tensor (the format does not care how big the weights are)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from sqlalchemy import event, text

from flywheel.checkpoints import run as run_module
from flywheel.checkpoints.layout import HISTORY, RUN, model_path
from flywheel.checkpoints.run import OPEN_STORES, RunStore
from flywheel.store import Store, history
from flywheel.train.checkpoint import Checkpoint, CheckpointState
from flywheel.train.config import TrainedWeights
from flywheel.types import Trajectory

from helpers import at_revision


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


def stored(store: Store, run: RunStore, branch: str | None = None) -> list[dict]:
    with store.session() as s:
        return history.rows(s, run.key, branch=branch)


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
    rows = stored(store, run)
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
    assert [r["step"] for r in stored(store, run)] == [1, 1] and [r["step"] for r in exported(run)] == [1, 1]
    assert stored(store, run, branch=branch) == [r2, r3]
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
    assert stored(store, run) == [*before, row(3)] and exported(run) == [*before, row(3)]
    assert RunStore(path, db=db_url).history() == [*before, row(3)]  # imported once: nothing twice
    pulled = [row(1), row(2), row(3), row(4)]  # checkpoint sync brought another machine's file
    (path / HISTORY).write_text("".join(json.dumps(r) + "\n" for r in pulled))
    run.import_history()
    assert run.history() == pulled and stored(store, run) == pulled


def saved(run: RunStore, split: str, step: int) -> list[str]:
    """The ids in a step's exported trajectory file."""
    path = run.path / "trajectories" / split / f"{step:04d}.jsonl"
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_trajectories_are_the_stores_and_their_files_the_export(store: Store, db_url: str, tmp_path):
    run = RunStore(model_path(tmp_path, "p", "t"), db=db_url)
    a, b, c, d, e = (Trajectory(messages_and_choices=[{"role": "user", "content": n}], reward=0.5) for n in "abcde")
    run.write(tiny(1, [row(1)]))
    run.save_trajectories("train", 1, [a, b])
    run.save_trajectories("val", 1, [c])
    with store.session() as s:
        assert [k for k, _ in history.trajectories(s, run.key, "train")] == [1, 1]
    assert run.trajectories("train", 1) == [a, b] and run.trajectories("val") == [c]
    assert saved(run, "train", 1) == [a.id, b.id] and saved(run, "val", 1) == [c.id]
    (run.path / "trajectories" / "val" / "0001.jsonl").write_text("")  # killed between the store's commit and export
    run.save_trajectories("train", 2, [d])  # a step that got no checkpoint: redone after a kill
    run.recover()
    assert saved(run, "val", 1) == [c.id] and run.trajectories("train") == [a, b]
    assert not (run.path / "trajectories" / "train" / "0002.jsonl").exists()

    run.write(tiny(2, [row(2)]))
    run.save_trajectories("train", 2, [e])
    archive = run.abandon_after(1)
    assert archive is not None and run.trajectories("train") == [a, b]
    with store.session() as s:
        (moved,) = history.trajectories(s, run.key, "train", branch=f"abandoned/{archive.name}")
    assert moved[0] == 2 and Trajectory.model_validate_json(moved[1]) == e
    assert saved(run, "train", 1) == [a.id, b.id] and (archive / "trajectories" / "train" / "0002.jsonl").exists()

    elsewhere = RunStore(model_path(tmp_path / "copy", "p", "t2"), db=db_url)  # files from before the store
    (elsewhere.path / "trajectories" / "train").mkdir(parents=True)
    (elsewhere.path / "trajectories" / "train" / "0003.jsonl").write_text(a.model_dump_json() + "\n" + '{"id": "to')
    assert elsewhere.trajectories("train") == [a]  # imported, the torn last line left out


def test_a_writer_asks_the_store_for_the_runs_rows_once_not_at_every_step(store: Store, db_url: str, tmp_path):
    """Whether files from before the store are still to be imported is one query per run (per RunStore), not one per
    step's rows and one per step's trajectories; a pulled run's files still replace the store's."""
    run = RunStore(model_path(tmp_path, "p", "once"), db=db_url)
    a, b = (Trajectory(messages_and_choices=[{"role": "user", "content": n}], reward=0.5) for n in "ab")
    queries: list[str] = []

    def count(_conn, _cursor, statement, *_args) -> None:
        queries.append(statement)

    engine = run_module._store(db_url).engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        for step in (1, 2, 3):
            run.append([row(step)])
            run.save_trajectories("train", step, [a])
    finally:
        event.remove(engine, "before_cursor_execute", count)
    looks = [q for q in queries if q.lstrip().upper().startswith("SELECT") and "run_" in q]
    assert len(looks) == 2, looks  # rows, trajectories: at the first step only
    assert [r["step"] for r in stored(store, run)] == [1, 2, 3]

    (run.path / "trajectories" / "train" / "0003.jsonl").write_text(b.model_dump_json() + "\n")  # pulled
    run.import_history()
    assert run.trajectories("train") == [a, a, b]


def test_two_machines_training_one_name_into_one_store_keep_their_runs_apart(store: Store, db_url: str, tmp_path):
    """Two homes (machines) each train a model of the same project and name into one database: each directory is a
    run of its own (its id in ``.run``), so neither reads the other's rows nor drops them in its recovery; a directory
    made anew where one was deleted is a new run."""
    here = RunStore(model_path(tmp_path / "a", "p", "m"), db=db_url)
    there = RunStore(model_path(tmp_path / "b", "p", "m"), db=db_url)
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=1.0)
    here.write(tiny(1, [row(1)]))
    there.write(tiny(1, [row(1, loss=9.0)]))
    there.write(tiny(2, [row(2)]))
    there.save_trajectories("train", 2, [t])
    here.recover()  # its latest checkpoint is 1: rows above it go, its own only
    assert here.history() == [row(1)] and there.history() == [row(1, loss=9.0), row(2)]
    assert here.trajectories("train") == [] and there.trajectories("train") == [t]
    assert here.key.run != there.key.run and (here.path / RUN).read_text().strip() == here.key.run

    shutil.rmtree(there.path)
    again = RunStore(there.path, db=db_url)
    assert again.history() == [] and again.trajectories("train") == []  # nothing read back from a deleted run
    again.append([row(1)])
    assert again.history() == [row(1)] and again.key.run != there.key.run


def test_rows_stored_before_run_ids_are_kept_and_their_directory_adopts_them(db_url: str, tmp_path):
    """Migration 0010 keeps the rows stored by project and model (their run is ""); the directory that wrote them,
    opened for the first time since, adopts them, branches and trajectories included (the export has neither);
    a new directory of that name elsewhere is a run of its own."""
    r1, r2, r3 = row(1), row(2), row(3)
    t = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=1.0)
    insert = 'INSERT INTO run_history (project, model, step, split, time, "row", branch) VALUES '
    at_revision(db_url, "0009", [
        (insert + "('p', 'm', :step, 'train', :time, :row, :branch)", [
            {"step": r["step"], "time": r["time"], "row": json.dumps(r), "branch": b}
            for r, b in ((r1, None), (r2, "abandoned/x"), (r3, None))
        ]),
        ("INSERT INTO run_trajectories (project, model, split, step, trajectory) VALUES ('p', 'm', 'train', 3, :t)",
         [{"t": t.model_dump_json()}]),
    ])  # fmt: skip
    store = Store(db_url)  # migrated to the latest revision
    try:
        with store.session() as s:
            assert s.scalars(text("SELECT run FROM run_history")).all() == ["", "", ""]
        path = model_path(tmp_path, "p", "m")
        path.mkdir(parents=True)
        (path / HISTORY).write_text("".join(json.dumps(r) + "\n" for r in (r1, r3)))
        old = RunStore(path, db=db_url)
        assert old.history() == [r1, r3] and old.trajectories("train") == [t]
        assert stored(store, old, branch="abandoned/x") == [r2]  # adopted: the files never had these
        elsewhere = RunStore(model_path(tmp_path / "b", "p", "m"), db=db_url)
        elsewhere.append([row(7)])
        assert elsewhere.history() == [row(7)] and RunStore(path, db=db_url).history() == [r1, r3]
    finally:
        store.close()


def test_a_process_keeps_few_stores_open_and_one_closed_for_another_still_serves(tmp_path):
    """RunStore's stores are one per database URL, the last few used kept open; the one closed to make room opens
    again when its run is read (a process that trains many models in turn does not hold every database open)."""
    runs = [RunStore(model_path(tmp_path / f"home{i}", "p", "m")) for i in range(OPEN_STORES + 2)]
    for i, run in enumerate(runs):
        run.append([row(i)])
    assert len(run_module._stores) <= OPEN_STORES
    assert runs[0].db not in run_module._stores  # closed to make room
    (runs[0].path / HISTORY).unlink()  # so that what is read comes from the store
    assert [r["step"] for r in runs[0].history()] == [0]
