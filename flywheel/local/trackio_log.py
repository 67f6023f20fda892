"""trackio logging (Hugging Face's local-first tracker): every metric row the backend records, and each step's
trajectory table (a ``trackio.Table`` named ``<split>/trajectories``), also goes to trackio, one run per model
(trackio project = the model's project, run name = its name), resumed by name so that a restarted training continues
the same run. On only when named (``FLYWHEEL_LOGGERS=trackio``). trackio's own settings apply: its local store is
``TRACKIO_DIR`` (default: ``trackio`` in the Hugging Face cache), read by ``trackio show``; ``TRACKIO_SPACE_ID`` or
``TRACKIO_SERVER_URL`` send the runs to a Space or a server instead. trackio keeps one active run per process, so
when a second model logs, its run is resumed and the first one's is finished (and resumed again at its next row).
``trackio`` is an optional extra (``pip install flywheel-rl[trackio]``), imported when logging starts; without it,
one warning, and the rows stay in the model's own files."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from flywheel.local.wandb_log import wandb_metrics
from flywheel.train.config import warn_once

if TYPE_CHECKING:
    from trackio import Run

    from flywheel.local.loggers import TrajectoryTable


class TrackioLog:
    """The backend's trackio run: the one of the model that logged last. Logging never stops training: a missing
    package or a run that cannot start is one warning per model."""

    def __init__(self) -> None:
        self._current: tuple[tuple[str, str], Run] | None = None
        self._failed: set[tuple[str, str]] = set()  # models trackio could not start for
        self._lock = threading.Lock()

    def log(self, project: str, name: str, rows: list[dict[str, Any]]) -> None:
        """Log history rows at their steps, named as W&B's are (blocking: call it off the event loop)."""
        if not rows:
            return
        with self._lock:
            if (run := self._run(project, name)) is None:
                return
            for row in rows:
                run.log(wandb_metrics(row), step=int(row["step"]))

    def log_table(self, project: str, name: str, table: TrajectoryTable) -> None:
        """Log a step's trajectories as a ``trackio.Table`` named ``<split>/trajectories``, at its step."""
        with self._lock:
            if (run := self._run(project, name)) is None:
                return
            import trackio  # installed: _run imported it

            run.log({table.key: trackio.Table(columns=table.columns, data=table.rows)}, step=table.step)

    def _run(self, project: str, name: str) -> Run | None:
        key = (project, name)
        if key in self._failed:
            return None
        if self._current is not None and self._current[0] == key:
            return self._current[1]
        try:
            import trackio
        except ImportError:
            warn_once(
                "trackio.missing",
                "trackio logging is on but trackio is not installed: metrics are not logged to trackio (they are "
                "in the model's history.jsonl). Install it with `pip install flywheel-rl[trackio]`.",
            )
            self._failed.add(key)
            return None
        try:  # finishes the run of the model that logged before (trackio's one active run)
            run = trackio.init(project=project, name=name, resume="allow", embed=False)
        except Exception as e:  # a project name trackio refuses, an unreachable Space: must not stop training
            warn_once(
                f"trackio.init:{project}/{name}",
                f"trackio did not start for model '{name}' (project '{project}'): {e}. Its metrics are in the "
                "model's history.jsonl only.",
            )
            self._failed.add(key)
            self._current = None
            return None
        self._current = (key, run)
        return run

    def finish(self) -> None:
        """Finish the open run (its rows are in trackio's store)."""
        with self._lock:
            if self._current is not None:
                self._current[1].finish()
            self._current = None
            self._failed.clear()
