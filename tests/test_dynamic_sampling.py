"""Dynamic sampling's bookkeeping (issue #38): it draws until the step has its mixed-outcome groups, within its
bounds on draws and time, draws each item once, and ends with a clear message when the pool has none left. The
rollouts are toy coroutines with scripted rewards: what is tested is the drawing, not a model."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from flywheel.agents.dynamic_sampling import (
    DynamicSampler,
    DynamicSamplingConfig,
    MixedGroups,
    NoMixedGroupsError,
    gather_mixed_groups,
)
from flywheel.train.credit import has_reward_variance
from flywheel.types import Trajectory, TrajectoryGroup

USER = {"role": "user", "content": "2 + 2?"}


async def attempt(item: int, reward: float, seconds: float = 0.0) -> Trajectory:
    await asyncio.sleep(seconds)
    return Trajectory(messages_and_choices=[USER], reward=reward, metadata={"item": item})


class Pool:
    """Items 0, 1, ...: item i's group is mixed when ``mixed(i)``, else all its rewards are 1. Counts the items
    drawn from it."""

    def __init__(self, mixed, size: int | None = None, seconds: float = 0.0):
        self.mixed, self.size, self.seconds, self.drawn = mixed, size, seconds, 0

    def groups(self):
        for i in itertools.count() if self.size is None else range(self.size):
            self.drawn += 1
            rewards = [0.0, 1.0, 1.0] if self.mixed(i) else [1.0, 1.0, 1.0]
            yield TrajectoryGroup(attempt(i, r, self.seconds) for r in rewards)


def items(groups: list[TrajectoryGroup]) -> list[int]:
    return [g.trajectories[0].metadata["item"] for g in groups]


async def test_it_draws_until_the_step_has_its_mixed_groups_and_reports_what_it_dropped():
    pool = Pool(lambda i: i % 3 == 0)  # a third of the groups have mixed outcomes
    result = await gather_mixed_groups(pool.groups(), 4, pbar_desc=None)
    assert len(result.kept) >= 4 and all(has_reward_variance(g) for g in result.kept)
    assert all(not has_reward_variance(g) for g in result.dropped) and result.dropped
    assert result.drawn == pool.drawn == len(result.kept) + len(result.dropped)  # every group drawn is accounted
    assert sorted(items(result.kept) + items(result.dropped)) == list(range(pool.drawn))  # each item once
    assert result.stop == "full" and result.waves >= 2  # the first wave (1.5 x 4) cannot hold 4 of 1 in 3
    metrics = result.metrics()
    assert metrics.pop("rollout_seconds") >= 0 and metrics.pop("score_seconds") >= 0  # of every group drawn
    assert metrics == {
        "groups_drawn": result.drawn, "groups_kept": len(result.kept), "groups_dropped": len(result.dropped),
        "sampling_waves": result.waves, "sampling_short": 0.0,
        "drawn_reward_mean": (2 * len(result.kept) + 3 * len(result.dropped)) / (3 * result.drawn),
        "kept_mixed_in_half": 1.0,  # each kept group's first 2 of 3 rollouts: rewards 0 and 1
    }  # fmt: skip


async def test_a_sampler_sizes_its_waves_from_what_it_kept_and_never_draws_an_item_twice():
    pool = Pool(lambda i: i % 2 == 0)
    source = pool.groups()
    sampler = DynamicSampler(DynamicSamplingConfig(max_draws=8))
    first = await sampler.draw(source, 4, pbar_desc=None)
    assert sampler.drawn == first.drawn and 0.3 < sampler.keep_rate() < 0.7
    second = await sampler.draw(source, 4, pbar_desc=None)
    assert second.waves == 1 and len(second.kept) >= 4  # 4 / 0.5 drawn at once: enough in one wave
    seen = items(first.kept + first.dropped + second.kept + second.dropped)
    assert len(seen) == len(set(seen)) == pool.drawn  # nothing drawn (so nothing trained) twice


async def test_tries_are_bounded_when_no_group_has_mixed_outcomes():
    pool = Pool(lambda i: False)  # endless, and never a mixed group
    result = await gather_mixed_groups(pool.groups(), 3, config=DynamicSamplingConfig(max_draws=2), pbar_desc=None)
    assert result.stop == "max_draws" and result.kept == [] and result.drawn == pool.drawn == 6
    assert result.metrics()["sampling_short"] == 1.0 and "kept_mixed_in_half" not in result.metrics()


async def test_time_is_bounded_between_waves():
    pool = Pool(lambda i: False, seconds=0.2)
    config = DynamicSamplingConfig(max_draws=1000, max_seconds=0.3)
    started = time.monotonic()
    result = await gather_mixed_groups(pool.groups(), 2, config=config, pbar_desc=None)
    assert result.stop == "max_seconds" and result.kept == [] and 2 <= result.waves <= 3
    assert result.metrics()["rollout_seconds"] >= 0.2 * result.waves * 0.9  # the dropped groups' time counts
    assert time.monotonic() - started < 0.3 + 3 * 0.2  # the wave in flight finishes, no new one starts


async def test_a_pool_without_mixed_groups_ends_with_a_clear_message():
    pool = Pool(lambda i: False, size=5)
    with pytest.raises(NoMixedGroupsError, match="ran dry after 5 groups this step, none with mixed outcomes"):
        await gather_mixed_groups(pool.groups(), 2, config=DynamicSamplingConfig(max_draws=10), pbar_desc=None)


async def test_a_pool_that_runs_dry_gives_what_it_had():
    pool = Pool(lambda i: i == 1, size=4)
    result = await gather_mixed_groups(pool.groups(), 3, config=DynamicSamplingConfig(max_draws=10), pbar_desc=None)
    assert result.stop == "exhausted" and items(result.kept) == [1] and len(result.dropped) == 3


async def test_a_keep_rule_of_ones_own():
    pool = Pool(lambda i: i % 2 == 0)
    # keep only groups whose mean reward is below 1: here the mixed ones again, by another rule
    result = await gather_mixed_groups(
        pool.groups(), 2, keep=lambda g: sum(t.reward for t in g.trajectories) < len(g.trajectories), pbar_desc=None
    )
    assert all(i % 2 == 0 for i in items(result.kept)) and all(i % 2 for i in items(result.dropped))


def test_the_config_refuses_bounds_that_cannot_work():
    with pytest.raises(ValueError, match="max_draws"):
        DynamicSamplingConfig(max_draws=0.5)
    with pytest.raises(ValueError, match="max_seconds"):
        DynamicSamplingConfig(max_seconds=0)


def test_kept_mixed_in_half_is_the_share_of_kept_groups_whose_first_half_already_differs():
    def group(*rewards: float) -> TrajectoryGroup:
        return TrajectoryGroup([Trajectory(messages_and_choices=[USER], reward=r) for r in rewards])

    kept = [group(1, 1, 0, 0), group(0, 1, 1, 1), group(1, 1, 1, 0, 1)]  # first halves: 1 1 | 0 1 | 1 1 1
    assert MixedGroups(kept, [], 3, 1, "full").metrics()["kept_mixed_in_half"] == pytest.approx(1 / 3)
