"""gather_trajectory_groups / gather_trajectories with plain async rollouts (no model needed)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import traceback

import pytest

from flywheel.gather import _covered, gather_trajectories, gather_trajectory_groups, phase_seconds
from flywheel.types import Trajectory, TrajectoryGroup

USER = {"role": "user", "content": "q"}


class Flaky(Exception):
    pass


class Counter:
    """Counts rollouts in flight (and the most at once), and which ones were cancelled."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self.cancelled: list[float] = []

    async def rollout(self, reward: float, *, fail: bool = False, delay: float = 0.01) -> Trajectory:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(delay)
            if fail:
                raise Flaky(f"rollout with reward {reward} failed")
            return Trajectory(messages_and_choices=[USER], reward=reward, metrics={"solved": reward > 0})
        except asyncio.CancelledError:
            self.cancelled.append(reward)
            raise
        finally:
            self.now -= 1


async def test_groups_come_back_in_input_order():
    c = Counter()
    # Later groups and later rollouts finish first.
    groups = await gather_trajectory_groups(
        [TrajectoryGroup(c.rollout(g * 10 + i, delay=0.05 - 0.01 * (g + i)) for i in range(3)) for g in range(3)],
        pbar_desc=None,
    )
    assert [[t.reward for t in g] for g in groups] == [[0, 1, 2], [10, 11, 12], [20, 21, 22]]


def test_covered_time_is_the_union_of_intervals():
    assert _covered([]) == 0.0
    assert _covered([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == 3.0


async def test_phase_seconds_count_concurrent_groups_once():
    c = Counter()

    async def score(group: TrajectoryGroup) -> TrajectoryGroup:
        await asyncio.sleep(0.1)
        return group

    # four groups roll out (0.2 s) and are scored (0.1 s) concurrently: about 0.2 s and 0.1 s of wall time, not 4x
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(c.rollout(i, delay=0.2) for i in range(3)) for _ in range(4)), pbar_desc=None, after_each=score
    )
    phases = phase_seconds(groups)
    assert 0.2 <= phases["rollout_seconds"] < 0.6
    assert 0.1 <= phases["score_seconds"] < 0.3
    assert phase_seconds([TrajectoryGroup([Trajectory(messages_and_choices=[USER])])]) == {}  # not gathered


@pytest.mark.parametrize("limit, peak", [(3, 3), (None, 20)])
async def test_concurrency_limit_applies_to_rollouts(limit: int | None, peak: int):
    c = Counter()
    groups = await gather_trajectory_groups(
        (TrajectoryGroup(c.rollout(i) for i in range(4)) for _ in range(5)), pbar_desc=None, max_concurrency=limit
    )
    assert sum(len(g) for g in groups) == 20
    assert c.peak == peak


async def test_exceptions_within_the_budget_are_recorded_on_their_group():
    c = Counter()
    groups = await gather_trajectory_groups(
        [
            TrajectoryGroup([c.rollout(1), c.rollout(2, fail=True)]),
            TrajectoryGroup([c.rollout(3), c.rollout(4)]),
            TrajectoryGroup([c.rollout(5, fail=True)]),  # every rollout failed: still returned
        ],
        pbar_desc=None,
        max_exceptions=2,
    )
    assert [[t.reward for t in g] for g in groups] == [[1], [3, 4], []]
    assert [[e.type for e in g.exceptions] for g in groups] == [["Flaky"], [], ["Flaky"]]
    assert isinstance(groups[2]._original_exceptions[0], Flaky)


async def test_one_exception_over_the_budget_raises_the_original_and_stops_everything():
    c = Counter()
    slow = [c.rollout(3, delay=5) for _ in range(4)]  # with 2 slots, some of these never start
    before = asyncio.all_tasks()
    with pytest.raises(Flaky, match="reward 2 failed") as err:
        await gather_trajectory_groups(
            [
                TrajectoryGroup([c.rollout(1, fail=True, delay=0.01), c.rollout(2, fail=True, delay=0.02)]),
                TrajectoryGroup(slow),
            ],
            pbar_desc=None,
            max_exceptions=1,
            max_concurrency=2,
        )
    frames = [frame.name for frame in traceback.extract_tb(err.value.__traceback__)]
    assert frames[-1] == "rollout"  # the traceback still ends where the rollout raised
    assert 1 <= len(c.cancelled) < 4 and c.now == 0  # the started slow ones were cancelled, not left running
    assert asyncio.all_tasks() == before  # no task of the gather outlives it
    # Closed, including those that never started: none will warn "coroutine ... was never awaited".
    assert {inspect.getcoroutinestate(rollout) for rollout in slow} == {inspect.CORO_CLOSED}


async def test_fractional_budget_is_a_share_of_all_rollouts():
    c = Counter()
    # 1 failure in 10 rollouts is within 0.1 of them; 2 are not.
    (group,) = await gather_trajectory_groups(
        [TrajectoryGroup(c.rollout(i, fail=i == 0) for i in range(10))], pbar_desc=None, max_exceptions=0.1
    )
    assert len(group) == 9 and len(group.exceptions) == 1
    with pytest.raises(Flaky):
        await gather_trajectory_groups(
            [TrajectoryGroup(c.rollout(i, fail=i < 2) for i in range(10))], pbar_desc=None, max_exceptions=0.1
        )


async def test_after_each_can_keep_drop_split_or_be_async():
    c = Counter()

    def judge(group: TrajectoryGroup) -> TrajectoryGroup | list[TrajectoryGroup] | None:
        first = group.trajectories[0].reward
        if first == 0:
            return None  # dropped
        if first == 10:
            return [group, TrajectoryGroup(group.trajectories[:1])]  # both kept, in its place
        return group

    async def async_judge(group: TrajectoryGroup) -> TrajectoryGroup | list[TrajectoryGroup] | None:
        await asyncio.sleep(0.01)
        kept = judge(group)
        for t in group.trajectories:
            t.reward *= 2
        return kept

    for after_each, factor in ((judge, 1), (async_judge, 2)):
        groups = await gather_trajectory_groups(
            [TrajectoryGroup(c.rollout(base + i) for i in range(2)) for base in (0, 10, 20)],
            pbar_desc=None,
            after_each=after_each,
        )
        expected = [[10, 11], [10], [20, 21]] if factor == 1 else [[20, 22], [20], [40, 42]]
        assert [[t.reward for t in g] for g in groups] == expected


async def test_after_each_errors_name_the_group():
    c = Counter()

    def broken(group: TrajectoryGroup) -> TrajectoryGroup:
        if group.trajectories[0].reward == 2:
            raise ValueError("judge returned garbage")
        return group

    with pytest.raises(RuntimeError, match="after_each failed on group 1: ValueError") as err:
        await gather_trajectory_groups(
            [TrajectoryGroup([c.rollout(1)]), TrajectoryGroup([c.rollout(2)])], pbar_desc=None, after_each=broken
        )
    assert isinstance(err.value.__cause__, ValueError)


async def test_awaitables_that_make_groups():
    c, d = Counter(), Counter()

    async def pending_group() -> TrajectoryGroup:
        return TrajectoryGroup(c.rollout(i) for i in (1, 2))

    async def finished_group() -> TrajectoryGroup:
        return await TrajectoryGroup(d.rollout(i) for i in (3, 4))

    async def broken_group() -> TrajectoryGroup:
        raise Flaky("could not load the scenario")

    groups = await gather_trajectory_groups(
        [pending_group(), finished_group(), broken_group()], pbar_desc=None, max_exceptions=1, max_concurrency=1
    )
    assert [[t.reward for t in g] for g in groups] == [[1, 2], [3, 4], []]
    assert groups[2].exceptions[0].message == "could not load the scenario"
    # The limit covers the rollouts gather runs, not those an awaitable runs itself.
    assert (c.peak, d.peak) == (1, 2)


async def test_progress_bar_shows_reward_mean_metrics_and_exceptions(capsys: pytest.CaptureFixture[str]):
    c = Counter()
    await gather_trajectory_groups(
        [TrajectoryGroup([c.rollout(1), c.rollout(0), c.rollout(9, fail=True)])], pbar_desc="rollouts", max_exceptions=1
    )
    final = capsys.readouterr().err.strip().split("\r")[-1]
    assert final.startswith("rollouts") and "3/3" in final
    assert "reward=0.5" in final and "solved=0.5" in final and "exceptions=1" in final


async def test_gather_trajectories_returns_results_in_order_failures_in_place(caplog: pytest.LogCaptureFixture):
    c = Counter()
    with caplog.at_level(logging.WARNING, logger="flywheel.gather"):
        trajectories = await gather_trajectories(
            [c.rollout(1, delay=0.03), c.rollout(2, fail=True), c.rollout(3, delay=0.01)],
            pbar_desc=None,
            max_exceptions=1,
        )
    first, failed, third = trajectories  # as ART: the exception in the failed rollout's place
    assert isinstance(failed, Flaky) and [first.reward, third.reward] == [1, 3]  # type: ignore[union-attr]
    assert "rollout with reward 2 failed" in caplog.text
    with pytest.raises(Flaky):
        await gather_trajectories([c.rollout(2, fail=True)], pbar_desc=None)
