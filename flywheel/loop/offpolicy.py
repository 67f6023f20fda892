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
- ``guided``: a constrained call (a forced tool call: ``tool_choice`` "required" or named; ``guided_choice``; a JSON
  ``response_format``), as its choices record it (``guided``) or, for a call recorded before they did, as its
  request asks: its log-probs are the grammar-masked distribution's, the trainer scores the unmasked one, so the
  ratio would not be the policies' (the rule: constrained calls train as on-policy only, at weight 1, never as
  off-policy members; ``train/batch.py``);
- ``greedy``: a call drawn at temperature 0: no distribution drew it, so there is no ratio to weight it by;
- ``top_p``: a call drawn from the top-p nucleus (``top_p`` < 1): it was drawn from the truncated distribution
  while its log-probs, and the trainer's, are the untruncated one's;
- ``no_logprobs``: a sampled turn without log-probs TIS can compare (none recorded, or at another temperature than
  it was drawn at: an upstream's raw log-probs, ``gateway/upstream.py``);
- ``other_model``: a call answered by a model that is neither this loop's (``name``, ``name@k``, its aliases) nor its
  base model (which is its step 0);
- ``no_calls``: nothing to train on;
- ``ambiguous_choice``: an n > 1 call whose differing choices no later call tells apart: which one the agent used,
  and so what the reward is for, is unknown (``gateway/export.py``).

An episode joins at most once (``used``: the loop keeps the ids with their answering step in its checkpoint, and
drops them once they are stale anyway).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

from pydantic import BaseModel
from sqlalchemy.orm import Session

from flywheel.gateway.export import AmbiguousChoiceError, episode_trajectory
from flywheel.gateway.upstream import guided_request
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
    greedy = "greedy"
    top_p = "top_p"
    other_model = "other_model"
    no_calls = "no_calls"
    ambiguous_choice = "ambiguous_choice"


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
    if any(guided_request(c.request) for c in calls):  # a call recorded before its choices said so
        return LeftOut.guided
    answered = answering_step(calls, model, base_model)
    if answered is None:
        return LeftOut.other_model
    if step - answered > max_staleness:
        return LeftOut.stale
    try:
        trajectory = episode_trajectory(episode, list(calls))
    except AmbiguousChoiceError:
        return LeftOut.ambiguous_choice
    turns = [sampled_tokens(c) for c in sampled_turns(trajectory)]
    if any(s is not None and s.guided for s in turns):
        return LeftOut.guided
    if any(s is not None and s.greedy for s in turns):
        return LeftOut.greedy
    if any(s is not None and s.top_p < 1.0 for s in turns):
        return LeftOut.top_p
    if any(s is None or s.importance_logprobs is None for s in turns):
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
