"""Recorded episodes as trajectories, groups and transitions: what ``model.train`` and the exporters take.

An episode's calls form chains: a call whose prompt continues an earlier output (``Call.prefix_call``) extends
the chain that output ended. The chain holding the episode's last call is the trajectory's main history, every
other chain an additional history (a sub-agent, a retry, a history the client edited). A chain's history is its
last request's messages with each continued output put back as the ``Choice`` that produced it (its exact ids and
log-probs), then the last call's choice. An output that two chains continue trains in the first only: in the
second its ids are prompt context. Other choices of an n > 1 call that nothing continued are not part of the
trajectory (they stay in the record).

Which choice of an n > 1 call the agent went on with, its next call's history says (``Call.prefix_choice``, found by
the splice). A chain's last call has no next call: if it returned choices that differ, nothing says which one the
agent used, so the episode's reward cannot be given to one: such an episode is no trajectory
(``AmbiguousChoiceError``; a group leaves it out and counts it in its metrics, ``AMBIGUOUS_CHOICE``). An agent that
samples n > 1 at its last call and picks one should end with a call that continues it, or ask n = 1 there.

A text-only call (an upstream that returned no token ids) has nothing the RL losses can use: an episode with one
becomes a trajectory only where text is enough (SFT, graders, evaluation), when the caller says so
(``text_only=True``); its metadata then says ``text_only: true``.
"""

from __future__ import annotations

import json

from openai.types.chat.chat_completion import Choice
from sqlalchemy.orm import Session

from flywheel.store import CallRecord, EpisodeRecord, EpisodeStatus, episodes
from flywheel.types import (
    TOKEN_IDS,
    WEIGHTS_STEP,
    History,
    MessageOrChoice,
    Trajectory,
    TrajectoryGroup,
    set_intermediate_reward,
    weights_step,
)


class NotTrainableError(ValueError):
    """An episode that cannot become a trajectory (not finished, or without a reward, or text-only for RL)."""


class AmbiguousChoiceError(NotTrainableError):
    """An episode whose chain ends with an n > 1 call of differing choices: which one the agent used is unknown."""


AMBIGUOUS_CHOICE = "episodes_ambiguous_choice"  # a group's metric: its episodes left out as AmbiguousChoiceError


TEXT_ONLY_REASON = "its upstream returned no token ids: usable for SFT, graders and evaluation, not RL"
REDACTED_REASON = (
    "personal data was redacted from them before they were stored, and their token ids with it: usable for SFT,"
    " graders and evaluation, not RL"
)


def _choice(call: CallRecord, index: int) -> Choice:
    body = next(c for c in call.response["choices"] if c["index"] == index)
    choice = Choice.model_validate(body)  # keeps token_ids, prompt_token_ids, temperature (extra fields)
    if weights_step(choice) is None and call.step is not None:  # recorded before choices carried it
        setattr(choice, WEIGHTS_STEP, call.step)
    if call.reward is not None:
        set_intermediate_reward(choice, call.reward)
    return choice


def _chains(calls: list[CallRecord]) -> list[list[tuple[CallRecord, int]]]:
    """Calls grouped into chains of (call, the choice the chain continues with), in order."""
    chains: list[list[tuple[CallRecord, int]]] = []
    for call in calls:
        chain = next((c for c in chains if call.prefix_call is not None and c[-1][0].id == call.prefix_call), None)
        if chain is None:  # continues nothing, or an output that another call already continued: a chain of its own
            chain = []
            chains.append(chain)
        else:  # the output continued is the chain's last call's choice ``prefix_choice``
            chain[-1] = (chain[-1][0], call.prefix_choice or 0)
        chain.append((call, 0))
    return chains


def _history(chain: list[tuple[CallRecord, int]], trained: set[tuple[int, int]]) -> History:
    last, _ = chain[-1]
    items: list[MessageOrChoice] = [dict(m) for m in last.request.get("messages", [])]
    # walk back: each call's output sits at the index the next call's request had it
    for (call, choice), (nxt, _) in zip(reversed(chain[:-1]), reversed(chain[1:])):
        if (call.id, choice) not in trained and nxt.prefix_message is not None and nxt.prefix_message < len(items):
            items[nxt.prefix_message] = _choice(call, choice)
            trained.add((call.id, choice))
    items.append(_choice(last, 0))  # its choices are alike (else _check_ends refused the episode)
    trained.add((last.id, 0))
    return History(messages_and_choices=items, tools=last.request.get("tools"))


def _check_ends(episode: EpisodeRecord, chains: list[list[tuple[CallRecord, int]]]) -> None:
    """Raise ``AmbiguousChoiceError`` if a chain's last call returned choices that differ (ids or message)."""
    for chain in chains:
        last, _ = chain[-1]
        choices = last.response.get("choices") or []
        if len({json.dumps([c.get("message"), c.get(TOKEN_IDS)], sort_keys=True) for c in choices}) > 1:
            raise AmbiguousChoiceError(
                f"Episode {episode.id!r}: call {last.id} returned {len(choices)} different choices and no later call"
                " continued one of them, so which one the agent used, and so what its reward is for, is unknown."
                " Ask n = 1 for the call that ends an episode (or continue the chosen choice in a next call)."
            )


def episode_trajectory(episode: EpisodeRecord, calls: list[CallRecord], *, text_only: bool = False) -> Trajectory:
    """A finished episode as a trajectory (raises ``NotTrainableError`` otherwise). An episode with a text-only
    call is one only with ``text_only`` (for SFT, graders and evaluation: not for RL)."""
    if episode.status != EpisodeStatus.finished or episode.reward is None:
        raise NotTrainableError(
            f"Episode {episode.id!r} is {episode.status.value}"
            + ("" if episode.reward is not None else " without a reward")
            + ": only finished episodes with a reward become trajectories."
        )
    if not calls:
        raise NotTrainableError(f"Episode {episode.id!r} has no calls: there is nothing to train on.")
    text_only_calls = [c.id for c in calls if c.text_only]
    if text_only_calls and not text_only:
        raise NotTrainableError(
            f"Episode {episode.id!r} has text-only calls ({', '.join(map(str, text_only_calls))}): "
            f"{TEXT_ONLY_REASON if any(c.upstream for c in calls if c.text_only) else REDACTED_REASON}."
            " Ask for it with text_only=allow to use it for SFT, graders or evaluation."
        )
    chains = _chains(calls)
    _check_ends(episode, chains)
    main = next(i for i, chain in enumerate(chains) if any(call.id == calls[-1].id for call, _ in chain))
    trained: set[tuple[int, int]] = set()
    histories = {i: _history(chain, trained) for i, chain in sorted(enumerate(chains), key=lambda ic: ic[0] != main)}
    metrics = {k: v for k, v in episode.metrics.items() if isinstance(v, int | float | bool)}
    metrics |= {
        "calls": len(calls),
        "retokenized_turns": sum(c.retokenized_turns for c in calls),
        "completion_tokens": sum(c.completion_tokens for c in calls),
        "latency_ms": sum(c.latency_ms for c in calls),
    }
    return Trajectory(
        id=episode.id,
        messages_and_choices=histories[main].messages_and_choices,
        tools=histories[main].tools,
        additional_histories=[h for i, h in histories.items() if i != main],
        reward=episode.reward,
        metrics=metrics,
        metadata={"episode_id": episode.id, "task_id": episode.task_id, "split": episode.split}
        | ({"text_only": True} if text_only_calls else {}),
    )


def trajectory_group(
    episodes: list[tuple[EpisodeRecord, list[CallRecord]]], *, text_only: bool = False
) -> TrajectoryGroup:
    """The finished episodes of one task as a group (the others are left out; one with a text-only call refuses
    the group unless ``text_only``; one whose last call's choice is ambiguous is left out and counted in the
    group's metrics, ``AMBIGUOUS_CHOICE``)."""
    trajectories, ambiguous = [], 0
    for e, calls in episodes:
        if e.status == EpisodeStatus.finished and e.reward is not None and calls:
            try:
                trajectories.append(episode_trajectory(e, calls, text_only=text_only))
            except AmbiguousChoiceError:
                ambiguous += 1
    return TrajectoryGroup(trajectories, metrics={AMBIGUOUS_CHOICE: ambiguous} if ambiguous else None)


def task_group(s: Session, task_id: str, split: str | None = None, *, text_only: bool = False) -> TrajectoryGroup:
    """A task's finished episodes in the store (of ``split``, if given) as a group (``trajectory_group``)."""
    found = episodes.list_episodes(s, task_id=task_id, split=split, status=EpisodeStatus.finished, limit=10_000)
    return trajectory_group([(e, episodes.calls(s, e.id)) for e in found], text_only=text_only)
