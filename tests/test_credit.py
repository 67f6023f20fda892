"""Credit assignment (returns and advantages per mode), AIR on hand-built trajectories, and a real train step with
per-turn advantages."""

from __future__ import annotations

import pytest
import torch
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)
from pydantic import ValidationError

import flywheel as art
from flywheel.agents import AIRConfig, air_rewards, apply_air
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.train.batch import pack, trajectory_sequences
from flywheel.train.config import TrainConfig
from flywheel.train.credit import (
    credit_advantages,
    set_turn_rewards,
    step_rewards,
    total_reward,
    turn_advantages,
    turn_returns,
    turn_rewards,
)
from flywheel.train.loss import advantages

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def turn(
    text: str = "", tool_calls: list[tuple[str, str]] = (), statuses: list[str] | None = None, ids: str = "c"
) -> Choice:
    calls = [
        ChatCompletionMessageFunctionToolCall(id=f"{ids}{i}", type="function", function=Function(name=n, arguments=a))
        for i, (n, a) in enumerate(tool_calls)
    ]
    choice = Choice(
        index=0,
        finish_reason="stop",
        message=ChatCompletionMessage(role="assistant", content=text or None, tool_calls=calls or None),
    )
    if statuses is not None:
        choice.tool_statuses = statuses
    return choice


def episode(n_turns: int, reward: float, intermediate: list[float] | None = None) -> art.Trajectory:
    items: list = [{"role": "user", "content": "q"}]
    for i in range(n_turns):
        items += [turn(f"t{i}"), {"role": "user", "content": "more"}]
    traj = art.Trajectory(messages_and_choices=items[:-1], reward=reward)
    if intermediate is not None:
        set_turn_rewards(traj, intermediate)
    return traj


# ---- returns ----------------------------------------------------------------------------------------------------


def test_step_rewards_put_the_outcome_on_the_last_turn_and_returns_discount():
    traj = episode(3, reward=1.0, intermediate=[0.1, 0.0, 0.05])
    assert turn_rewards(traj) == [0.1, 0.0, 0.05]
    assert step_rewards(traj) == [0.1, 0.0, 1.05]
    assert turn_returns(traj, gamma=1.0) == pytest.approx([1.15, 1.05, 1.05])
    assert turn_returns(traj, gamma=0.5) == pytest.approx([0.1 + 0.5 * (0.0 + 0.5 * 1.05), 0.5 * 1.05, 1.05])
    assert total_reward(traj) == pytest.approx(1.15)


def test_turn_rewards_travel_with_the_choices_through_json():
    traj = episode(2, reward=1.0, intermediate=[0.1, 0.2])
    again = art.Trajectory.model_validate_json(traj.model_dump_json())
    assert turn_rewards(again) == [0.1, 0.2]


def test_turn_rewards_must_fit_the_turns_and_be_finite():
    traj = episode(2, reward=0.0)
    with pytest.raises(ValueError, match="has 2 sampled turns but 3 turn rewards"):
        set_turn_rewards(traj, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="turn reward 1 .* was nan"):
        set_turn_rewards(traj, [0.0, float("nan")])


# ---- advantages per mode ------------------------------------------------------------------------------------------


def test_uniform_without_intermediate_rewards_is_exactly_grpo():
    groups = [art.TrajectoryGroup([episode(2, r) for r in (1.0, 0.0, 0.0, 0.5)])]
    expected = advantages([[1.0, 0.0, 0.0, 0.5]], "grpo", True)
    assert credit_advantages(groups, TrainConfig()) == expected  # bit for bit
    expected_rloo = advantages([[1.0, 0.0, 0.0, 0.5]], "rloo", True)
    assert credit_advantages(groups, TrainConfig(advantage="rloo")) == expected_rloo


def test_uniform_with_intermediate_rewards_ranks_by_total_reward():
    group = art.TrajectoryGroup([episode(2, 0.0, [0.1, 0.0]), episode(2, 0.0, [0.0, 0.0])])
    ((a, b),) = credit_advantages([group], TrainConfig(scale_rewards=False))
    assert (a, b) == pytest.approx((0.05, -0.05))


def test_turn_credit_by_turn_index():
    # A: 2 turns, solved; B: 1 turn, failed; C: 2 turns, failed. gamma 1, no intermediate rewards.
    group = [episode(2, 1.0), episode(1, 0.0), episode(2, 0.0)]
    raw = turn_advantages(group, gamma=1.0, norm="index", scale=False)
    # turn 0: returns 1, 0, 0 (mean 1/3); turn 1: only A and C reached it: 1, 0 (mean 1/2)
    assert raw == [pytest.approx([2 / 3, 1 / 2]), pytest.approx([-1 / 3]), pytest.approx([-1 / 3, -1 / 2])]
    scaled = turn_advantages(group, gamma=1.0, norm="index", scale=True)
    residuals = [x for g in raw for x in g]
    std = (sum(x * x for x in residuals) / len(residuals)) ** 0.5  # one std for the whole group, not per index
    assert [x for g in scaled for x in g] == pytest.approx([x / std for x in residuals], rel=1e-5)


def test_turn_credit_over_all_turns():
    group = [episode(2, 1.0), episode(1, 0.0), episode(2, 0.0)]
    raw = turn_advantages(group, gamma=1.0, norm="all", scale=False)
    # five turns with returns 1, 1, 0, 0, 0: mean 0.4
    assert raw == [pytest.approx([0.6, 0.6]), pytest.approx([-0.4]), pytest.approx([-0.4, -0.4])]


def test_turn_credit_sends_an_intermediate_reward_to_its_turn_only():
    # same outcome; A's first turn earned 0.1 that B's did not: only turn 0 differs
    group = [episode(2, 1.0, [0.1, 0.0]), episode(2, 1.0, [0.0, 0.0])]
    (a0, a1), (b0, b1) = turn_advantages(group, gamma=1.0, norm="index", scale=False)
    assert (a0, b0) == pytest.approx((0.05, -0.05)) and (a1, b1) == (0.0, 0.0)


def test_turn_credit_reduces_to_grpo_without_intermediate_rewards():
    rewards = [1.0, 0.0, 0.0, 0.5]
    group = art.TrajectoryGroup([episode(3, r) for r in rewards])
    config = TrainConfig(credit="turn")
    (per_turn,) = credit_advantages([group], config)
    (grpo,) = advantages([rewards], "grpo", True)
    for turns, a in zip(per_turn, grpo):
        assert turns == pytest.approx([a] * 3, rel=1e-6)


def test_turn_credit_refuses_other_estimators():
    with pytest.raises(ValidationError, match="credit='turn' computes its own per-turn group baselines"):
        TrainConfig(credit="turn", advantage="rloo")


def test_per_turn_advantages_reach_each_turns_tokens(tokenizer):
    items = [
        {"role": "user", "content": "q"},
        turn("a"),
        {"role": "tool", "tool_call_id": "c", "content": "r"},
        turn("b"),
    ]
    items[1].prompt_token_ids, items[1].token_ids = [1, 2, 3], [4, 5]
    items[3].prompt_token_ids, items[3].token_ids = [1, 2, 3, 4, 5, 6], [7, 8, 9]
    traj = art.Trajectory(messages_and_choices=items)
    (seq,) = trajectory_sequences(traj, tokenizer, [0.25, -1.0])
    (mb,) = pack([seq], max_tokens=64)
    assert mb.targets.tolist() == [4, 5, 7, 8, 9]
    assert mb.advantages.tolist() == [0.25, 0.25, -1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="has 2 sampled turns but 1 turn advantages"):
        trajectory_sequences(traj, tokenizer, [0.5])


# ---- AIR --------------------------------------------------------------------------------------------------------


def calc_episode(*turns: Choice, reward: float = 0.0) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, *turns], tools=[CALC], reward=reward)


def test_air_rewards_well_formed_executed_and_penalises_repeats():
    traj = calc_episode(
        turn(tool_calls=[("calc", '{"e": "1+1"}')], statuses=["ok"]),
        turn(tool_calls=[("calc", '{"e": "1+1"}'), ("nope", "{}")], statuses=["ok", "unknown_tool"]),
        turn(tool_calls=[("calc", '{"e": 2}')], statuses=["bad_arguments"]),
        turn(tool_calls=[("calc", '{"e": "9/0"}')], statuses=["error"]),
        turn("Answer: 2"),
    )
    config = AIRConfig(well_formed=0.05, executed=0.05, repeated=0.05, cap=0.45)
    assert air_rewards(traj, config) == pytest.approx(
        [
            0.1,  # well-formed and executed
            (0.05 * 1 + 0.05 * 1 - 0.05 * 1) / 2,  # averaged over the turn's two calls: one repeat, one unknown tool
            0.0,  # schema failure
            0.05,  # well-formed, failed
            0.0,  # the answer
        ]
    )


def test_air_cap_bounds_the_running_total_so_spam_earns_nothing_more():
    spam = calc_episode(*(turn(tool_calls=[("calc", f'{{"e": "{i}"}}')], statuses=["ok"]) for i in range(10)))
    rewards = air_rewards(spam, AIRConfig(cap=0.2))
    assert sum(rewards) == pytest.approx(0.2) and rewards[2:] == pytest.approx([0.0] * 8)
    repeats = calc_episode(*(turn(tool_calls=[("calc", '{"e": "1"}')], statuses=["ok"]) for _ in range(20)))
    assert sum(air_rewards(repeats, AIRConfig(repeated=0.5, cap=0.2))) == pytest.approx(-0.2)


def test_air_keeps_the_outcome_dominant():
    best_spammer = calc_episode(
        *(turn(tool_calls=[("calc", f'{{"e": "{i}"}}')], statuses=["ok"]) for i in range(9)), reward=0.0
    )
    worst_solver = calc_episode(
        *(turn(tool_calls=[("calc", '{"e": "1"}')], statuses=["ok"]) for _ in range(9)), reward=1.0
    )
    for traj in (best_spammer, worst_solver):
        apply_air(traj, AIRConfig())
    assert total_reward(worst_solver) > total_reward(best_spammer)
    with pytest.raises(ValidationError, match="use cap < 0.5"):
        AIRConfig(cap=0.5)


def test_air_reads_other_loops_trajectories_from_their_messages():
    """No tool_statuses recorded (a hand-written loop): unknown names, non-JSON arguments and "Error" replies show."""
    traj = calc_episode(
        turn(tool_calls=[("calc", '{"e": "1"}')], ids="a"),
        {"role": "tool", "tool_call_id": "a0", "content": "1"},
        turn(tool_calls=[("calc", '{"e": "x"}')], ids="b"),
        {"role": "tool", "tool_call_id": "b0", "content": "Error: unknown name 'x'"},
        turn(tool_calls=[("other", "{}")], ids="c"),
        {"role": "tool", "tool_call_id": "c0", "content": "Error: no such tool"},
        turn(tool_calls=[("calc", "not json")], ids="d"),
    )
    # executed; well-formed but failed; unknown tool; arguments not JSON (and never answered)
    assert air_rewards(traj, AIRConfig(cap=0.4)) == pytest.approx([0.1, 0.05, 0.0, 0.0])


# ---- a real step ------------------------------------------------------------------------------------------------


async def test_a_train_step_with_turn_credit_trains_per_turn_advantages(tmp_path):
    backend = art.LocalBackend(path=tmp_path, serve_http=False)
    try:
        model = art.TrainableModel(name="credit", project="tests", base_model=EMBEDDED_MODEL)
        await model.register(backend)
        trainer = backend.trainer(model)
        before = trainer.adapter_state()
        group = art.TrajectoryGroup([episode(2, 1.0, [0.05, 0.0]), episode(2, 0.0, [0.0, 0.0]), episode(1, 0.0)])
        metrics = await model.train([group], TrainConfig(credit="turn", learning_rate=1e-3))
        assert metrics["skipped"] == 0.0 and metrics["sequences"] >= 2
        assert 0.0 < metrics["entropy"]  # logged per step: the exploration signal
        after = trainer.adapter_state()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert backend.history(model)[-1]["entropy"] == metrics["entropy"]
    finally:
        await backend.close()
