"""MLflow and TensorBoard logging (flywheel/local/loggers.py), with no network: a training step's and ``model.log``'s
metrics reach an MLflow run in a local SQLite store and TensorBoard event files, both read back with the tools' own
readers; a restarted backend continues the same MLflow run; loggers are chosen by name or by environment; a logger
whose package is missing is one warning, never an error."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

import flywheel as art
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.loggers import MetricLoggers, chosen
from flywheel.local.mlflow_log import TAG, MlflowLog, tracking_uri
from flywheel.local.tensorboard_log import TensorBoardLog, log_dir

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


async def test_a_training_step_and_model_log_reach_mlflow_and_tensorboard(tmp_path: Path, monkeypatch):
    for variable in ("MLFLOW_TRACKING_URI", "FLYWHEEL_TENSORBOARD_DIR", "FLYWHEEL_LOGGERS", "WANDB_API_KEY"):
        monkeypatch.delenv(variable, raising=False)
    home = tmp_path / "home"
    model = art.TrainableModel(name="logged/agent", project="tests", base_model=EMBEDDED_MODEL)
    backend = art.LocalBackend(path=home, loggers=["mlflow", "tensorboard"])
    try:
        await train_a_step_and_log(backend, model)
    finally:
        await backend.close()
    rows = backend.run(model).history()
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (1, "val")]

    scalars = tensorboard_scalars(log_dir(home, "tests", "logged/agent"))  # beside the model's checkpoints
    assert scalars["train/loss"] == {1: pytest.approx(rows[0]["loss"])}
    assert scalars["val/reward"] == {1: pytest.approx(0.5)} and scalars["val/accuracy"] == {1: 0.5}
    runs, metrics = mlflow_history(home, "tests", "logged/agent")
    assert len(runs) == 1 and metrics["train/loss"] == {1: pytest.approx(rows[0]["loss"])}
    assert metrics["val/accuracy"] == {1: 0.5}

    # a restarted backend: the same MLflow run goes on, TensorBoard gets a second event file in the same directory
    monkeypatch.setenv("FLYWHEEL_LOGGERS", "mlflow,tensorboard")
    again = art.LocalBackend(path=home, serve_http=False)
    assert again.loggers.names == ["mlflow", "tensorboard"]
    await again.log(model, [], "val", {"accuracy": 0.75}, step=2)
    await again.close()
    runs_again, metrics = mlflow_history(home, "tests", "logged/agent")
    assert runs_again == runs and metrics["val/accuracy"] == {1: 0.5, 2: 0.75}
    assert tensorboard_scalars(log_dir(home, "tests", "logged/agent"))["val/accuracy"] == {1: 0.5, 2: 0.75}


def test_loggers_are_chosen_by_name_or_by_their_tools_variables(tmp_path: Path, monkeypatch):
    for variable in ("MLFLOW_TRACKING_URI", "FLYWHEEL_TENSORBOARD_DIR", "FLYWHEEL_LOGGERS", "WANDB_API_KEY", "WANDB_MODE"):  # fmt: skip
        monkeypatch.delenv(variable, raising=False)
    assert chosen() == []  # nothing asked for: the model's own files only
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'm.db'}")
    monkeypatch.setenv("FLYWHEEL_TENSORBOARD_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert chosen() == ["wandb", "mlflow", "tensorboard"]
    assert log_dir(tmp_path, "p", "m") == tmp_path / "tb" / "p" / "m"
    monkeypatch.setenv("FLYWHEEL_LOGGERS", "tensorboard")
    assert chosen() == ["tensorboard"] and chosen(["mlflow"]) == ["mlflow"]
    monkeypatch.setenv("FLYWHEEL_LOGGERS", "tensorboard,comet")
    with pytest.raises(ValueError, match="FLYWHEEL_LOGGERS: unknown logger.*comet.*wandb, mlflow, tensorboard"):
        MetricLoggers(tmp_path)


def test_a_logger_whose_package_is_missing_is_one_warning_never_an_error(tmp_path: Path, monkeypatch):
    for module in ["mlflow", *(m for m in sys.modules if m.startswith("mlflow."))]:  # all of it, loaded or not:
        monkeypatch.setitem(sys.modules, module, None)  # `import` raises ImportError, as when not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    row = {"step": 1, "split": "train", "loss": 0.5}
    for logger, extra in ((MlflowLog(tmp_path), "mlflow"), (TensorBoardLog(tmp_path), "tensorboard")):
        with pytest.warns(UserWarning, match=rf"pip install flywheel-rl\[{extra}\]"):
            logger.log("tests", "a", [row])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            logger.log("tests", "a", [row | {"step": 2}])
        logger.finish()
