"""MLflow, TensorBoard and trackio logging (flywheel/local/loggers.py), with no network: a training step's and
``model.log``'s metrics and trajectory tables reach an MLflow run in a local SQLite store (the tables as JSON
artifacts), TensorBoard event files (the tables as text summaries) and trackio's local store, each read back with the
tool's own readers; a restarted backend continues the same MLflow and trackio runs; a table holds a step's first
groups, with their grader scores and messages as text; loggers are chosen by name or by environment; a logger whose
package is missing is one warning, never an error."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

import flywheel as art
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.loggers import TEXT_LIMIT, MetricLoggers, TrajectoryTable, chosen, trajectory_table
from flywheel.local.mlflow_log import TAG, MlflowLog, table_path, tracking_uri
from flywheel.local.tensorboard_log import TensorBoardLog, log_dir
from flywheel.local.trackio_log import TrackioLog
from flywheel.types import Trajectory

from helpers import train_a_step_and_log


def tensorboard_scalars(where: Path) -> dict[str, dict[int, float]]:
    """Every scalar in a directory's event files, by tag and step, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for events in sorted(where.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return found


def tensorboard_texts(where: Path) -> dict[str, dict[int, str]]:
    """Every text summary in a directory's event files, by tag and step, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    found: dict[str, dict[int, str]] = {}
    for events in sorted(where.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["tensors"]:
            texts = {e.step: make_ndarray(e.tensor_proto).item().decode() for e in accumulator.Tensors(tag)}
            found.setdefault(tag.removesuffix("/text_summary"), {}).update(texts)
    return found


def mlflow_table(home: Path, project: str, name: str, split: str, step: int) -> dict:
    """A step's trajectory table, the JSON artifact of the model's MLflow run, downloaded from the store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri(home))
    experiment = client.get_experiment_by_name(project)
    (run,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{TAG}` = '{name}'")
    return json.loads(Path(client.download_artifacts(run.info.run_id, table_path(split, step), str(home))).read_text())


def trackio_store(where: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """trackio's local store: ``where`` if trackio is first imported now (it reads ``TRACKIO_DIR`` once, at import),
    else the one it already has."""
    monkeypatch.setenv("TRACKIO_DIR", str(where))
    import trackio.utils

    return trackio.utils.TRACKIO_DIR


def trackio_logs(project: str, name: str) -> dict[int, dict]:
    """The rows of a trackio run by step, read from trackio's local store."""
    from trackio.sqlite_storage import SQLiteStorage

    found: dict[int, dict] = {}
    for log in SQLiteStorage.get_logs(project, name):
        found.setdefault(log["step"], {}).update(log)
    return found


def mlflow_history(home: Path, project: str, name: str) -> tuple[list[str], dict[str, dict[int, float]]]:
    """The model's MLflow runs (ids) and their metrics by key and step, read from the store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri(home))
    experiment = client.get_experiment_by_name(project)
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{TAG}` = '{name}'")
    run_id = runs[0].info.run_id
    keys = runs[0].data.metrics
    return [r.info.run_id for r in runs], {
        key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in keys
    }


async def test_a_training_step_and_model_log_reach_mlflow_tensorboard_and_trackio(tmp_path: Path, monkeypatch):
    for variable in ("MLFLOW_TRACKING_URI", "FLYWHEEL_TENSORBOARD_DIR", "FLYWHEEL_LOGGERS", "WANDB_API_KEY", "FLYWHEEL_LOG_GROUPS"):  # fmt: skip
        monkeypatch.delenv(variable, raising=False)
    for variable in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):  # trackio's local store, not a Space or a server
        monkeypatch.delenv(variable, raising=False)
    where = trackio_store(tmp_path / "trackio", monkeypatch)
    assert where == tmp_path / "trackio", "trackio was imported before this test set TRACKIO_DIR"
    home = tmp_path / "home"
    model = art.TrainableModel(name="logged/agent", project="tests", base_model=EMBEDDED_MODEL)
    backend = art.LocalBackend(path=home, loggers=["mlflow", "tensorboard", "trackio"])
    try:
        await train_a_step_and_log(backend, model)
    finally:
        await backend.close()
    rows = backend.run(model).history()
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (1, "val")]
    trained = backend.run(model).trajectories("train", 1)
    answers = [t.messages()[-1]["content"] for t in trained]  # the two sampled answers, rewards 0 and 1

    scalars = tensorboard_scalars(log_dir(home, "tests", "logged/agent"))  # beside the model's checkpoints
    assert scalars["train/loss"] == {1: pytest.approx(rows[0]["loss"])}
    assert scalars["val/reward"] == {1: pytest.approx(0.5)} and scalars["val/accuracy"] == {1: 0.5}
    texts = tensorboard_texts(log_dir(home, "tests", "logged/agent"))
    assert set(texts) == {"train/trajectories", "val/trajectories"} and set(texts["train/trajectories"]) == {1}
    lines = texts["train/trajectories"][1].splitlines()
    assert lines[0] == "| step | group | reward | messages |" and len(lines) == 4  # a header, its rule, two rows
    assert lines[2].startswith("| 1 | 0 | 0.0 | user: Name a fruit.<br>assistant: ") and lines[3].startswith(
        "| 1 | 0 | 1.0 |"
    )

    runs, metrics = mlflow_history(home, "tests", "logged/agent")
    assert len(runs) == 1 and metrics["train/loss"] == {1: pytest.approx(rows[0]["loss"])}
    assert metrics["val/accuracy"] == {1: 0.5}
    table = mlflow_table(home, "tests", "logged/agent", "train", 1)
    assert table["columns"] == ["step", "group", "reward", "messages"]
    assert table["data"] == [
        [1, 0, t.reward, f"user: Name a fruit.\nassistant: {answer}"] for t, answer in zip(trained, answers)
    ]
    assert mlflow_table(home, "tests", "logged/agent", "val", 1) == table  # model.log's split: the same two
    assert (home / "mlflow-artifacts").is_dir()  # beside the store, not in the working directory

    logged = trackio_logs("tests", "logged/agent")
    assert logged[1]["train/loss"] == pytest.approx(rows[0]["loss"]) and logged[1]["val/accuracy"] == 0.5
    assert logged[1]["train/trajectories"] == {
        "_type": "trackio.table",
        "_value": [dict(zip(table["columns"], row)) for row in table["data"]],
    }

    # a restarted backend: the same MLflow and trackio runs go on, TensorBoard gets a second event file in the same
    # directory
    monkeypatch.setenv("FLYWHEEL_LOGGERS", "mlflow,tensorboard,trackio")
    again = art.LocalBackend(path=home, serve_http=False)
    assert again.loggers.names == ["mlflow", "tensorboard", "trackio"]
    await again.log(model, [], "val", {"accuracy": 0.75}, step=2)
    await again.close()
    runs_again, metrics = mlflow_history(home, "tests", "logged/agent")
    assert runs_again == runs and metrics["val/accuracy"] == {1: 0.5, 2: 0.75}
    assert tensorboard_scalars(log_dir(home, "tests", "logged/agent"))["val/accuracy"] == {1: 0.5, 2: 0.75}
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_runs("tests") == ["logged/agent"]
    assert trackio_logs("tests", "logged/agent")[2]["val/accuracy"] == 0.75


def test_trackio_resumes_each_models_run_when_two_models_take_turns(tmp_path: Path, monkeypatch):
    for variable in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(variable, raising=False)
    trackio_store(tmp_path / "trackio", monkeypatch)
    project = f"turns-{tmp_path.name}"  # its own, whichever store trackio has
    log = TrackioLog()
    for step in (1, 2):  # trackio has one active run: each model's turn resumes its run
        log.log(project, "a", [{"step": step, "split": "train", "loss": 1.0 / step}])
        log.log(project, "b", [{"step": step, "split": "train", "loss": 2.0 / step}])
    log.finish()
    from trackio.sqlite_storage import SQLiteStorage

    assert sorted(SQLiteStorage.get_runs(project)) == ["a", "b"]
    for name, first in (("a", 1.0), ("b", 2.0)):
        logged = trackio_logs(project, name)
        assert {step: row["train/loss"] for step, row in logged.items()} == {1: first, 2: first / 2}


def test_a_trajectory_table_holds_a_steps_first_groups_with_their_grader_scores_and_messages_as_text():
    def answered(prompt: str, *turns: dict, reward: float, **metrics: float) -> Trajectory:
        chat = [{"role": "user", "content": prompt}, *turns]
        return Trajectory(messages_and_choices=chat, reward=reward, metrics=metrics)

    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "a|b"}'}}
    tool_turns = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "found"},
        {"role": "assistant", "content": "Paris"},
    ]
    exact, long = {"grader/exact": 1.0, "grader/exact/latency_s": 0.1}, "x" * TEXT_LIMIT + "yz"
    step = [
        answered("2+2?", {"role": "assistant", "content": "4"}, reward=1.0, **exact),
        answered("2+2?", {"role": "assistant", "content": long}, reward=0.0, **{"grader/exact": 0.0}),
        answered("Capital of France?", *tool_turns, reward=0.5, ruler_score=0.5, duration=2.0),
        answered("left out", {"role": "assistant", "content": "a third group"}, reward=1.0),
    ]
    table = trajectory_table("val", 3, step, groups=2)
    assert table.key == "val/trajectories"
    assert table.columns == ["step", "group", "reward", "grader/exact", "ruler_score", "messages"]  # scores only
    assert [row[:5] for row in table.rows] == [[3, 0, 1.0, 1.0, None], [3, 0, 0.0, 0.0, None], [3, 1, 0.5, None, 0.5]]
    assert table.rows[0][5] == "user: 2+2?\nassistant: 4"
    shown = "user: 2+2?\nassistant: "  # 22 characters, then the answer's first TEXT_LIMIT - 22; 24 left
    assert table.rows[1][5] == shown + "x" * (TEXT_LIMIT - len(shown)) + "… (24 more characters)"
    assert (
        table.rows[2][5] == 'user: Capital of France?\nassistant: search({"q": "a|b"})\ntool: found\nassistant: Paris'
    )
    markdown = table.markdown().splitlines()
    assert markdown[:2] == ["| step | group | reward | grader/exact | ruler_score | messages |", "| --- " * 6 + "|"]
    assert markdown[4] == (
        '| 3 | 1 | 0.5 |  | 0.5 | user: Capital of France?<br>assistant: search({"q": "a\\|b"})<br>tool: found<br>'
        "assistant: Paris |"
    )  # a | in a cell escaped, its lines broken
    assert len(trajectory_table("val", 3, step, groups=5).rows) == 4


def test_loggers_are_chosen_by_name_or_by_their_tools_variables(tmp_path: Path, monkeypatch):
    for variable in ("MLFLOW_TRACKING_URI", "FLYWHEEL_TENSORBOARD_DIR", "FLYWHEEL_LOGGERS", "WANDB_API_KEY", "WANDB_MODE", "FLYWHEEL_LOG_GROUPS"):  # fmt: skip
        monkeypatch.delenv(variable, raising=False)
    assert chosen() == []  # nothing asked for: the model's own files only
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'm.db'}")
    monkeypatch.setenv("FLYWHEEL_TENSORBOARD_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert chosen() == ["wandb", "mlflow", "tensorboard"]  # trackio: only when named
    assert log_dir(tmp_path, "p", "m") == tmp_path / "tb" / "p" / "m"
    monkeypatch.setenv("FLYWHEEL_LOGGERS", "tensorboard, trackio")
    assert chosen() == ["tensorboard", "trackio"] and chosen(["mlflow"]) == ["mlflow"]
    assert MetricLoggers(tmp_path).groups == 4  # the default sample of a step's trajectories
    monkeypatch.setenv("FLYWHEEL_LOG_GROUPS", "0")
    assert MetricLoggers(tmp_path).groups == 0  # no tables
    monkeypatch.setenv("FLYWHEEL_LOG_GROUPS", "all")
    with pytest.raises(ValueError, match="FLYWHEEL_LOG_GROUPS='all': expected a whole number of groups"):
        MetricLoggers(tmp_path)
    monkeypatch.setenv("FLYWHEEL_LOGGERS", "tensorboard,comet")
    with pytest.raises(
        ValueError, match="FLYWHEEL_LOGGERS: unknown logger.*comet.*wandb, mlflow, tensorboard, trackio"
    ):
        MetricLoggers(tmp_path)


def test_a_logger_whose_package_is_missing_is_one_warning_never_an_error(tmp_path: Path, monkeypatch):
    for package in (
        "mlflow",
        "trackio",
    ):  # all of it, loaded or not: `import` raises ImportError, as when not installed
        for module in [package, *(m for m in sys.modules if m.startswith(f"{package}."))]:
            monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    row = {"step": 1, "split": "train", "loss": 0.5}
    table = TrajectoryTable("train", 2, ["step", "group", "reward", "messages"], [[2, 0, 1.0, "user: hi"]])
    loggers = ((MlflowLog(tmp_path), "mlflow"), (TensorBoardLog(tmp_path), "tensorboard"), (TrackioLog(), "trackio"))
    for logger, extra in loggers:
        with pytest.warns(UserWarning, match=rf"pip install flywheel-rl\[{extra}\]"):
            logger.log("tests", "a", [row])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            logger.log("tests", "a", [row | {"step": 2}])
            logger.log_table("tests", "a", table)
        logger.finish()
