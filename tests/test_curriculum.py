"""The scenario pool: success tracking, sampling that favours mixed outcomes, retiring, metrics, save/load."""

from __future__ import annotations

from collections import Counter

import pytest

import flywheel as art
from flywheel.agents import CurriculumConfig, ScenarioPool
from flywheel.examples.calculator.task import generate_problems


def pool(n: int = 6, **config) -> ScenarioPool[str]:
    return ScenarioPool([f"s{i}" for i in range(n)], CurriculumConfig(**config), key=str)


def test_sampling_favours_mixed_and_untried_scenarios():
    p = pool(3, window=10)
    p.record("s0", [1, 1, 1, 1, 1, 1, 1, 0], step=1)  # nearly always solved
    p.record("s1", [1, 0, 1, 0, 0, 1, 1, 0], step=1)  # mixed
    counts = Counter(s for _ in range(3000) for s in p.sample(1))
    # weights p(1-p) with p = (successes + 1) / (attempts + 2): s0 0.8 -> 0.16, s1 0.5 -> 0.25, s2 unseen 0.25
    assert counts["s0"] < counts["s1"] and counts["s0"] < counts["s2"]
    assert counts["s0"] / 3000 == pytest.approx(0.16 / 0.66, abs=0.04)


def test_sample_draws_distinct_active_scenarios_and_is_seeded():
    assert sorted(pool().sample(6)) == [f"s{i}" for i in range(6)]
    assert len(pool().sample(100)) == 6  # never more than there are
    assert pool(seed=3).sample(3) == pool(seed=3).sample(3)


def test_always_and_never_solved_scenarios_retire_after_the_window():
    p = pool(3, window=2)
    for step in (1, 2):
        p.record("s0", [1.0, 1.0], step)
        p.record("s1", [0.0, 0.0], step)
        p.record("s2", [1.0, 0.0], step)
    assert p.stats["s0"].retired == "solved" and p.stats["s1"].retired == "unsolved"
    assert p.stats["s2"].retired is None and p.active() == ["s2"]
    assert set(p.sample(3)) == {"s2"}
    assert p.metrics() == {
        "pool/active": 1,
        "pool/unseen": 0,
        "pool/retired_solved": 1,
        "pool/retired_unsolved": 1,
        "pool/mixed_fraction": 1.0,
        "pool/success_mean": 0.5,
    }


def test_one_mixed_group_in_the_window_keeps_a_scenario():
    p = pool(1, window=3)
    for step, rewards in enumerate([[1, 1], [1, 0], [1, 1]], start=1):
        p.record("s0", rewards, step)
    assert p.stats["s0"].retired is None
    p.record("s0", [1, 1], 4)
    p.record("s0", [1, 1], 5)  # now the last three groups were all solved
    assert p.stats["s0"].retired == "solved"


def test_success_threshold_decides_what_counts_as_solved():
    p = pool(1, window=1, success_threshold=0.5)
    p.record("s0", [0.6, 0.9], step=1)
    assert p.stats["s0"].retired == "solved"


def test_retired_scenarios_come_back_after_retry_after_steps():
    p = pool(2, window=1, retry_after=3)
    p.record("s0", [0.0, 0.0], step=1)
    p.record("s1", [0.0, 1.0], step=3)
    assert p.sample(2) == ["s1"]
    p.record("s1", [0.0, 1.0], step=4)
    assert sorted(p.sample(2)) == ["s0", "s1"] and p.stats["s0"].groups == []  # a fresh start


def test_record_groups_pairs_scenarios_with_groups_and_tracks_problems_by_id():
    problems = generate_problems("train", 2, levels=(1,))
    p = ScenarioPool(problems, CurriculumConfig(window=1))
    groups = [
        art.TrajectoryGroup([art.Trajectory(messages_and_choices=[], reward=r) for r in rs]) for rs in ([1, 1], [0, 1])
    ]
    p.record_groups(problems, groups, step=1)
    assert p.stats[problems[0].id].retired == "solved" and p.sample(2) == [problems[1]]
    with pytest.raises(ValueError, match="2 scenarios but 1 groups"):
        p.record_groups(problems, groups[:1], step=2)


def test_bad_pools_and_ids_are_refused():
    with pytest.raises(ValueError, match="share the id 's0'"):
        ScenarioPool(["s0", "s0"], key=str)
    with pytest.raises(ValueError, match="at least one scenario"):
        ScenarioPool([], key=str)
    with pytest.raises(KeyError, match="scenario 'zz' is not in this pool"):
        pool().record("zz", [1.0])


def test_save_and_load_resume_the_tracking(tmp_path):
    p = pool(3, window=2)
    p.record("s0", [1, 1], 1)
    p.record("s0", [1, 1], 2)
    p.record("s1", [0, 1], 2)
    p.save(tmp_path / "pool.json")
    resumed = pool(3)
    resumed.load(tmp_path / "pool.json")
    assert resumed.config.window == 2 and resumed.step == 2
    assert resumed.stats == p.stats and resumed.metrics() == p.metrics()
    with pytest.raises(ValueError, match=r"tracks 2 scenarios this pool does not have, e.g. \[.s1., .s2.\]"):
        pool(1).load(tmp_path / "pool.json")
