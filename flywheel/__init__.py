"""Flywheel: make LLM agents better with reinforcement learning from outcomes.

The public API mirrors OpenPipe ART, so ``import flywheel as art`` runs ART-style code unchanged (docs/user-guide.md,
"Coming from ART", says what differs); ``flywheel.local``, ``flywheel.utils``, ``flywheel.dev`` and
``flywheel.guided_completion`` are ART's ``art.local``, ``art.utils``, ``art.dev`` and ``art.guided_completion``
(and ``flywheel.trajectories`` ART's ``art.trajectories``).
Importing it is light (no torch): an agent or a runner process needs the data types, ``gather`` and the model
handles; the names that load the engine (``LocalBackend``, ``VLLMBackend``) or a judge's client (``rewards``) are imported when first
used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flywheel import dev, guided_completion, trajectories
from flywheel.auto_trajectory import auto_trajectory, capture_auto_trajectory
from flywheel.gather import gather_trajectories, gather_trajectory_groups, trajectory_group_batches
from flywheel.model import Backend, Model, TrainableModel
from flywheel.pipeline import RolloutPipeline
from flywheel.train.config import TrainConfig
from flywheel.types import History, Messages, MessagesAndChoices, Tools, TrainResult, Trajectory, TrajectoryGroup
from flywheel.utils import retry

if TYPE_CHECKING:
    from flywheel import rewards
    from flywheel.agents.dynamic_sampling import gather_mixed_groups
    from flywheel.local.backend import LocalBackend
    from flywheel.vllm_backend import VLLMBackend

_LAZY = {
    "LocalBackend": ("flywheel.local.backend", "LocalBackend"),
    "VLLMBackend": ("flywheel.vllm_backend", "VLLMBackend"),  # LocalBackend training, sampling on vLLM servers
    "rewards": ("flywheel.rewards", None),
    "gather_mixed_groups": ("flywheel.agents.dynamic_sampling", "gather_mixed_groups"),  # DAPO's dynamic sampling
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'flywheel' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # imported once
    return value


__all__ = [
    "Backend",
    "History",
    "LocalBackend",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "RolloutPipeline",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "VLLMBackend",
    "auto_trajectory",
    "capture_auto_trajectory",
    "dev",
    "gather_mixed_groups",
    "gather_trajectories",
    "gather_trajectory_groups",
    "guided_completion",
    "retry",
    "rewards",
    "trajectories",
    "trajectory_group_batches",
]
