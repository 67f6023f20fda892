"""The reward-hacking alarm: the training reward rises while no holdout grader does.

Holdout graders (``GraderStack.holdout``) score every training episode but never enter its reward, so a policy that
learns to please the reward without getting better at the task shows up as a rising reward over flat holdout
scores. Over the last ``window`` steps, the mean of the second half is compared with the first half's: a reward rise
of at least ``min_rise`` with no holdout grader rising by more than ``holdout_rise`` raises the alarm, and the loop
stops promoting until someone looks (the alarm is an audit event).

The alarm's state is the audit trail's, so that it survives a restart: a ``loop.alarm`` event (subject: the loop's
name) raises it; it stays raised until a ``loop.alarm.clear`` event (``flywheel loop CONFIG --clear-alarm --why
...``, or ``clear``), which also ends the baseline: the steps up to the one the clearing names are not looked at
again, so the same evidence does not raise it again at the next step.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from flywheel.store import audit
from flywheel.store.audit import AuditEventRecord

RAISED, CLEARED = "loop.alarm", "loop.alarm.clear"  # the audit actions


class NoAlarmError(LookupError):
    """A clearing asked for where no alarm is raised."""


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


class AlarmState(BaseModel):
    """What the audit trail says of a loop's alarm."""

    raised: str | None  # the alarm's message while it is raised (no clearing after it), else None
    cleared_at_step: int | None  # the step the latest clearing named: the baseline starts after it


def state(s: Session, loop: str) -> AlarmState:
    """The alarm of the loop named ``loop``, from its ``loop.alarm`` and ``loop.alarm.clear`` events."""
    last = audit.events(s, subject=loop, actions=(RAISED, CLEARED), limit=1)
    cleared = audit.events(s, subject=loop, actions=(CLEARED,), limit=1)
    raised = last[0] if last and last[0].action == RAISED else None
    return AlarmState(
        raised=None if raised is None else str(raised.details.get("message") or raised.reason),
        cleared_at_step=int(cleared[0].details["step"]) if cleared else None,
    )


def clear(s: Session, loop: str, *, step: int, actor: str, reason: str) -> AuditEventRecord:
    """Clear the raised alarm of the loop named ``loop`` (a ``loop.alarm.clear`` event naming the alarm's event and
    ``step``, the model's latest checkpoint: the baseline starts after it), in this unit of work; a
    ``NoAlarmError`` when none is raised."""
    audit.lock(s)
    last = audit.events(s, subject=loop, actions=(RAISED, CLEARED), limit=1)
    if not last or last[0].action != RAISED:
        raise NoAlarmError(f"the loop '{loop}' has no reward-hacking alarm raised: there is nothing to clear")
    return audit.append(
        s, actor=actor, action=CLEARED, subject=loop, reason=reason, details={"alarm_event": last[0].id, "step": step}
    )
