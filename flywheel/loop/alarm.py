"""The reward-hacking alarm: the training reward rises while no holdout grader does.

Holdout graders (``GraderStack.holdout``) score every training episode but never enter its reward, so a policy that
learns to please the reward without getting better at the task shows up as a rising reward over flat holdout
scores. Over the last ``window`` steps, the mean of the second half is compared with the first half's: a reward rise
of at least ``min_rise`` with no holdout grader rising by more than ``holdout_rise`` raises the alarm, and the loop
stops promoting until someone looks (the alarm is an audit event).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class AlarmPolicy(BaseModel):
    window: int = Field(6, ge=2)  # steps looked at
    min_rise: float = Field(0.1, gt=0)  # a training reward rise this large ...
    holdout_rise: float = Field(0.0, ge=0)  # ... needs some holdout grader to rise more than this


def _halves(values: list[float]) -> tuple[float, float]:
    half = len(values) // 2
    first, second = values[:half], values[len(values) - half :]
    return sum(first) / len(first), sum(second) / len(second)


def reward_hacking(steps: list[dict[str, float]], policy: AlarmPolicy) -> str | None:
    """``steps``: one row per training step, ``reward`` and ``holdout/<name>`` means. A message when the alarm is
    raised, else None (also without holdout graders: nothing to compare with, or fewer steps than the window)."""
    recent = steps[-policy.window :]
    holdouts = sorted({k for row in recent for k in row if k.startswith("holdout/")})
    if len(recent) < policy.window or not holdouts or any(k not in row for row in recent for k in holdouts):
        return None
    before, after = _halves([row["reward"] for row in recent])
    if after - before < policy.min_rise:
        return None
    rises = {k: _halves([row[k] for row in recent]) for k in holdouts}
    if any(b - a > policy.holdout_rise for a, b in rises.values()):
        return None
    flat = ", ".join(f"{k} {a:.3f} -> {b:.3f}" for k, (a, b) in rises.items())
    return f"the training reward rose {before:.3f} -> {after:.3f} over {policy.window} steps while {flat}"
