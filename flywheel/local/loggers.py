"""Where a model's metric rows go besides its own files (``history.jsonl``, the store): the trackers people already
use. ``MetricLoggers`` sends every row the backend records (train and SFT steps, ``model.log``'s splits) to each
logger that is on, at its step:

- ``wandb`` (``wandb_log.py``): with ``WANDB_API_KEY`` set or ``WANDB_MODE=offline``, as ART does;
- ``mlflow`` (``mlflow_log.py``): with ``MLFLOW_TRACKING_URI`` set (MLflow's own variable);
- ``tensorboard`` (``tensorboard_log.py``): with ``FLYWHEEL_TENSORBOARD_DIR`` set.

``FLYWHEEL_LOGGERS=mlflow,tensorboard`` (or ``LocalBackend(loggers=[...])``) names the loggers instead; W&B then
still needs its key (or offline mode). A logger never stops training: its trouble is one warning."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from flywheel.local import wandb_log
from flywheel.local.mlflow_log import MlflowLog
from flywheel.local.tensorboard_log import DIR, TensorBoardLog
from flywheel.local.wandb_log import WandbLog

NAMES = ("wandb", "mlflow", "tensorboard")
ENV = "FLYWHEEL_LOGGERS"


class MetricLogger(Protocol):
    def log(self, project: str, name: str, rows: list[dict[str, Any]]) -> None: ...

    def finish(self) -> None: ...


def chosen(names: Sequence[str] | None = None) -> list[str]:
    """The loggers that are on: ``names``, else ``$FLYWHEEL_LOGGERS``, else those whose tool's variable is set."""
    if names is None and (listed := os.environ.get(ENV, "").strip()):
        names = [n.strip() for n in listed.split(",") if n.strip()]
    if names is not None:
        if unknown := [n for n in names if n not in NAMES]:
            where = "loggers" if os.environ.get(ENV) is None else ENV
            raise ValueError(f"{where}: unknown logger(s) {', '.join(unknown)}; the loggers are {', '.join(NAMES)}")
        return list(dict.fromkeys(names))
    on = {"wandb": wandb_log.enabled(), "mlflow": bool(os.environ.get("MLFLOW_TRACKING_URI")), "tensorboard": bool(os.environ.get(DIR))}  # fmt: skip
    return [n for n in NAMES if on[n]]


class MetricLoggers:
    """The loggers that are on for a backend whose home is ``home`` (``chosen``)."""

    def __init__(self, home: Path, names: Sequence[str] | None = None) -> None:
        self.names = chosen(names)
        make = {"wandb": WandbLog, "mlflow": lambda: MlflowLog(home), "tensorboard": lambda: TensorBoardLog(home)}
        self.loggers: list[MetricLogger] = [make[n]() for n in self.names]

    def log(self, project: str, name: str, rows: list[dict[str, Any]]) -> None:
        """Log history rows to every logger (blocking: call it off the event loop)."""
        for logger in self.loggers:
            logger.log(project, name, rows)

    def finish(self) -> None:
        for logger in self.loggers:
            logger.finish()
