"""gather_trajectory_groups / gather_trajectories with plain async rollouts (no model needed)."""

from __future__ import annotations

import asyncio
import traceback

import pytest

import flywheel as art

USER = {"role": "user", "content": "q"}


class Flaky(Exception):
    pass


def make_rollout(state: dict | None = None):
    async def rollout(reward: float, *, fail: bool = False, delay: float = 0.01) -> art.Trajectory:
        if state is not None:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        try:
            await asyncio.sleep(delay)
            if fail:
                raise Flaky(f"rollout with reward {reward} failed")
            return art.Trajectory(messages_and_choices=[USER], reward=reward)
        finally:
            if state is not None:
                state["now"] -= 1

    return rollout


async def test_groups_come_back_in_order_with_all_trajectories():
    rollout = make_rollout()
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(g * 10 + i, delay=0.03 - 0.01 * g) for i in range(3)) for g in range(3)],
        pbar_desc=None,
    )
    assert [sorted(t.reward for t in g) for g in groups] == [[0, 1, 2], [10, 11, 12], [20, 21, 22]]


async def test_concurrency_limit_is_enforced():
    state = {"now": 0, "peak": 0}
    rollout = make_rollout(state)
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(i) for i in range(4)) for _ in range(5)), pbar_desc=None, max_concurrency=3
    )
    assert sum(len(g) for g in groups) == 20
    assert state["peak"] == 3


async def test_exceptions_within_the_budget_are_recorded_on_their_group():
    rollout = make_rollout()
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(1), rollout(2, fail=True)]), art.TrajectoryGroup([rollout(3), rollout(4)])],
        pbar_desc=None,
        max_exceptions=1,
    )
    assert [t.reward for t in groups[0]] == [1]
    assert groups[0].exceptions[0].type == "Flaky"
    assert groups[1].exceptions == [] and len(groups[1]) == 2


async def test_one_exception_over_the_budget_raises_the_original_with_its_traceback():
    rollout = make_rollout()
    with pytest.raises(Flaky) as err:
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup([rollout(1, fail=True), rollout(2, fail=True), rollout(3, delay=5)])],
            pbar_desc=None,
            max_exceptions=1,
        )
    frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert "rollout" in frames


async def test_fractional_budget():
    rollout = make_rollout()
    # 1 failure out of 10 rollouts is within 0.1 * 10; 2 failures are not
    ok = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(i, fail=i == 0) for i in range(10)])], pbar_desc=None, max_exceptions=0.1
    )
    assert len(ok[0]) == 9
    with pytest.raises(Flaky):
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup([rollout(i, fail=i < 2) for i in range(10)])], pbar_desc=None, max_exceptions=0.1
        )


async def test_after_each_can_keep_drop_split_or_be_async():
    rollout = make_rollout()

    async def judge(group: art.TrajectoryGroup):
        first = group.trajectories[0].reward
        if first == 0:
            return None  # dropped
        if first == 10:
            return [group, art.TrajectoryGroup(group.trajectories[:1])]  # both kept, in place
        for t in group.trajectories:
            t.reward = t.reward * 2
        return group

    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(base + i) for i in range(2)]) for base in (0, 10, 20)],
        pbar_desc=None,
        after_each=judge,
    )
    assert [[t.reward for t in g] for g in groups] == [[10, 11], [10], [40, 42]]


async def test_after_each_errors_name_the_group():
    rollout = make_rollout()

    def broken(group):
        raise ValueError("judge returned garbage")

    with pytest.raises(RuntimeError, match="after_each failed on group 0: judge returned garbage"):
        await art.gather_trajectory_groups([art.TrajectoryGroup([rollout(1)])], pbar_desc=None, after_each=broken)


async def test_gather_trajectories_skips_failures_within_budget():
    rollout = make_rollout()
    trajs = await art.gather_trajectories(
        [rollout(1), rollout(2, fail=True), rollout(3)], pbar_desc=None, max_exceptions=1
    )
    assert [t.reward for t in trajs] == [1, 3]
