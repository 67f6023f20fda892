"""Off-policy members (flywheel/loop/offpolicy.py), store only (no model): which logged production episodes may join
a training group, and why the others are left out. The calls are written as the gateway records them (token ids,
the sampler's log-probs, the step that answered); tests/test_loop.py has a real one joining and training."""

from __future__ import annotations

from typing import Any

import pytest

from flywheel.loop.offpolicy import LeftOut, answering_steps, draw, staleness
from flywheel.store import Store, episodes
from flywheel.types import ANSWERED_AT, OFF_POLICY, sampled_tokens

BASE = "base/model"


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
    yield store
    store.close()


def logged(
    store: Store,
    *,
    model: str = "calc@production",
    step: int | None = 3,
    logprobs: bool = True,
    text_only: bool = False,
    upstream: str | None = None,
    response_format: dict | None = None,
    calls: int = 1,
    drawn: dict[str, Any] | None = None,
    asked: dict[str, Any] | None = None,
) -> str:
    """A finished production episode of item "q1" whose calls were answered as given (``drawn``: how its choice
    says it was drawn; ``asked``: more request fields)."""
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "blue"}, "finish_reason": "stop"}
    if not text_only:
        choice |= {"token_ids": [7, 8], "prompt_token_ids": [1, 2, 3], "temperature": 1.0} | (drawn or {})
        if logprobs:
            choice["logprobs"] = {"content": [{"token": t, "logprob": -0.5, "top_logprobs": []} for t in "bl"]}
    request = (
        {"messages": [{"role": "user", "content": "A colour?"}]}
        | ({"response_format": response_format} if response_format else {})
        | (asked or {})
    )
    with store.session() as s:
        e = episodes.create_episode(s, "ticket", split="production", meta={"item": {"id": "q1"}})
        for _ in range(calls):
            episodes.add_call(
                s, e.id, model=model, step=step, request=request, response={"choices": [choice]}, prompt_tokens=3,
                completion_tokens=2, latency_ms=1.0, prefix_call=None, prefix_choice=None, prefix_message=None,
                retokenized_turns=0, reward=None, text_only=text_only, upstream=upstream,
                deployment=model if "@" in model and not model.partition("@")[2].isdigit() else None,
            )  # fmt: skip
        episodes.set_outcome(s, e.id, reward=1.0, finish=True)
    return e.id


def take(
    store: Store,
    ids: list[str],
    *,
    step: int = 4,
    per_group: int = 10,
    used: dict[str, int] | None = None,
    rewinds: dict[int, int] | None = None,
):
    with store.session() as s:
        return draw(
            s, {"q1": ids}, ["q1", "q2"], model="calc", base_model=BASE, step=step, per_group=per_group,
            max_staleness=2, used=used or {}, rewinds=rewinds,
        )  # fmt: skip


def test_a_logged_episode_of_a_recent_checkpoint_joins_with_its_logprobs_and_the_others_are_left_out_by_reason(store):
    fresh = logged(store, step=3)  # via the production alias, answered by step 3: 1 step before step 4
    named = logged(store, model="calc@2", step=2)  # a checkpoint by name: 2 steps, the most allowed
    live = logged(store, model="calc", step=4)  # the live weights
    left = {
        logged(store, step=1): LeftOut.stale,  # 3 steps before
        logged(store, model=BASE, step=None): LeftOut.stale,  # the base model is step 0
        logged(store, text_only=True): LeftOut.redacted,  # redacted before it was stored: no token ids
        logged(store, text_only=True, upstream="http://vllm:8000", model="gpt-x", step=None): LeftOut.text_only,
        logged(store, logprobs=False): LeftOut.no_logprobs,  # nothing to correct with
        logged(store, response_format={"type": "json_object"}): LeftOut.guided,
        logged(store, model="other@production", step=3): LeftOut.other_model,
        logged(store, calls=0): LeftOut.no_calls,
    }
    found = take(store, [fresh, named, live, *left])
    assert found.members["q2"] == []  # no production episode of that item
    assert {t.metadata["episode_id"] for t in found.members["q1"]} == {fresh, named, live}
    assert found.answered == {fresh: 3, named: 2, live: 4}
    assert sorted(found.left_out.items()) == sorted(
        {r.value: list(left.values()).count(r) for r in set(left.values())}.items()
    )
    member = next(t for t in found.members["q1"] if t.metadata["episode_id"] == fresh)
    assert member.metadata[OFF_POLICY] is True and member.metadata[ANSWERED_AT] == 3
    sampled = sampled_tokens(member.messages_and_choices[-1])
    assert sampled is not None and sampled.completion_ids == [7, 8] and sampled.logprobs == [-0.5, -0.5]


def test_the_newest_join_first_up_to_the_limit_and_an_episode_joins_once(store):
    older, newer, newest = (logged(store) for _ in range(3))
    found = take(store, [older, newer, newest], per_group=2)
    assert list(found.answered) == [newest, newer] and found.left_out == {}
    again = take(store, [older, newer, newest], per_group=2, used=found.answered)
    assert list(again.answered) == [older]
    # an episode answered by two checkpoints counts from the stalest one
    with store.session() as s:
        (call,) = episodes.calls(s, older)
    assert answering_steps([call, call.model_copy(update={"step": 1})], "calc", BASE) == [3, 1]


def test_constrained_greedy_top_p_and_other_temperature_calls_are_left_out_by_reason(store):
    """Item 13/14 of issue #37: a constrained call's log-probs are the masked distribution's (the trainer scores the
    unmasked one), a greedy or top-p call was not drawn from the distribution its log-probs describe, and log-probs
    at another temperature than the call's (an upstream's raw ones) cannot be compared: none joins as off-policy."""
    forced = {"tools": [{"type": "function", "function": {"name": "calc", "parameters": {}}}]}
    ok = logged(store, drawn={"top_p": 1.0, "guided": False, "logprobs_temperature": 1.0})
    left = {
        logged(store, drawn={"guided": True}): LeftOut.guided,  # as the server records it now
        logged(store, asked=forced | {"tool_choice": "required"}): LeftOut.guided,  # recorded before it did
        logged(store, asked=forced | {"tool_choice": {"type": "function", "function": {"name": "calc"}}}): (
            LeftOut.guided
        ),
        logged(store, asked={"guided_choice": ["red", "blue"]}): LeftOut.guided,
        logged(store, response_format={"type": "json_schema", "json_schema": {"name": "x"}}): LeftOut.guided,
        logged(store, drawn={"temperature": 0.0}): LeftOut.greedy,
        logged(store, drawn={"top_p": 0.9}): LeftOut.top_p,
        logged(store, drawn={"temperature": 0.7, "logprobs_temperature": 1.0}): LeftOut.no_logprobs,
        logged(store, drawn={"temperature": 0.7, "logprobs_temperature": None}): LeftOut.no_logprobs,
    }
    # not constrained: tool_choice "auto" or "none", a text response_format
    free = [
        logged(store, asked=forced | {"tool_choice": "auto"}),
        logged(store, response_format={"type": "text"}, drawn={"temperature": 0.7, "logprobs_temperature": 0.7}),
    ]
    found = take(store, [ok, *free, *left])
    assert set(found.answered) == {ok, *free}
    assert found.left_out == {r.value: list(left.values()).count(r) for r in set(left.values())}


def test_staleness_is_measured_along_the_line_of_checkpoints_a_rewind_starts_again(store):
    """Issue #37 item 15. Production served step 2; training went on to step 5, whose canary was rolled back, and the
    loop rewound: checkpoint 6 holds step 2's weights. At step 6, production's own episodes (step 2) are fresh (0
    steps from the weights training goes on from), the rolled-back canary's (step 5, 1 step ago by number) are on
    no line step 6 grew from."""
    rewinds = {6: 2}
    assert [staleness(a, 8, rewinds) for a in (8, 7, 6, 2, 1, 0, 3, 5)] == [0, 1, 2, 2, 3, 4, None, None]
    # a second rewind, at 10, to step 7's weights (a canary of the new line promoted, then a later one rolled back)
    assert [staleness(a, 11, {6: 2, 10: 7}) for a in (11, 7, 6, 2, 8, 4)] == [0, 1, 2, 2, None, None]
    assert staleness(5, 5, {}) == 0 and staleness(6, 5, {}) is None  # a later step than the current one
    assert staleness(0, 4, {3: 0}) == 1  # a rewind to the base model (step 0)

    production = logged(store, step=2)  # via calc@production, answered by step 2
    canary = logged(store, model="calc@canary", step=5)
    assert take(store, [production, canary], step=6).left_out == {"stale": 1}  # by step distance: 4 and 1 steps
    found = take(store, [production, canary], step=6, rewinds=rewinds)
    assert found.answered == {production: 2} and found.left_out == {LeftOut.rolled_back.value: 1}
    # the loop's used episodes once step 7 trains: kept while fresh along the line, a rolled-back line's dropped
    kept = take(store, [], step=6, rewinds=rewinds, used={"p-earlier": 2, "c-earlier": 5, "old": 1})
    assert kept.used == {"p-earlier": 2, "old": 1}
    assert take(store, [], step=8, rewinds=rewinds, used={"p-earlier": 2, "old": 1}).used == {}  # 3 and 4 steps
