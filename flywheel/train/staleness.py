"""Bounded staleness: how old the weights that sampled a step's rollouts are, and the groups too old to train.

Every call a Flywheel server answers records on its choices the checkpoint step whose weights drew it
(``weights_step``, ``server/chat.py``); a trajectory was answered at the oldest of its calls' steps (``answered_at``:
its ``answered_at_step`` metadata where the gateway's export or the off-policy draw set it). A rollout's staleness
when step ``s`` trains on it is ``s - answered_at``: 0 for a synchronous step, up to ``k`` when rollouts for the
next ``k`` steps run while a step trains (``flywheel.pipeline``, ``flywheel loop`` with ``async_steps``). With
``TrainConfig.max_staleness_steps`` set, a group with a member staler than that, or answered by a step above the one
being trained (a line of checkpoints a restore abandoned), is dropped whole: dropping members alone would shift the
group's baseline. The truncated importance ratio (``loss.py``) corrects the rest. Trajectories without a recorded step
(built by hand, or from another API) are never dropped and are left out of the staleness figures.
"""

from __future__ import annotations

from collections.abc import Sequence

from flywheel.train.credit import sampled_turns
from flywheel.types import ANSWERED_AT, Trajectory, TrajectoryGroup, weights_step


def answered_at(trajectory: Trajectory) -> int | None:
    """The oldest checkpoint step that answered one of this trajectory's calls; None if none was recorded."""
    if (given := trajectory.metadata.get(ANSWERED_AT)) is not None:
        return int(given)
    steps = [s for c in sampled_turns(trajectory) if (s := weights_step(c)) is not None]
    return min(steps) if steps else None


def drop_stale(
    groups: Sequence[TrajectoryGroup], step: int, max_staleness: int | None
) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    """The groups that may train at checkpoint ``step`` (the weights before the update) and the step's figures:
    ``staleness_mean`` and ``staleness_max`` over the trajectories with a recorded step, ``stale_groups`` (dropped)
    when ``max_staleness`` is set."""
    kept, dropped, ages = [], 0, []
    for group in groups:
        answered = [a for t in group.trajectories if (a := answered_at(t)) is not None]
        ages += [step - a for a in answered if a <= step]
        if max_staleness is not None and any(a > step or step - a > max_staleness for a in answered):
            dropped += 1
        else:
            kept.append(group)
    metrics: dict[str, float] = {}
    if ages:
        metrics |= {"staleness_mean": sum(ages) / len(ages), "staleness_max": float(max(ages))}
    if max_staleness is not None:
        metrics["stale_groups"] = float(dropped)
    return kept, metrics
