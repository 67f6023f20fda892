"""Flywheel: make LLM agents better with reinforcement learning from outcomes.

The public API mirrors OpenPipe ART, so ``import flywheel as art`` runs ART-style code unchanged.
"""

from flywheel import rewards
from flywheel.backend import LocalBackend
from flywheel.gather import gather_trajectories, gather_trajectory_groups
from flywheel.model import Model, TrainableModel
from flywheel.types import History, Trajectory, TrajectoryGroup

__all__ = [
    "History",
    "LocalBackend",
    "Model",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "gather_trajectories",
    "gather_trajectory_groups",
    "rewards",
]
