"""Trajectory types: the seed snippets' shapes, JSON round trips, and refusal of non-finite rewards."""

from __future__ import annotations

import asyncio
import math

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall

import flywheel as art
from flywheel.types import History, PydanticException

SYSTEM = {"role": "system", "content": "You are a RAG-based support agent."}
USER = {"role": "user", "content": "What is the refund policy?"}


def choice(content: str = "Refunds within 30 days.", **extra) -> Choice:
    c = Choice(finish_reason="stop", index=0, message=ChatCompletionMessage(role="assistant", content=content))
    for k, v in extra.items():
        setattr(c, k, v)
    return c


def test_seed_snippet_shape_and_messages():
    traj = art.Trajectory(messages_and_choices=[SYSTEM, USER, choice()], reward=0.0)
    assert traj.messages() == [SYSTEM, USER, {"role": "assistant", "content": "Refunds within 30 days."}]
    assert isinstance(traj.messages_and_choices[2], Choice)
    traj.reward += 1.0  # the seed's pattern of layering an independent reward
    assert traj.reward == 1.0
    assert "reward=1.000" in str(traj)


def test_tool_calls_become_message_dicts():
    call = ChatCompletionMessageToolCall(id="call_1", type="function", function={"name": "calculator", "arguments": '{"expression": "1+1"}'})
    c = Choice(finish_reason="tool_calls", index=0, message=ChatCompletionMessage(role="assistant", content=None, tool_calls=[call]))
    msg = art.Trajectory(messages_and_choices=[USER, c]).messages()[1]
    assert msg == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}],
    }


def test_json_round_trip_keeps_choices_token_ids_and_logprobs():
    c = choice(token_ids=[5, 6, 2], prompt_token_ids=[1, 2, 3])
    c.logprobs = ChoiceLogprobs(content=[{"token": "R", "bytes": [82], "logprob": -0.5, "top_logprobs": []}])
    traj = art.Trajectory(
        messages_and_choices=[SYSTEM, USER, c],
        additional_histories=[History(messages_and_choices=[USER, choice("side")])],
        reward=0.5, metrics={"turns": 1}, metadata={"scenario": "refund"}, logs=["judge: ok"],
    )
    back = art.Trajectory.model_validate_json(traj.model_dump_json())
    assert back.model_dump() == traj.model_dump()
    restored = back.messages_and_choices[2]
    assert isinstance(restored, Choice)
    assert restored.token_ids == [5, 6, 2] and restored.prompt_token_ids == [1, 2, 3]
    assert restored.logprobs.content[0].logprob == -0.5
    assert isinstance(back.additional_histories[0].messages_and_choices[1], Choice)
    assert back.id == traj.id


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused(bad):
    with pytest.raises(ValueError, match="reward must be a finite number"):
        art.Trajectory(messages_and_choices=[USER], reward=bad)
    traj = art.Trajectory(messages_and_choices=[USER])
    with pytest.raises(ValueError, match=traj.id):
        traj.reward += bad
    assert traj.reward == 0.0  # the bad value was not stored


def test_nan_metric_is_refused_by_name():
    with pytest.raises(ValueError, match="metric 'loss'"):
        art.Trajectory(messages_and_choices=[USER], metrics={"loss": math.nan})


def test_bad_items_are_refused():
    with pytest.raises(TypeError, match="message dicts or openai Choice"):
        art.Trajectory(messages_and_choices=["just a string"])


async def test_group_from_generator_of_coroutines_is_awaitable():
    async def rollout(i: int) -> art.Trajectory:
        await asyncio.sleep(0.01)
        if i == 2:
            raise KeyError("tool exploded")
        return art.Trajectory(messages_and_choices=[USER, choice(str(i))], reward=i)

    group = art.TrajectoryGroup(rollout(i) for i in range(4))
    with pytest.raises(RuntimeError, match="still has 4 rollouts"):
        _ = group.trajectories
    assert await group is group
    assert sorted(t.reward for t in group) == [0, 1, 3]
    assert len(group) == 3
    assert group.exceptions[0].type == "KeyError" and "tool exploded" in group.exceptions[0].traceback


def test_group_json_round_trip_with_exceptions():
    try:
        raise ValueError("boom")
    except ValueError as exc:
        error = exc
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[USER, choice()], reward=1.0), error])
    back = art.TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert [t.reward for t in back.trajectories] == [1.0]
    assert isinstance(back.trajectories[0].messages_and_choices[1], Choice)
    assert back.exceptions == [PydanticException.from_exception(error)]
    assert back.exceptions[0].message == "boom"
