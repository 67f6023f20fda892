"""A model's directory under a Flywheel home, by name: the one module that knows where a model is, what its files
are called and which of its checkpoints are complete. Whatever finds a model, lists its checkpoints or names one
of its files asks here. Light (no torch): the CLI and the agent side import it.

    <home>/<project>/models/<name>/
      history.jsonl                      one JSON row per step or evaluation: "time", "step", "split", metrics;
                                         the export of the rows the store holds (flywheel.store.history)
      trajectories/<split>/<step>.jsonl  the trajectories behind a row: the export of those the store holds
      checkpoints/<step:04d>/            trainer_state.json (written last: a complete checkpoint has it),
                                         adapter_model.safetensors + adapter_config.json (LoRA, peft's files) or
                                         model.safetensors (full fine-tuning), optimizer.pt, rng.pt
      abandoned/<time>-after-<step>/     a branch given up by training on from an earlier checkpoint
      .lock                              held (flock) while a backend has the model registered; holds its pid
      .run                               the run's id in the store, made when the directory is first used

Dot-names belong to this directory alone: the lock, the run id and the temporaries of writes in flight
(``checkpoints/.tmp-*``, ``.old-*`` and ``.del-*``: ``flywheel.checkpoints.run``); checkpoint sync never copies
them.
"""

from __future__ import annotations

import glob
import time
from pathlib import Path

MODELS = "models"  # <home>/<project>/models/<name>
PUBLISHED = ".published"  # <home>/.published/<project>/<name>/: adapters served on vLLM between checkpoints
CHECKPOINTS = "checkpoints"
TRAJECTORIES = "trajectories"
ABANDONED = "abandoned"
HISTORY = "history.jsonl"
LOCK = ".lock"
RUN = ".run"
# a checkpoint's files (peft's names for the adapter's)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FULL_WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
STATE = "trainer_state.json"
TMP, ASIDE, DELETING = ".tmp-", ".old-", ".del-"  # checkpoints/ entries in flight (all dot-names are temporary)


def model_path(home: Path, project: str, name: str) -> Path:
    """Where a model's directory is under a Flywheel home."""
    return home / project / MODELS / name


def published_path(home: Path, project: str, name: str) -> Path:
    """Where a backend that samples on vLLM writes the adapters of steps it serves without a checkpoint
    (``flywheel.vllm_backend``): outside the model's directory, which checkpoint sync copies."""
    return home / PUBLISHED / project / name


def home_project_name(model_dir: Path) -> tuple[Path, str, str]:
    """``model_path`` read back: the home, project and name of a model's directory (made absolute first)."""
    where = Path(model_dir).absolute()
    return where.parent.parent.parent, where.parent.parent.name, where.name


def find_models(home: Path, name: str, project: str | None = None) -> dict[str, Path]:
    """The existing directories of models called ``name`` under the home (only ``project``'s if given), by project,
    in order."""
    if project is not None:
        path = model_path(home, project, name)
        return {project: path} if path.is_dir() else {}
    found = sorted(p for p in home.glob(f"*/{MODELS}/{glob.escape(name)}") if p.is_dir())
    return {p.parent.parent.name: p for p in found}


def checkpoints_dir(model_dir: Path) -> Path:
    return model_dir / CHECKPOINTS


def checkpoint_name(step: int) -> str:
    return f"{step:04d}"


def checkpoint_dir(model_dir: Path, step: int) -> Path:
    return model_dir / CHECKPOINTS / checkpoint_name(step)


def checkpoint_dirs(model_dir: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every step's directory in ``checkpoints/``, complete or not, by step."""
    checkpoints = checkpoints_dir(model_dir)
    if not checkpoints.is_dir():
        return []
    return sorted((int(p.name), p) for p in checkpoints.iterdir() if p.name.isdigit())


def steps(model_dir: Path) -> list[int]:
    """Steps with a complete checkpoint (its state file, written last, is there), ascending."""
    return [step for step, directory in checkpoint_dirs(model_dir) if (directory / STATE).is_file()]


def latest(model_dir: Path) -> int | None:
    """The step of the latest complete checkpoint, or None."""
    found = steps(model_dir)
    return found[-1] if found else None


def checkpoint_step(relative: str) -> int | None:
    """The step of the checkpoint a file is part of, from its path relative to the model directory
    (``checkpoints/0012/rng.pt`` -> 12); None for a file outside the checkpoints' step directories."""
    parts = relative.split("/")
    return int(parts[1]) if len(parts) > 1 and parts[0] == CHECKPOINTS and parts[1].isdigit() else None


def is_history(relative: str) -> bool:
    """A file (relative to the model directory) of the run's history, which the store holds: the rows' export or a
    trajectory file."""
    return relative == HISTORY or relative.startswith(f"{TRAJECTORIES}/")


def is_private(relative: str) -> bool:
    """A dot-name (relative to the model directory): the lock, the run id, a temporary; never copied elsewhere."""
    return any(part.startswith(".") for part in relative.split("/"))


def trajectory_file(model_dir: Path, split: str, step: int) -> Path:
    return model_dir / TRAJECTORIES / split / f"{step:04d}.jsonl"


def trajectory_files(model_dir: Path, above: int) -> list[Path]:
    """The trajectory files of steps above ``above``."""
    return [f for f in model_dir.glob(f"{TRAJECTORIES}/*/*.jsonl") if f.stem.isdigit() and int(f.stem) > above]


def abandoned_dir(model_dir: Path, after: int) -> Path:
    """A new name for the branch above step ``after`` given up now: ``abandoned/<time>-after-<step>``."""
    archive = model_dir / ABANDONED / f"{time.strftime('%Y%m%d-%H%M%S')}-after-{after:04d}"
    while archive.exists():
        archive = archive.with_name(archive.name + "+")
    return archive
