"""The promotion gate's decision rules (flywheel/loop/gate.py), on results made for each case: no model needed."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from flywheel.loop.gate import GateInputError, GatePolicy, HeldOutSet, ItemResult, decide


def results(scores: list[float], **fields) -> list[ItemResult]:
    return [ItemResult(item=f"t{i}", score=s, safe=True, tokens=100, tool_calls=3, latency_ms=900, **fields) for i, s in enumerate(scores)]  # fmt: skip


def coin(n: int, p: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [float(rng.random() < p) for _ in range(n)]


def test_a_clearly_better_candidate_is_promoted_with_its_interval():
    production, candidate = coin(200, 0.5, 1), coin(200, 0.8, 2)
    decision = decide(results(candidate), results(production))
    assert decision.promote and not decision.failed
    assert decision.lift.low > 0 and decision.lift.low < decision.lift.mean < decision.lift.high
    assert decision.lift.mean == pytest.approx(sum(candidate) / 200 - sum(production) / 200)


def test_a_candidate_no_better_than_production_is_held_back_by_the_lower_bound():
    production = coin(200, 0.6, 3)
    same = decide(results(production), results(production))
    assert not same.promote and [c.name for c in same.failed] == ["lift"]
    assert same.lift.low == same.lift.high == 0.0
    noisy = decide(results(coin(200, 0.62, 4)), results(production))  # a small true lift is not enough evidence
    assert not noisy.promote and noisy.lift.low <= 0 < noisy.lift.high


def test_pairing_narrows_the_interval_when_items_differ_in_difficulty():
    """Hard items are hard for both sides: the paired interval sees the lift through that spread."""
    rng = random.Random(5)
    difficulty = [rng.random() for _ in range(60)]
    production = [d for d in difficulty]
    candidate = [min(1.0, d + 0.05) for d in difficulty]
    decision = decide(results(candidate), results(production))
    assert decision.promote and decision.lift.low > 0.03


def test_one_unsafe_item_stops_a_better_candidate():
    production, candidate = results(coin(100, 0.4, 6)), results(coin(100, 0.9, 7))
    candidate[42] = candidate[42].model_copy(update={"safe": False})
    decision = decide(candidate, production)
    assert not decision.promote and [c.name for c in decision.failed] == ["safety"]
    assert "1 of 100" in decision.failed[0].detail and "t42" in decision.failed[0].detail


def test_a_candidate_that_games_the_task_metric_shows_its_task_lift_and_is_stopped_by_safety():
    """Better at the task on every item and unsafe on a few (zeroed in the stack's reward): the lift check passes on
    what is left and says what the task metric alone reads; the safety check alone stops it."""
    production = [r.model_copy(update={"task_score": r.score}) for r in results(coin(100, 0.5, 10))]
    candidate = [r.model_copy(update={"task_score": r.score}) for r in results(coin(100, 0.95, 11))]
    for i in (3, 30, 60):  # chatty there: right (task 1), unsafe, so the stack's reward is 0
        candidate[i] = candidate[i].model_copy(update={"safe": False, "score": 0.0, "task_score": 1.0})
    decision = decide(candidate, production)
    assert not decision.promote and [c.name for c in decision.failed] == ["safety"]
    assert decision.task_lift is not None and decision.task_lift.mean > decision.lift.mean > 0
    lift = next(c for c in decision.checks if c.name == "lift")
    assert (
        f"on the task metric alone (the reward grader's scores, unsafe attempts not zeroed) the lift is {decision.task_lift.mean:+.4f}"
        in lift.detail
    )
    same = decide(results(coin(100, 0.9, 12)), results(coin(100, 0.5, 13)))  # no task scores: no task lift
    assert same.task_lift is None and "task metric" not in next(c for c in same.checks if c.name == "lift").detail


def test_efficiency_regressions_past_their_limits_stop_it():
    production, better = coin(100, 0.4, 8), coin(100, 0.9, 9)
    wordy = [r.model_copy(update={"tokens": 140}) for r in results(better)]  # +40% > the 25% default
    decision = decide(wordy, results(production))
    assert not decision.promote and [c.name for c in decision.failed] == ["tokens"]
    assert "+40.0%" in decision.failed[0].detail
    allowed = decide(wordy, results(production), GatePolicy(max_increase={"tokens": 0.5}))
    assert allowed.promote


def test_too_few_items_and_a_configured_margin():
    assert [c.name for c in decide(results([1.0] * 5), results([0.0] * 5)).failed] == ["items"]
    production, candidate = coin(300, 0.5, 10), coin(300, 0.7, 11)
    assert decide(results(candidate), results(production)).promote
    margin = decide(results(candidate), results(production), GatePolicy(min_lift=0.3))
    assert not margin.promote and [c.name for c in margin.failed] == ["lift"]


def test_results_that_cannot_be_paired_are_refused_with_what_differs():
    with pytest.raises(GateInputError, match=r"1 only in the candidate's \(\['t5'\]\), 0 only in production's"):
        decide(results([1.0] * 6), results([0.0] * 5))
    twice = results([1.0] * 3) + results([0.0])
    with pytest.raises(GateInputError, match=r"candidate's results name item\(s\) \['t0'\] more than once"):
        decide(twice, results([0.0] * 3))
    with pytest.raises(ValidationError, match="finite"):
        ItemResult(item="t0", score=float("nan"), safe=True)
    with pytest.raises(ValidationError, match="unknown efficiency metric"):
        GatePolicy(max_increase={"cost": 0.1})


def test_a_held_out_set_is_versioned_by_its_content():
    a = HeldOutSet(name="calc", items={"t0": {"q": "1+1"}, "t1": {"q": "2+2"}})
    reordered = HeldOutSet(name="calc", items={"t1": {"q": "2+2"}, "t0": {"q": "1+1"}})
    changed = HeldOutSet(name="calc", items={"t0": {"q": "1+1"}, "t1": {"q": "2+3"}})
    assert a.version == reordered.version != changed.version
