"""Trajectory types: the seed snippets' shapes, JSON round trips, refusal of non-finite rewards, pending groups."""

from __future__ import annotations

import asyncio
import math

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from flywheel.types import History, PydanticException, Trajectory, TrajectoryGroup

SYSTEM = {"role": "system", "content": "You are a RAG-based support agent."}
USER = {"role": "user", "content": "What is the refund policy?"}


def choice(content: str = "Refunds within 30 days.") -> Choice:
    return Choice(finish_reason="stop", index=0, message=ChatCompletionMessage(role="assistant", content=content))


def test_seed_snippet_shape_and_messages():
    traj = Trajectory(messages_and_choices=[SYSTEM, USER, choice()], reward=0.0)
    assert isinstance(traj.messages_and_choices[2], Choice)
    assert traj.messages() == [SYSTEM, USER, {"role": "assistant", "content": "Refunds within 30 days."}]
    traj.messages()[0]["content"] = "edited"  # messages() hands out copies
    assert traj.messages_and_choices[0] == SYSTEM
    traj.reward += 1.0  # the seed's pattern of layering an extra reward on top
    assert traj.reward == 1.0
    assert "reward=1" in str(traj) and "3 turns (1 sampled)" in str(traj)
    other = Trajectory(messages_and_choices=[])
    assert len(other.id) == 32 and other.id != traj.id


def test_tool_calls_become_plain_dicts_in_messages():
    call = ChatCompletionMessageToolCall(
        id="call_1", type="function", function={"name": "calculator", "arguments": '{"expression": "1+1"}'}
    )
    c = Choice(
        finish_reason="tool_calls",
        index=0,
        message=ChatCompletionMessage(role="assistant", content=None, tool_calls=[call]),
    )
    tool_reply = {"role": "tool", "tool_call_id": "call_1", "content": "2"}
    messages = History(messages_and_choices=[USER, c, tool_reply]).messages()
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'},
            }
        ],
    }
    assert messages[2] == tool_reply


def test_json_round_trip_keeps_choices_token_ids_and_logprobs():
    c = choice()
    c.token_ids = [5, 6, 2]  # set by our engine on the choices it serves
    c.prompt_token_ids = [1, 2, 3]
    c.logprobs = ChoiceLogprobs(content=[{"token": "R", "bytes": [82], "logprob": -0.5, "top_logprobs": []}])
    traj = Trajectory(
        messages_and_choices=[SYSTEM, USER, c],
        tools=[{"type": "function", "function": {"name": "search", "parameters": {}}}],
        additional_histories=[History(messages_and_choices=[USER, choice("side")])],
        reward=0.5,
        metrics={"turns": 1, "solved": True, "score": 0.25},
        metadata={"scenario": "refund", "seed": 3, "note": None},
        logs=["judge: ok"],
    )
    back = Trajectory.model_validate_json(traj.model_dump_json())
    assert back.model_dump() == traj.model_dump()
    restored = back.messages_and_choices[2]
    assert isinstance(restored, Choice)
    assert restored.token_ids == [5, 6, 2] and restored.prompt_token_ids == [1, 2, 3]
    assert restored.logprobs.content[0].logprob == -0.5
    assert isinstance(back.additional_histories[0].messages_and_choices[1], Choice)
    assert back.metrics == {"turns": 1, "solved": True, "score": 0.25}
    assert type(back.metrics["solved"]) is bool and type(back.metrics["turns"]) is int
    assert back.id == traj.id


def test_choice_parsed_by_the_openai_client_keeps_its_extra_fields():
    # The SDK builds responses without validation; the extras our server sends must still reach the JSON.
    response = ChatCompletion.construct(
        id="x",
        object="chat.completion",
        created=0,
        model="m",
        choices=[
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hi"},
                "logprobs": None,
                "token_ids": [7, 8],
                "prompt_token_ids": [1],
            }
        ],
    )
    traj = Trajectory(messages_and_choices=[USER, response.choices[0]])
    restored = Trajectory.model_validate_json(traj.model_dump_json()).messages_and_choices[1]
    assert isinstance(restored, Choice) and restored.token_ids == [7, 8] and restored.prompt_token_ids == [1]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused(bad: float):
    with pytest.raises(ValueError, match=r"NaN/inf"):
        Trajectory(messages_and_choices=[USER], reward=bad)
    traj = Trajectory(messages_and_choices=[USER], reward=1.0)
    with pytest.raises(ValueError, match=rf"reward was .*NaN/inf.* in trajectory {traj.id}"):
        traj.reward += bad
    assert traj.reward == 1.0  # the bad value was not stored


def test_nan_metric_is_refused_by_name():
    with pytest.raises(ValueError, match="metric 'loss' was NaN"):
        Trajectory(messages_and_choices=[USER], metrics={"loss": math.nan})
    traj = Trajectory(messages_and_choices=[USER])
    with pytest.raises(ValueError, match="metric 'acc' was NaN"):
        traj.metrics = {"acc": math.nan}


def test_items_that_are_neither_messages_nor_choices_are_refused():
    with pytest.raises(ValidationError):
        Trajectory(messages_and_choices=["just a string"])


async def rollout(i: int) -> Trajectory:
    await asyncio.sleep(0.01 * (4 - i))  # finish in reverse order: the group must still keep input order
    if i == 2:
        raise KeyError("tool exploded")
    return Trajectory(messages_and_choices=[USER, choice(str(i))], reward=i)


async def test_group_from_a_generator_of_coroutines_runs_when_awaited():
    started = Trajectory(messages_and_choices=[USER], reward=-1)
    group = TrajectoryGroup([started, *(rollout(i) for i in range(4))])
    for read in (lambda: group.trajectories, lambda: len(group), lambda: list(group)):
        with pytest.raises(RuntimeError, match="5 rollouts still pending: await it"):
            read()
    with pytest.raises(PydanticSerializationError, match="5 rollouts still pending"):
        group.model_dump_json()
    assert await group is group
    assert [t.reward for t in group] == [-1, 0, 1, 3]
    assert len(group) == 4
    assert [e.type for e in group.exceptions] == ["KeyError"]
    assert "tool exploded" in group.exceptions[0].traceback and "in rollout" in group.exceptions[0].traceback
    assert isinstance(group._original_exceptions[0], KeyError)
    assert await group is group  # awaiting again is harmless


async def test_group_refuses_a_rollout_that_returns_no_trajectory():
    async def forgot_return() -> None:
        await asyncio.sleep(0)

    with pytest.raises(TypeError, match="returned NoneType, expected a Trajectory"):
        await TrajectoryGroup([forgot_return()])


def test_group_json_round_trip_with_exceptions():
    try:
        raise ValueError("boom")
    except ValueError as exc:
        error = exc
    group = TrajectoryGroup([Trajectory(messages_and_choices=[USER, choice()], reward=1.0), error])
    assert group._original_exceptions == [error]
    back = TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert back.model_dump() == group.model_dump()
    assert isinstance(back.trajectories[0].messages_and_choices[1], Choice)
    assert back.exceptions == [PydanticException.from_exception(error)]
    assert back.exceptions[0].type == "ValueError" and back.exceptions[0].message == "boom"
    assert 'raise ValueError("boom")' in back.exceptions[0].traceback
