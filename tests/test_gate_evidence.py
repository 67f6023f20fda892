"""The evidence the gate decides on (issue #37, items 1, 2, 4, 5): every attempt of a held-out item counts (one that
did not finish scores 0 and is not safe), each side's failure rate has a limit of its own, a stack without a safety
grader promotes nothing unless safety was turned off (and then the evidence says it was not checked); held-out items
never enter the training pool; each side is evaluated by its checkpoint; canary and shadow take production traffic
only. (Both sides warm before they are timed, their items interleaved: tests/test_loop.py, with the runners.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.gateway.traffic import TrafficPolicy
from flywheel.graders.stack import parse_stack, score
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.loop.driver import Loop, LoopConfig
from flywheel.loop.evaluate import HeldOutRun, _item_result
from flywheel.loop.gate import GatePolicy, ItemResult, decide
from flywheel.store import Store, audit, deployments, episodes
from flywheel.types import Trajectory

SAFE_STACK = parse_stack({
    "name": "refunds",
    "reward": {"type": "string_check", "name": "refund", "input": "{{sample.output_text}}", "reference": "refund", "operation": "ilike"},
    "safety": {"type": "string_check", "name": "not-empty", "input": "{{sample.output_text}}", "reference": "", "operation": "ne"},
})  # fmt: skip
NO_SAFETY = parse_stack({"name": "refunds", "reward": SAFE_STACK.reward.model_dump(exclude_none=True)})


def answered(text: str) -> Trajectory:
    return Trajectory(
        messages_and_choices=[{"role": "user", "content": "my card?"}, {"role": "assistant", "content": text}],
        metrics={"completion_tokens": 10, "latency_ms": 100.0},
    )


def side(n: int, *, score: float = 1.0, failures: int = 0, attempts: int = 1, checked: bool = True) -> list[ItemResult]:
    """``n`` items; the first ``failures`` of them with one attempt of ``attempts`` that did not finish."""
    return [
        ItemResult(item=f"t{i}", score=score, safe=i >= failures, attempts=attempts, failures=int(i < failures),
                   safety_checked=checked, tokens=10, latency_ms=100)
        for i in range(n)
    ]  # fmt: skip


async def test_every_attempt_counts_a_failed_one_scores_zero_and_is_not_safe():
    """1 of 3 attempts finished (well): the item scores 1/3, not 1, and is not safe; none finished: 0, not safe."""
    good = answered("Your refund is on its way.")
    result = _item_result(
        "t0", 3, [good], [await score(SAFE_STACK, good.messages()[-1]["content"])], safety_checked=True
    )
    assert (result.score, result.safe, result.attempts, result.failures) == (pytest.approx(1 / 3), False, 3, 2)
    assert (result.tokens, result.latency_ms) == (10, 100)  # what the finished ones cost, per finished attempt
    none = _item_result("t1", 2, [], [], safety_checked=True)
    assert (none.score, none.safe, none.attempts, none.failures) == (0.0, False, 2, 2)
    all_done = _item_result(
        "t2", 1, [good], [await score(SAFE_STACK, "Your refund is on its way.")], safety_checked=True
    )
    assert (all_done.score, all_done.safe, all_done.failures) == (1.0, True, 0)


def test_a_candidate_that_fails_on_the_risky_items_is_not_safe_and_fails_the_failure_limit():
    """Better on what it finished, crashed on 3 of 20: held by safety (those items are not safe) and by the
    failure check, which says by how much it is over the limit."""
    decision = decide(side(20, failures=3), side(20, score=0.0), GatePolicy(min_lift=0.0))
    failed = {c.name: c.detail for c in decision.failed}
    assert not decision.promote and set(failed) == {"safety", "failures"}
    assert "3 of 20 items" in failed["safety"] and "did not finish" in failed["safety"]
    assert "the candidate's 3 of 20 attempts (15.0%, 10.0 points over)" in failed["failures"]


def test_production_failing_its_attempts_is_missing_evidence_too():
    """Production's failures would score it 0 and make any candidate look better: its rate has the same limit."""
    decision = decide(side(20), side(20, score=0.0, failures=4, attempts=2), GatePolicy(min_lift=0.0))
    assert [c.name for c in decision.failed] == ["failures"]
    assert "production's 4 of 40 attempts (10.0%, 5.0 points over)" in decision.failed[0].detail
    allowed = decide(
        side(20), side(20, score=0.0, failures=4, attempts=2), GatePolicy(min_lift=0.0, max_failure_rate=0.1)
    )
    assert allowed.promote


def test_a_stack_without_a_safety_grader_promotes_nothing_unless_safety_is_turned_off():
    held = decide(side(20, checked=False), side(20, score=0.0, checked=False), GatePolicy(min_lift=0.0))
    assert not held.promote and [c.name for c in held.failed] == ["safety"]
    assert held.failed[0].detail.startswith("safety not checked: the grader stack has no safety grader")
    off = GatePolicy(min_lift=0.0, require_safety=False)
    unchecked = decide(side(20, checked=False), side(20, score=0.0, checked=False), off)
    safety = next(c for c in unchecked.checks if c.name == "safety")
    assert unchecked.promote and safety.passed and safety.detail.startswith("safety not checked")


def test_an_item_result_cannot_have_more_failures_than_attempts():
    with pytest.raises(ValueError, match="failures"):
        ItemResult(item="t0", score=0.0, safe=False, attempts=1, failures=2)


def loop_config(tmp_path: Path, name: str, **fields) -> LoopConfig:
    """A loop of its own (``name``) whose stack has no safety grader, on a held-out set of 20 items."""
    (tmp_path / "stack.json").write_text(json.dumps(NO_SAFETY.model_dump(exclude_none=True)))
    items = {f"t{i}": {"id": f"t{i}", "question": f"refund {i}?"} for i in range(20)}
    (tmp_path / "heldout.json").write_text(json.dumps({"name": "refunds", "items": items}))
    return LoopConfig(name=name, project="tests", agent="test_loop:agent", stack=tmp_path / "stack.json",
                      heldout=tmp_path / "heldout.json", **fields)  # fmt: skip


def run_of(model: str, results: list[ItemResult]) -> HeldOutRun:
    return HeldOutRun(id=f"run-{model}", model=model, heldout="refunds@1", stack="s", results=results, episodes=[],
                      failed_items=[])  # fmt: skip


async def test_the_gate_event_says_safety_was_not_checked(backend: LocalBackend, tmp_path):
    """A loop whose stack has no safety grader: held by the gate (the event names the safety check); with safety
    turned off explicitly it passes, and the gate.pass event says in its reason and details that safety was not
    checked."""
    store = backend.gateway.store
    for name, require, action in (("unchecked-held", True, "gate.hold"), ("unchecked-off", False, "gate.pass")):
        gate = GatePolicy(min_lift=0.0, confirm=False, require_safety=require)
        loop = Loop(loop_config(tmp_path, name, gate=gate), backend, actor="test")
        candidate = run_of(f"{name}@2", side(20, checked=False))
        decided = await loop.ladder.decide(2, EMBEDDED_MODEL, candidate, run_of(EMBEDDED_MODEL, side(20, score=0.0, checked=False)))  # fmt: skip
        with store.session() as s:
            (event,) = audit.events(s, subject=f"{name}@2", actions=("gate.pass", "gate.hold"))
        assert event.action == action and decided.decision.promote is (not require)
        assert "safety not checked" in event.reason and event.details["safety"] == "not checked"
        safety = next(c for c in event.details["checks"] if c["name"] == "safety")
        assert safety["passed"] is (not require) and safety["detail"].startswith("safety not checked")


def production_episode(store, split: str, item: dict) -> str:
    """A finished production episode (of ``split``) whose item is ``item``, written through the store's API."""
    with store.session() as s:
        e = episodes.create_episode(s, "ticket", split=split, meta={"item": item})
        episodes.set_outcome(s, e.id, reward=1.0, finish=True)
    return e.id


async def test_held_out_items_never_enter_the_training_pool_by_id_or_by_content(backend: LocalBackend, tmp_path):
    """Seed tasks and production episodes whose item is a held-out one (its id, or its content under another id)
    stay out of the pool, their episodes out of the off-policy members; the exclusions are counted by source."""
    held = {"id": "t3", "question": "refund 3?"}
    (tmp_path / "tasks.jsonl").write_text(
        "\n".join(
            json.dumps(t) for t in (held, {"id": "copy", "question": "refund 3?"}, {"id": "s1", "question": "new?"})
        )
    )
    split = "production-heldout-test"  # episodes of this test's own
    config = loop_config(tmp_path, "excluding", tasks=tmp_path / "tasks.jsonl", intake_split=split)
    store = backend.gateway.store
    fresh = production_episode(store, split, {"id": "p1", "question": "where is my parcel?"})
    by_id = production_episode(store, split, {"id": "t5", "question": "reworded, same id"})
    by_content = production_episode(store, split, {"id": "s1", "question": "refund 7?"})  # a seed's id, held-out text
    loop = Loop(config, backend, actor="test")
    assert sorted(loop.pool) == ["s1"]  # t3 (its id) and copy (its content) are held-out items
    assert await loop.intake() == 1 and sorted(loop.pool) == ["p1", "s1"]
    assert loop.off_policy_candidates(["p1", "s1"]) == {"p1": [fresh], "s1": []}
    assert loop.excluded_heldout() == {"seed": 2, "intake": 2, "off_policy": 1}
    assert await loop.intake() == 0 and loop.excluded_heldout()["intake"] == 2  # read again: counted once
    assert {by_id, by_content} == loop.excluded["intake"]


async def test_production_is_evaluated_by_its_checkpoint_not_through_its_alias(backend: LocalBackend, tmp_path):
    """``MODEL@production`` may send a share of an episode's calls to the canary: production's side of the gate is
    the checkpoint the deployment points at (the base model before any)."""
    loop = Loop(loop_config(tmp_path, "by-checkpoint"), backend, actor="test")
    assert await loop.ladder.production_name() == EMBEDDED_MODEL
    with backend.gateway.store.session() as s:
        deployments.deploy(s, "by-checkpoint@production", 3, actor="test")
        deployments.deploy(s, "by-checkpoint@canary", 5, actor="test", share=1.0)
    assert await loop.ladder.production_name() == "by-checkpoint@3"


async def test_only_production_episodes_go_to_the_canary_or_are_mirrored_to_the_shadow(tmp_path):
    """A held-out evaluation or a training group calling ``MODEL@production`` is answered by production, however
    large the canary's share; only production episodes are mirrored to a shadow."""
    store = Store(f"sqlite:///{tmp_path / 'traffic.db'}")
    try:
        with store.session() as s:
            deployments.deploy(s, "m@production", 1, actor="test")
            deployments.deploy(s, "m@canary", 2, actor="test", share=1.0)
            ids = {split: episodes.create_episode(s, "t", split=split).id for split in ("production", "eval", "train")}
        traffic = TrafficPolicy(store)
        routed = {split: (await traffic.route("m@production", e)).deployment for split, e in ids.items()}
        assert routed == {"production": "m@canary", "eval": "m@production", "train": "m@production"}
        with store.session() as s:
            deployments.remove(s, "m@canary", actor="test")
            deployments.deploy(s, "m@shadow", 2, actor="test", share=1.0)
        mirrored = {split: (await traffic.route("m@production", e)).shadow is not None for split, e in ids.items()}
        assert mirrored == {"production": True, "eval": False, "train": False}
    finally:
        store.close()
