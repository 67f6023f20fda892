"""MLflow logging: every metric row the backend records also goes to MLflow, one run per model (experiment = the
model's project, run name = its name), found again by its ``flywheel.model`` tag so that a restarted training
continues the same run. The tracking store is ``MLFLOW_TRACKING_URI`` (a server, or ``sqlite:///path``), else a
SQLite store under the backend's home (``<home>/mlflow.db``: ``mlflow ui --backend-store-uri sqlite:///...``, its
artifacts in ``<home>/mlflow-artifacts``). Each step's trajectory table is a JSON artifact of the run,
``trajectories/<split>/step_<step>.json`` (``{"columns": [...], "data": [[...], ...]}``, the layout of MLflow's own
``log_table``, which would need pandas).
``mlflow`` is an optional extra (``pip install flywheel-rl[mlflow]``, the ``mlflow-skinny`` client), imported when
logging starts; without it, one warning, and the rows stay in the model's own files."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.local.wandb_log import wandb_metrics
from flywheel.train.config import warn_once

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from flywheel.local.loggers import TrajectoryTable

TAG = "flywheel.model"  # the run's model name: how a restarted backend finds its run


def tracking_uri(home: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home.absolute() / 'mlflow.db'}"


def table_path(split: str, step: int) -> str:
    """Where a step's trajectory table goes among the run's artifacts."""
    return f"trajectories/{split}/step_{step}.json"


class MlflowLog:
    """The backend's MLflow runs, one per (project, name), opened at a model's first row and ended by ``finish``.
    Logging never stops training: a missing package or an unreachable store is one warning per model."""

    def __init__(self, home: Path) -> None:
        self.uri = tracking_uri(home)
        # the default store's artifacts beside it (MLflow's default is ./mlruns in the working directory)
        self.artifacts = (
            None if os.environ.get("MLFLOW_TRACKING_URI") else (home.absolute() / "mlflow-artifacts").as_uri()
        )
        self._client: MlflowClient | None = None
        self._runs: dict[tuple[str, str], str | None] = {}  # run ids; None: MLflow could not start for this model
        self._lock = threading.Lock()

    def log(self, project: str, name: str, rows: list[dict[str, Any]]) -> None:
        """Log history rows at their steps, named as W&B's are (``<split>/<name>``; blocking: off the event loop).
        Non-finite values are left out: MLflow's stores do not all keep them."""
        if not rows:
            return
        with self._lock:
            if (run := self._run(project, name)) is None:
                return
            from mlflow.entities import Metric  # installed: _run imported mlflow

            now = int(time.time() * 1000)
            metrics = [
                Metric(key, value, now, int(row["step"]))
                for row in rows
                for key, value in wandb_metrics(row).items()
                if math.isfinite(value)
            ]
            assert self._client is not None
            try:
                self._client.log_batch(run, metrics=metrics)
            except Exception as e:  # the store went away: its trouble must not stop training
                warn_once(f"mlflow.log:{project}/{name}", f"MLflow did not take model '{name}''s metrics: {e}")

    def log_table(self, project: str, name: str, table: TrajectoryTable) -> None:
        """Save a step's trajectory table as the run's JSON artifact ``table_path``."""
        with self._lock:
            if (run := self._run(project, name)) is None:
                return
            assert self._client is not None
            try:
                self._client.log_dict(
                    run, {"columns": table.columns, "data": table.rows}, table_path(table.split, table.step)
                )
            except Exception as e:  # an artifact store that cannot be written
                warn_once(f"mlflow.table:{project}/{name}", f"MLflow did not take model '{name}''s trajectories: {e}")

    def _run(self, project: str, name: str) -> str | None:
        key = (project, name)
        if key in self._runs:
            return self._runs[key]
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            warn_once(
                "mlflow.missing",
                "MLflow logging is on but mlflow is not installed: metrics are not logged to MLflow (they are in "
                "the model's history.jsonl). Install it with `pip install flywheel-rl[mlflow]`.",
            )
            self._runs[key] = None
            return None
        try:
            self._client = self._client or MlflowClient(tracking_uri=self.uri)
            found = self._client.get_experiment_by_name(project)
            experiment = found.experiment_id if found else self._client.create_experiment(project, self.artifacts)
            quoted = name.replace("'", "\\'")
            earlier = self._client.search_runs([experiment], filter_string=f"tags.`{TAG}` = '{quoted}'", max_results=1)
            run = earlier[0] if earlier else self._client.create_run(experiment, run_name=name, tags={TAG: name})
            self._runs[key] = run.info.run_id
        except Exception as e:  # a store that cannot be reached or written
            warn_once(
                f"mlflow.start:{project}/{name}",
                f"MLflow did not start for model '{name}' (project '{project}', store {self.uri}): {e}. Its metrics "
                "are in the model's history.jsonl only.",
            )
            self._runs[key] = None
        return self._runs[key]

    def finish(self) -> None:
        """End every open run (FINISHED; a restarted backend's rows reopen it)."""
        with self._lock:
            for run in self._runs.values():
                if run is not None and self._client is not None:
                    self._client.set_terminated(run)
            self._runs.clear()
