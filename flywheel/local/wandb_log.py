"""Weights & Biases logging, as ART does it: every metric row the backend records (train and SFT steps,
``model.log`` splits), and each step's trajectory table (a ``wandb.Table``), also goes to W&B when ``WANDB_API_KEY`` is set (or ``WANDB_MODE=offline``), one run per model
(W&B project = the model's project, run name = its name), resumed by a stable id so a restarted training continues
the same run. ``wandb`` is an optional extra (``pip install flywheel-rl[wandb]``), imported only when logging starts;
without it the rows are still written to the model's own files and a warning says what to install."""

from __future__ import annotations

import hashlib
import os
import re
import threading
from typing import TYPE_CHECKING, Any

from flywheel.train.config import warn_once

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

    from flywheel.local.loggers import TrajectoryTable

ROW_FIELDS = {"time", "step", "split", "checkpoint"}  # a history row's bookkeeping, not metrics


def enabled() -> bool:
    """W&B logging is asked for: an API key, or offline mode (tests, air-gapped machines); ``WANDB_MODE=disabled``
    turns it off."""
    mode = os.environ.get("WANDB_MODE")
    return mode != "disabled" and (bool(os.environ.get("WANDB_API_KEY")) or mode == "offline")


def run_id(project: str, name: str) -> str:
    """The model's W&B run id: stable across restarts, so ``resume`` continues its run. W&B ids are per project, so
    the name is enough (as in ART); characters W&B does not allow in an id are replaced, with a hash of the name
    then added so two names never share an id."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", name)
    return safe if safe == name else f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def wandb_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A history row's numeric metrics, named as ART names them: ``<split>/<name>`` unless the name has a ``/``."""
    split = row["split"]
    return {
        k if "/" in k else f"{split}/{k}": float(v)
        for k, v in row.items()
        if k not in ROW_FIELDS and isinstance(v, int | float)
    }


class WandbLog:
    """The backend's W&B runs, one per (project, name), opened at a model's first row and finished by ``finish``
    (on ``LocalBackend.close``). Logging never stops training: a missing package or a failed ``wandb.init`` is one
    warning, and that model's rows stay in its own files only."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, str], Run | None] = {}  # None: W&B could not start for this model
        self._lock = threading.Lock()

    def log(self, project: str, name: str, rows: list[dict[str, Any]]) -> None:
        """Log history rows at their steps (blocking: call it off the event loop)."""
        if not rows or not enabled():
            return
        with self._lock:
            run = self._run(project, name)
            if run is None:
                return
            for row in rows:
                run.log(wandb_metrics(row), step=int(row["step"]))

    def log_table(self, project: str, name: str, table: TrajectoryTable) -> None:
        """Log a step's trajectories as a ``wandb.Table`` named ``<split>/trajectories``, at its step."""
        if not enabled():
            return
        with self._lock:
            if (run := self._run(project, name)) is None:
                return
            import wandb  # installed: _run imported it

            run.log({table.key: wandb.Table(columns=table.columns, data=table.rows)}, step=table.step)

    def _run(self, project: str, name: str) -> Run | None:
        key = (project, name)
        if key not in self._runs:
            try:
                import wandb
            except ImportError:
                warn_once(
                    "wandb.missing",
                    "WANDB_API_KEY is set but wandb is not installed: metrics are not logged to Weights & Biases "
                    "(they are in the model's history.jsonl). Install it with `pip install flywheel-rl[wandb]`.",
                )
                self._runs[key] = None
                return None
            try:
                self._runs[key] = wandb.init(
                    project=project, name=name, id=run_id(project, name), resume="allow", reinit="create_new"
                )
            except Exception as e:  # a bad key, no network: W&B's trouble must not stop training
                warn_once(
                    f"wandb.init:{project}/{name}",
                    f"Weights & Biases did not start for model '{name}' (project '{project}'): {e}. Its metrics are "
                    "in the model's history.jsonl only.",
                )
                self._runs[key] = None
        return self._runs[key]

    def finish(self) -> None:
        """Finish every open run (their data is flushed; offline runs are complete on disk)."""
        with self._lock:
            for run in self._runs.values():
                if run is not None:
                    run.finish()
            self._runs.clear()
