"""Where a model's metric rows go besides its own files (``history.jsonl``, the store): the trackers people already
use. ``MetricLoggers`` sends every row the backend records (train and SFT steps, ``model.log``'s splits) to each
logger that is on, at its step, and with it a table of the step's trajectories (``TrajectoryTable``):

- ``wandb`` (``wandb_log.py``): with ``WANDB_API_KEY`` set or ``WANDB_MODE=offline``, as ART does;
- ``mlflow`` (``mlflow_log.py``): with ``MLFLOW_TRACKING_URI`` set (MLflow's own variable);
- ``tensorboard`` (``tensorboard_log.py``): with ``FLYWHEEL_TENSORBOARD_DIR`` set;
- ``trackio`` (``trackio_log.py``): only when named.

``FLYWHEEL_LOGGERS=mlflow,tensorboard`` (or ``LocalBackend(loggers=[...])``) names the loggers instead; W&B then
still needs its key (or offline mode). A logger never stops training: its trouble is one warning."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flywheel.local import wandb_log
from flywheel.local.mlflow_log import MlflowLog
from flywheel.local.tensorboard_log import DIR, TensorBoardLog
from flywheel.local.trackio_log import TrackioLog
from flywheel.local.wandb_log import WandbLog
from flywheel.types import Message, Trajectory

NAMES = ("wandb", "mlflow", "tensorboard", "trackio")
ENV = "FLYWHEEL_LOGGERS"
GROUPS = "FLYWHEEL_LOG_GROUPS"  # how many groups of a step go in its trajectory table
DEFAULT_GROUPS = 4
TEXT_LIMIT = 4000  # characters of one trajectory's messages in a table; the rest is cut


class MetricLogger(Protocol):
    def log(self, project: str, name: str, rows: list[dict[str, Any]]) -> None: ...

    def log_table(self, project: str, name: str, table: TrajectoryTable) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class TrajectoryTable:
    """A step's trajectories as a tracker shows them: one row per trajectory of its first groups (a group: a stretch
    of trajectories saved in a row with the same prompt, as a training step saves its groups), with its step, group
    (0-based), reward, each grader's score (``grader/...`` metrics, RULER's ``ruler_score``; empty where a
    trajectory has none) and its messages as text."""

    split: str
    step: int
    columns: list[str]
    rows: list[list[Any]]

    @property
    def key(self) -> str:
        """Its name in the tracker: ``<split>/trajectories``."""
        return f"{self.split}/trajectories"

    def markdown(self) -> str:
        """The table in Markdown (TensorBoard's text panel): a cell's ``|`` escaped, its lines broken with ``<br>``."""

        def cell(value: Any) -> str:
            text = "" if value is None else str(value)
            return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

        lines = [self.columns, ["---"] * len(self.columns), *self.rows]
        return "\n".join("| " + " | ".join(cell(v) for v in line) + " |" for line in lines)


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
    return [n for n in NAMES if on.get(n, False)]


def table_groups() -> int:
    """How many groups of a step its trajectory table shows: ``$FLYWHEEL_LOG_GROUPS`` (0: no tables), else 4."""
    given = os.environ.get(GROUPS, "").strip()
    if not given:
        return DEFAULT_GROUPS
    if not given.isdigit():
        raise ValueError(f"{GROUPS}={given!r}: expected a whole number of groups (0 turns trajectory tables off)")
    return int(given)


def is_score(key: str) -> bool:
    """A trajectory metric that is a grader's score (not its error counts or latency)."""
    if key == "ruler_score":
        return True
    return key.startswith("grader/") and not key.endswith(("/errors", "/latency_s")) and "/error/" not in key


def prompt(trajectory: Trajectory) -> list[Message]:
    """The messages before its first assistant turn: what a group's trajectories share."""
    messages = trajectory.messages()
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return messages[:first]


def message_text(message: Message) -> str:
    """One message as a line a person reads: ``role: content``, and each tool call as ``name(arguments)``."""
    content = message.get("content")
    if isinstance(content, list):  # parts: their texts, others named in brackets
        content = "".join(
            p.get("text", "") if p.get("type") == "text" else f"[{p.get('type', 'part')}]" for p in content
        )
    calls = [
        f"{c['function']['name']}({c['function']['arguments']})" if c.get("type") == "function" else json.dumps(c)
        for c in message.get("tool_calls") or []
    ]
    return f"{message.get('role', '?')}: " + " ".join(part for part in [content or "", *calls] if part)


def trajectory_text(trajectory: Trajectory) -> str:
    """Its messages, one per line, cut at ``TEXT_LIMIT`` characters."""
    text = "\n".join(message_text(m) for m in trajectory.messages())
    if len(text) > TEXT_LIMIT:
        return f"{text[:TEXT_LIMIT]}… ({len(text) - TEXT_LIMIT} more characters)"
    return text


def trajectory_table(split: str, step: int, trajectories: Sequence[Trajectory], groups: int) -> TrajectoryTable:
    """The table of a step's first ``groups`` groups (``TrajectoryTable``)."""
    grouped: list[list[Trajectory]] = []
    last: list[Message] | None = None
    for trajectory in trajectories:
        if (shared := prompt(trajectory)) != last or not grouped:
            if len(grouped) == groups:
                break
            grouped.append([])
            last = shared
        grouped[-1].append(trajectory)
    scores = sorted({k for group in grouped for t in group for k in t.metrics if is_score(k)})
    rows = [
        [step, index, t.reward, *(t.metrics.get(k) for k in scores), trajectory_text(t)]
        for index, group in enumerate(grouped)
        for t in group
    ]
    return TrajectoryTable(split, step, ["step", "group", "reward", *scores, "messages"], rows)


class MetricLoggers:
    """The loggers that are on for a backend whose home is ``home`` (``chosen``)."""

    def __init__(self, home: Path, names: Sequence[str] | None = None) -> None:
        self.names = chosen(names)
        self.groups = table_groups()
        make = {
            "wandb": WandbLog,
            "mlflow": lambda: MlflowLog(home),
            "tensorboard": lambda: TensorBoardLog(home),
            "trackio": TrackioLog,
        }
        self.loggers: list[MetricLogger] = [make[n]() for n in self.names]

    def log(self, project: str, name: str, rows: list[dict[str, Any]]) -> None:
        """Log history rows to every logger (blocking: call it off the event loop)."""
        for logger in self.loggers:
            logger.log(project, name, rows)

    def log_trajectories(self, project: str, name: str, split: str, step: int, trajectories: list[Trajectory]) -> None:
        """Log the table of a step's trajectories (its first ``FLYWHEEL_LOG_GROUPS`` groups) to every logger
        (blocking: call it off the event loop, after the step's rows)."""
        if not self.loggers or not trajectories or not self.groups:
            return
        table = trajectory_table(split, step, trajectories, self.groups)
        for logger in self.loggers:
            logger.log_table(project, name, table)

    def finish(self) -> None:
        for logger in self.loggers:
            logger.finish()
