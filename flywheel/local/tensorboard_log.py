"""TensorBoard logging: every metric row the backend records also goes to TensorBoard event files, one directory
per model: ``FLYWHEEL_TENSORBOARD_DIR/<project>/<name>`` when that is set, else ``tensorboard/`` in the model's own
directory (``tensorboard --logdir`` either). Scalars are named as W&B's are (``<split>/<name>``) at their steps; a
restarted training appends new event files to the same directory. Each step's trajectory table is a text summary
``<split>/trajectories`` (a Markdown table, in TensorBoard's Text tab). The writer is torch's ``SummaryWriter``, which
needs the ``tensorboard`` package (``pip install flywheel-rl[tensorboard]``); without it, one warning."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.checkpoints.layout import model_path
from flywheel.local.wandb_log import wandb_metrics
from flywheel.train.config import warn_once

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from flywheel.local.loggers import TrajectoryTable

DIR = "FLYWHEEL_TENSORBOARD_DIR"


def log_dir(home: Path, project: str, name: str) -> Path:
    """Where a model's event files go."""
    root = os.environ.get(DIR)
    return Path(root) / project / name if root else model_path(home, project, name) / "tensorboard"


class TensorBoardLog:
    """The backend's event-file writers, one per (project, name), closed by ``finish``. Logging never stops
    training: a missing package or an unwritable directory is one warning per model."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self._writers: dict[tuple[str, str], SummaryWriter | None] = {}
        self._lock = threading.Lock()

    def log(self, project: str, name: str, rows: list[dict[str, Any]]) -> None:
        """Log history rows at their steps (blocking: call it off the event loop); written to disk at once."""
        if not rows:
            return
        with self._lock:
            if (writer := self._writer(project, name)) is None:
                return
            for row in rows:
                for key, value in wandb_metrics(row).items():
                    writer.add_scalar(key, value, global_step=int(row["step"]))
            writer.flush()

    def log_table(self, project: str, name: str, table: TrajectoryTable) -> None:
        """Write a step's trajectory table as the text summary ``<split>/trajectories`` at its step."""
        with self._lock:
            if (writer := self._writer(project, name)) is None:
                return
            writer.add_text(table.key, table.markdown(), global_step=table.step)
            writer.flush()

    def _writer(self, project: str, name: str) -> SummaryWriter | None:
        key = (project, name)
        if key not in self._writers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warn_once(
                    "tensorboard.missing",
                    "TensorBoard logging is on but tensorboard is not installed: metrics are not written as event "
                    "files (they are in the model's history.jsonl). Install it with "
                    "`pip install flywheel-rl[tensorboard]`.",
                )
                self._writers[key] = None
                return None
            where = log_dir(self.home, project, name)
            try:
                self._writers[key] = SummaryWriter(log_dir=str(where))
            except OSError as e:
                warn_once(f"tensorboard:{where}", f"TensorBoard event files cannot be written to {where}: {e}")
                self._writers[key] = None
        return self._writers[key]

    def finish(self) -> None:
        with self._lock:
            for writer in self._writers.values():
                if writer is not None:
                    writer.close()
            self._writers.clear()
