"""Repeated looks (flywheel/loop/looks.py): the gate's error budget over a loop's looks and its confirming evaluation,
and the canary's and shadow's interval verdicts at scheduled looks. Results made for each case: no model needed.
bench/gate_error.py measures the rates these rules give; the tests check the rules themselves."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from pydantic import ValidationError

from flywheel.loop.canary import CanaryPolicy, Scored
from flywheel.loop.canary import verdict as canary_verdict
from flywheel.loop.gate import GatePolicy, ItemResult, decide, decide_look, levels
from flywheel.loop.looks import look_budget, reached, schedule
from flywheel.loop.shadow import Pair, ShadowPolicy
from flywheel.loop.shadow import verdict as shadow_verdict


def results(scores) -> list[ItemResult]:
    return [ItemResult(item=f"t{i}", score=float(s), safe=True) for i, s in enumerate(scores)]


def test_the_gate_s_looks_never_spend_more_than_its_lifetime_error():
    budgets = [look_budget(0.05, 25, k) for k in range(1, 100_001)]
    assert sum(budgets) <= 0.05
    assert budgets[0] == budgets[24] == pytest.approx(0.8 * 0.05 / 25)  # the planned looks share evenly
    assert budgets[24] > budgets[25] > budgets[26] > budgets[1000] > 0  # later ones share the reserve, less and less
    with pytest.raises(ValueError, match="counted from 1"):
        look_budget(0.05, 25, 0)
    screen, confirm = levels(GatePolicy(), 3)
    assert screen == 0.025 and screen * confirm == pytest.approx(look_budget(0.05, 25, 3))
    assert levels(GatePolicy(confirm=False), 3) == (pytest.approx(look_budget(0.05, 25, 3)), None)


def test_a_look_passes_only_if_a_fresh_evaluation_confirms_it_and_the_evidence_says_which_failed():
    rng = np.random.default_rng(0)
    production = results(rng.random(80) < 0.5)
    better = results([1.0 if p.score == 1.0 else float(x) for p, x in zip(production, rng.random(80) < 0.35)])
    worse = results([0.0] * 80)
    policy = GatePolicy()
    screen = decide_look(policy, 3, (better, production))
    assert not screen.promote and screen.needs_confirmation and screen.look == 3 and screen.lift.level == 0.025
    assert [c.name for c in screen.failed] == ["confirmation"] and "pending" in screen.failed[0].detail
    assert decide(better, production, level=1e-4).lift.low < screen.lift.low  # the same evidence, a smaller level
    failed = decide_look(policy, 3, (better, production), (production, production))  # the fresh one: no lift
    assert not failed.promote and [c.name for c in failed.failed] == ["confirmation"]
    assert "fresh evaluation" in failed.failed[0].detail and failed.confirmation.lift.mean == 0
    fresh = results([1.0 - r.score if i % 40 == 0 else r.score for i, r in enumerate(better)])  # 2 items differ
    passed = decide_look(policy, 3, (better, production), (fresh, production))
    assert passed.promote and passed.confirmation.lift.level == pytest.approx(levels(policy, 3)[1])
    assert not decide_look(policy, 3, (worse, production)).needs_confirmation  # a failed screen ends the look
    alone = decide_look(GatePolicy(confirm=False), 3, (better, production))
    assert alone.lift.level == pytest.approx(look_budget(0.05, 25, 3)) and not alone.needs_confirmation


def test_a_deterministic_evaluation_is_no_confirmation_the_look_decides_at_its_budget():
    """Greedy evaluation gives the same scores again: a confirmation would only repeat the screen. The look then
    tests at its budget, which a lift the screen passes at 2.5% may not pass."""
    rng = np.random.default_rng(2)
    production = results(rng.random(80) < 0.6)
    candidate = results([1.0 if p.score == 1.0 else float(x) for p, x in zip(production, rng.random(80) < 0.3)])
    policy = GatePolicy()
    assert decide_look(policy, 1, (candidate, production)).needs_confirmation
    again = decide_look(policy, 1, (candidate, production), (list(reversed(candidate)), production))
    assert again.confirmation is None and again.lift.level == pytest.approx(look_budget(0.05, 25, 1))
    assert "deterministic" in next(c.detail for c in again.checks if c.name == "confirmation")
    assert again.promote == (again.lift.low > policy.min_lift)
    greedy = decide_look(policy, 1, (candidate, production), deterministic=True)  # known before any repeat
    assert not greedy.needs_confirmation and greedy.lift == again.lift and greedy.promote == again.promote
    assert "greedily" in next(c.detail for c in greedy.checks if c.name == "confirmation")
    assert decide_look(policy, 1, (production, production), deterministic=True).confirmation is None


def test_a_no_better_candidate_looked_at_25_times_is_rarely_promoted_where_the_old_rule_often_was():
    """Each look evaluates both sides afresh on the same 20 items; the candidate is exactly as good."""
    rng = np.random.default_rng(1)
    policy = GatePolicy(resamples=1000)
    old = policy.model_copy(update={"min_lift": 0.0})
    old_hits = new_hits = 0
    for _ in range(40):
        difficulty = rng.uniform(0.2, 0.7, 20)

        def side():
            return results(rng.random(20) < difficulty)

        old_hits += any(decide(side(), side(), old, level=0.025).promote for _ in range(25))
        for look in range(1, 26):
            first = (side(), side())
            decision = decide_look(policy, look, first)
            if decision.needs_confirmation:
                decision = decide_look(policy, look, first, (side(), side()))
            if decision.promote:
                new_hits += 1
                break
    assert old_hits >= 8 and new_hits <= 1  # the old rule: about 47% of loops


def test_looks_are_scheduled_at_doubling_counts():
    assert schedule(50, 800) == [50, 100, 200, 400, 800]
    assert schedule(3, 3) == [3] and schedule(20, 100) == [20, 40, 80, 100]
    assert [reached([50, 100], n) for n in (49, 50, 99, 100, 500)] == [None, 50, 50, 100, 100]
    with pytest.raises(ValueError):
        schedule(10, 5)
    with pytest.raises(ValidationError, match="max_episodes"):
        CanaryPolicy(min_episodes=100, max_episodes=50)
    with pytest.raises(ValidationError, match="max_pairs"):
        ShadowPolicy(min_pairs=100, max_pairs=50)


def arm(values, prefix: str) -> list[Scored]:
    return [Scored(episode_id=f"{prefix}{i}", kpi=float(v), safe=True) for i, v in enumerate(values)]


def test_a_slightly_worse_canary_on_few_episodes_is_not_promoted_on_its_point_estimate():
    """0.65 against 0.70 over 20 vs 200 episodes: within 0.05 of production on the point estimate (the old rule
    promoted it), not on the interval."""
    policy = CanaryPolicy(min_episodes=20, min_production_episodes=20, max_episodes=800)
    found = canary_verdict(arm([1] * 13 + [0] * 7, "c"), arm(([1] * 7 + [0] * 3) * 20, "p"), policy)
    assert found.action == "wait" and found.difference[0] == pytest.approx(-0.05)
    assert found.difference[1] < -0.05 < found.difference[2] and found.look == 20
    assert "undecided until 40" in found.reason


def test_the_canary_is_decided_on_its_first_episodes_at_each_look_and_needs_production_s():
    policy = CanaryPolicy(min_episodes=20, min_production_episodes=20, max_episodes=80)  # looks at 20, 40, 80
    assert canary_verdict(arm([1] * 30, "c"), arm([1] * 10, "p"), policy).action == "wait"  # production: 10 of 20
    good = arm([1, 1, 0, 1] * 20, "c")
    production = arm([1, 1, 0, 1] * 200, "p")
    at_40 = canary_verdict(good[:40], production, policy)
    assert at_40.look == 40 and canary_verdict(good[:79], production, policy).difference == at_40.difference
    last = canary_verdict(good, production, policy)
    assert last.look == 80 and last.level == pytest.approx(0.05 / 3)
    # at its last look a canary not shown within max_drop is rolled back; one clearly worse, at any look
    assert last.action == "rollback" and "by its last look" in last.reason
    bad = canary_verdict(arm([0] * 20, "c"), production, policy)
    assert bad.action == "rollback" and "worse than production" in bad.reason and bad.look == 20
    equal = CanaryPolicy(min_episodes=800, min_production_episodes=800, max_episodes=800)
    promoted = canary_verdict(arm([1, 1, 0, 1] * 200, "c"), arm([1, 1, 0, 1] * 1800, "p"), equal)
    assert promoted.action == "promote" and promoted.difference[1] > -0.05
    unsafe = [Scored(episode_id="c0", kpi=1.0, safe=False)]
    assert canary_verdict(unsafe, production, policy).action == "rollback"  # before any count


def pairs(diffs: list[float], start: datetime) -> list[Pair]:
    return [Pair(shadow=f"s{i}", production=f"p{i}", shadow_reward=max(d, 0.0), production_reward=max(-d, 0.0),
                 safe=True, created_at=start + timedelta(seconds=i)) for i, d in enumerate(diffs)]  # fmt: skip


def test_the_shadow_decides_on_its_oldest_pairs_at_each_look():
    policy = ShadowPolicy(min_pairs=10, max_pairs=20)  # looks at 10 and 20
    start = datetime(2026, 11, 27, tzinfo=UTC)
    equal = pairs([0.0] * 10, start)
    later_worse = pairs([-1.0] * 5, start + timedelta(hours=1))
    found = shadow_verdict(list(reversed(equal + later_worse)), policy)  # in any order: the oldest 10 decide
    assert (found.action, found.look, found.pairs, found.difference[0]) == ("canary", 10, 15, 0.0)
    assert sorted(found.episodes) == sorted(p.shadow for p in equal)
    worse = shadow_verdict(pairs([-1.0, 0.0] * 5, start), policy)
    assert worse.action == "stop" and "worse than production" in worse.reason
    undecided = shadow_verdict(pairs([-1.0, 1.0, 0.0, 0.0, 0.0] * 2, start), policy)
    assert undecided.action == "wait" and "undecided until 20" in undecided.reason
    assert shadow_verdict(pairs([-1.0, 1.0, 0.0, 0.0, 0.0] * 4, start), policy).action == "stop"  # its last look
