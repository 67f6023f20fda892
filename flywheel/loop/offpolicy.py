"""Off-policy members: logged production episodes that join a training group of their task (issue #25, item 5).

A finished production episode whose item is a training group's (the same item id, as the loop's intake keys its
pool) may join that group as an extra member: its calls become a trajectory (``gateway/export.py``) with the exact
ids the sampler drew and their log-probs, and its reward is the grader stack's, as every member's. An earlier
checkpoint answered it, so the trainer weights its tokens with the truncated importance ratio
min(pi_current / pi_sampler, cap) (TIS, ``train/loss.py``; the loop refuses off-policy members without a cap) and
reports their ratios apart from the on-policy rollouts' (``off_policy_is_ratio_mean``; ``train/trainer.py``).

An episode is left out, and the reason counted, when it cannot be corrected for honestly:

- ``stale``: a checkpoint that answered it is more than ``max_staleness_steps`` training steps from the current
  one along the line of checkpoints the current one grew from (``staleness``: a rewind's checkpoint holds
  production's weights, so production's own episodes are as fresh as the steps since the rewind; the ratio of a
  far-off policy is mostly the cap);
- ``rolled_back``: a checkpoint that answered it is on no line the current one grew from (a canary rolled back
  and the steps it came from: training went on from production's weights, ``PromotionLadder.rewind_if_due``),
  however few steps ago it was;
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
drops them once they are stale or rolled back anyway, ``OffPolicyDraw.used``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

from pydantic import BaseModel
from sqlalchemy.orm import Session

from flywheel.gateway.export import AmbiguousChoiceError, episode_trajectory
from flywheel.gateway.upstream import guided_request
from flywheel.store import CallRecord, episodes
from flywheel.train.credit import sampled_turns
from flywheel.types import ANSWERED_AT, OFF_POLICY, Trajectory, sampled_tokens


class LeftOut(StrEnum):
    stale = "stale"
    rolled_back = "rolled_back"
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
    answered: dict[str, int]  # member episode id -> the stalest checkpoint step that answered it
    left_out: dict[str, int]  # reason -> episodes
    used: dict[str, int] = {}  # the loop's ``used`` once this iteration trains: the earlier ones still fresh, these


class OffPolicyStep(BaseModel):
    """One iteration's off-policy members, as the loop reports them."""

    step: int  # the model's step after the iteration (the same as before when it could not train)
    joined: int
    episodes: list[str]
    left_out: dict[str, int]  # reason -> episodes looked at and left out
    is_ratio_mean: float | None  # their tokens' mean pi_current / pi_sampler, before the cap; None: not trained


def answering_steps(calls: Sequence[CallRecord], model: str, base_model: str) -> list[int] | None:
    """The checkpoint steps of ``model`` that answered these calls (its base model is step 0); None if a call was
    answered by another model."""
    steps = []
    for call in calls:
        if call.model.partition("@")[0] == model and call.step is not None:
            steps.append(call.step)
        elif call.model == base_model and call.deployment is None:
            steps.append(0)
        else:
            return None
    return steps or None


def staleness(answered: int, step: int, rewinds: Mapping[int, int]) -> int | None:
    """How many training steps checkpoint ``answered`` is from checkpoint ``step``, along the line ``step`` grew
    from; None if ``answered`` is not on it. ``rewinds``: each rewind's checkpoint step -> the step whose weights it
    took (production's; 0 for the base model), from the ``loop.rewind`` events. A checkpoint's parent is the step
    before it, except a rewind's, which holds its source's weights (0 steps from them)."""
    distance, top = 0, step
    while answered <= top:
        start = max((r for r in rewinds if r <= top), default=0)  # the line runs straight from start to top
        if answered >= start:
            return distance + top - answered
        if rewinds[start] >= start:  # a rewind to a later step: no lineage to follow
            return None
        distance, top = distance + top - start, rewinds[start]
    return None  # a later step than any on the line (a rolled-back line's)


def member(
    episode: episodes.EpisodeRecord,
    calls: Sequence[CallRecord],
    *,
    model: str,
    base_model: str,
    step: int,
    max_staleness: int,
    rewinds: Mapping[int, int],
) -> Trajectory | LeftOut:
    """A finished production episode as an off-policy member of a group trained at ``step``, or why it is not
    (``rewinds`` as for ``staleness``)."""
    if not calls:
        return LeftOut.no_calls
    if any(c.text_only for c in calls):
        return LeftOut.text_only if any(c.upstream for c in calls if c.text_only) else LeftOut.redacted
    if any(guided_request(c.request) for c in calls):  # a call recorded before its choices said so
        return LeftOut.guided
    steps = answering_steps(calls, model, base_model)
    if steps is None:
        return LeftOut.other_model
    distances = {s: staleness(s, step, rewinds) for s in steps}
    if None in distances.values():
        return LeftOut.rolled_back
    answered = max(distances, key=lambda s: distances[s] or 0)  # the stalest
    if (distances[answered] or 0) > max_staleness:
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
    rewinds: Mapping[int, int] | None = None,
) -> OffPolicyDraw:
    """Up to ``per_group`` members for the group of each pool key in ``keys``, from ``candidates`` (pool key ->
    finished production episode ids, oldest first: the newest are looked at first), none in ``used`` (episode ->
    its answering step); staleness along the line of ``rewinds`` (as for ``staleness``; None: no rewind)."""
    rewinds = rewinds or {}
    out = OffPolicyDraw(members={}, answered={}, left_out={})
    for key in keys:
        found = out.members.setdefault(key, [])
        for episode_id in reversed(candidates.get(key, ())):
            if len(found) >= per_group:
                break
            if episode_id in used or episode_id in out.answered:
                continue
            got = member(
                episodes.get_episode(s, episode_id), episodes.calls(s, episode_id), model=model, base_model=base_model,
                step=step, max_staleness=max_staleness, rewinds=rewinds,
            )  # fmt: skip
            if isinstance(got, LeftOut):
                out.left_out[got.value] = out.left_out.get(got.value, 0) + 1
            else:
                found.append(got)
                out.answered[episode_id] = int(got.metadata[ANSWERED_AT])
    # kept while they could still join: not stale at the step this iteration trains, nor rolled back
    out.used = {
        k: v for k, v in {**used, **out.answered}.items()
        if (d := staleness(v, step + 1, rewinds)) is not None and d <= max_staleness
    }  # fmt: skip
    return out
