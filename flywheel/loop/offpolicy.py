"""Off-policy members: logged production episodes that join a training group of their task (issue #25, item 5).

A finished production episode whose item is a training group's (the same item id, as the loop's intake keys its
pool) may join that group as an extra member: its calls become a trajectory (``gateway/export.py``) with the exact
ids the sampler drew and their log-probs, and its reward is the grader stack's, as every member's. An earlier
checkpoint answered it, so the trainer weights its tokens with the truncated importance ratio
min(pi_current / pi_sampler, cap) (TIS, ``train/loss.py``; the loop refuses off-policy members without a cap) and
reports their ratios apart from the on-policy rollouts' (``off_policy_is_ratio_mean``; ``train/trainer.py``).

An episode is left out, and the reason counted, when it cannot be corrected for honestly:

- ``stale``: the oldest checkpoint that answered it is more than ``max_staleness_steps`` before the current step
  (the ratio of a far-off policy is mostly the cap);
- ``text_only`` / ``redacted``: a call has no token ids (an upstream returned none; or personal data was redacted
  before it was stored, and its token ids with it);
- ``no_logprobs``: a sampled turn without the sampler's log-probs (nothing to correct with);
- ``guided``: a call with a ``response_format``: its log-probs are the constrained distribution's, which the trainer
  does not recompute;
- ``other_model``: a call answered by a model that is neither this loop's (``name``, ``name@k``, its aliases) nor its
  base model (which is its step 0);
- ``no_calls``: nothing to train on.

An episode joins at most once (``used``: the loop keeps the ids with their answering step in its checkpoint, and
drops them once they are stale anyway).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

from pydantic import BaseModel
from sqlalchemy.orm import Session

from flywheel.gateway.export import episode_trajectory
from flywheel.store import CallRecord
from flywheel.store import episodes as db
from flywheel.train.credit import sampled_turns
from flywheel.types import OFF_POLICY, Trajectory, sampled_tokens

ANSWERED_AT = "answered_at_step"  # an off-policy member's metadata: the oldest checkpoint step that answered it


class LeftOut(StrEnum):
    stale = "stale"
    text_only = "text_only"
    redacted = "redacted"
    no_logprobs = "no_logprobs"
    guided = "guided"
    other_model = "other_model"
    no_calls = "no_calls"


class OffPolicyDraw(BaseModel):
    """What joined the groups of one iteration, and what was looked at and left out."""

    members: dict[str, list[Trajectory]]  # by pool key
    answered: dict[str, int]  # member episode id -> the oldest checkpoint step that answered it
    left_out: dict[str, int]  # reason -> episodes


class OffPolicyStep(BaseModel):
    """One iteration's off-policy members, as the loop reports them."""

    step: int  # the model's step after the iteration (the same as before when it could not train)
    joined: int
    episodes: list[str]
    left_out: dict[str, int]  # reason -> episodes looked at and left out
    is_ratio_mean: float | None  # their tokens' mean pi_current / pi_sampler, before the cap; None: not trained


def answering_step(calls: Sequence[CallRecord], model: str, base_model: str) -> int | None:
    """The oldest checkpoint step of ``model`` that answered these calls (its base model is step 0); None if a call
    was answered by another model."""
    steps = []
    for call in calls:
        if call.model.partition("@")[0] == model and call.step is not None:
            steps.append(call.step)
        elif call.model == base_model and call.deployment is None:
            steps.append(0)
        else:
            return None
    return min(steps) if steps else None


def member(
    episode: db.EpisodeRecord,
    calls: Sequence[CallRecord],
    *,
    model: str,
    base_model: str,
    step: int,
    max_staleness: int,
) -> Trajectory | LeftOut:
    """A finished production episode as an off-policy member of a group trained at ``step``, or why it is not."""
    if not calls:
        return LeftOut.no_calls
    if any(c.text_only for c in calls):
        return LeftOut.text_only if any(c.upstream for c in calls if c.text_only) else LeftOut.redacted
    if any(c.request.get("response_format") for c in calls):
        return LeftOut.guided
    answered = answering_step(calls, model, base_model)
    if answered is None:
        return LeftOut.other_model
    if step - answered > max_staleness:
        return LeftOut.stale
    trajectory = episode_trajectory(episode, list(calls))
    if any((s := sampled_tokens(c)) is None or s.logprobs is None for c in sampled_turns(trajectory)):
        return LeftOut.no_logprobs
    trajectory.metadata |= {OFF_POLICY: True, ANSWERED_AT: answered}
    return trajectory


def draw(
    s: Session,
    candidates: Mapping[str, Sequence[str]],
    keys: Sequence[str],
    *,
    model: str,
    base_model: str,
    step: int,
    per_group: int,
    max_staleness: int,
    used: Mapping[str, int],
) -> OffPolicyDraw:
    """Up to ``per_group`` members for the group of each pool key in ``keys``, from ``candidates`` (pool key ->
    finished production episode ids, oldest first: the newest are looked at first), none in ``used``."""
    out = OffPolicyDraw(members={}, answered={}, left_out={})
    for key in keys:
        found = out.members.setdefault(key, [])
        for episode_id in reversed(candidates.get(key, ())):
            if len(found) >= per_group:
                break
            if episode_id in used or episode_id in out.answered:
                continue
            got = member(
                db.get_episode(s, episode_id), db.calls(s, episode_id), model=model, base_model=base_model,
                step=step, max_staleness=max_staleness,
            )  # fmt: skip
            if isinstance(got, LeftOut):
                out.left_out[got.value] = out.left_out.get(got.value, 0) + 1
            else:
                found.append(got)
                out.answered[episode_id] = int(got.metadata[ANSWERED_AT])
    return out
