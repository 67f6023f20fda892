"""``from art.trajectories import TrajectoryGroup`` as ART scripts write it (ART's self-play ``train_o4_mini.py``
does): the names ART's module defines, ``Trajectory``, ``TrajectoryGroup``, ``PydanticException`` and
``MetadataValue``, which are Flywheel's own from ``flywheel.types`` (``art.Trajectory`` and ``art.TrajectoryGroup``
are the same classes)."""

from flywheel.types import MetadataValue, PydanticException, Trajectory, TrajectoryGroup

__all__ = ["MetadataValue", "PydanticException", "Trajectory", "TrajectoryGroup"]
