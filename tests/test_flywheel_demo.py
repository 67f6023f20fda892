"""The flywheel demonstration (flywheel/examples/calculator/flywheel_demo.py, ``flywheel demo flywheel``): its answer
grader is the calculator's own check; and end to end at its quick sizes, on a backend of its own: simulated users
send episodes to production, the loop trains on them, a candidate is gated, becomes the canary and is promoted (or,
judged on two episodes, rolled back); an unsafe candidate is stopped at the gate; a canary deployed past the gate is
rolled back; the audit chain verifies and the plot is written."""

from __future__ import annotations

import asyncio
import io
import json
import shutil

import pytest
from rich.console import Console

from flywheel.checkpoints.layout import OPTIMIZER, model_path
from flywheel.examples.calculator.flywheel_demo import POLICY_STACK, run_demo
from flywheel.examples.calculator.task import Problem, reward
from flywheel.graders import grade, parse_grader
from flywheel.local.backend import LocalBackend
from flywheel.store import audit, deployments


async def test_the_demos_answer_grader_agrees_with_the_calculators_reward():
    """The policy stack's 'correct' grader (run in the grader sandbox) scores a reply as the calculator task's own
    reward does: integers exact (a float within 1e-6 of a large one is wrong), the last 'Answer:', signs, commas."""
    grader = parse_grader(POLICY_STACK["reward"]["graders"]["correct"])
    cases = [("Answer: 107", 107), ("Answer: 1,234", 1234), ("**Answer:** -$5", -5), ("Answer: 1000000.5", 1000001),
             ("answer: 2.5", 2.5), ("The answer is 7", 7), ("Answer: 7\nAnswer: 8", 8), ("Answer: 8\nAnswer: 7", 8),
             ("Answer: 12.0", 12), ("Answer:", 3)]  # fmt: skip
    results = await asyncio.gather(*(grade(grader, text, {"answer": answer}) for text, answer in cases))
    for (text, answer), result in zip(cases, results, strict=True):
        problem = Problem(id="p", question="?", expression=str(answer), answer=answer, level=1, split="test")
        assert result.reward == reward(problem, text), (text, answer, result)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~3 min on 2 shared cores; several times that on loaded ones
async def test_the_flywheel_demo_promotes_stops_the_unsafe_candidate_and_rolls_back_a_regressing_canary(
    fresh_backend: LocalBackend, tmp_path, request
):
    """On a backend of its own (its home in tmp_path, closed after): a failure leaves nothing in the session's."""
    backend = fresh_backend
    # ~2.7 GB of checkpoints: not left in pytest's kept temporary directories
    request.addfinalizer(lambda: shutil.rmtree(model_path(backend.path, "demo", "demo-calc"), ignore_errors=True))
    out = tmp_path / "out"  # beside the backend's home (tmp_path), not in it
    printed = io.StringIO()
    report = await run_demo(
        out, quick=True, backend=backend, name="demo-calc", console=Console(file=printed, width=200)
    )
    stages = [row.stage for row in report.timeline]
    by_stage = {stage: [row for row in report.timeline if row.stage == stage] for stage in stages}
    *warm_starts, good, gamed, unsafe = by_stage["gate"]  # a warm start the gate holds gets another round
    assert warm_starts[-1].evidence.startswith("PASS vs the base model"), warm_starts[-1].evidence
    assert good.evidence.startswith("PASS vs demo-calc@"), good.evidence
    # the candidate that games the task metric: chatty on ticket-price questions (the held-out set has one) and
    # beyond, so the safety check stops it; the evidence gives the task metric's lift beside the stack reward's
    failed = gamed.evidence.partition("; FAILED ")[2]  # the checks that failed: "safety", others "name: detail"
    assert gamed.evidence.startswith("STOPPED") and "safety" in failed.split("; "), gamed.evidence
    assert "the candidate failed the safety grader on " in gamed.evidence.partition("; FAILED ")[0], gamed.evidence
    assert "on the task metric alone (unsafe replies not zeroed)" in gamed.evidence, gamed.evidence
    # stopped: at the quick sizes the unsafe reward's learning rate breaks the model, whose replies then fail safety
    # (long), the token limit (runaway) or the lift (wrong and short) by the draw; FULL's is stopped for safety
    assert unsafe.evidence.startswith("STOPPED") and "; FAILED " in unsafe.evidence, unsafe.evidence
    # the loop's candidate, a canary: promoted, or rolled back (its 2 episodes' reward interval not within 0.15 of
    # production's: quick sizes judge a nearly unchanged model on a couple of different problems); then the
    # regressing canary, rolled back on its users' episodes: an unsafe reply, or a reward not shown within 0.15
    first, rolled_back = [row for row in report.timeline if row.stage in ("canary promote", "canary rollback")]
    promoted = first.stage == "canary promote"
    assert promoted or "not shown within 0.15" in first.evidence, first.evidence
    assert rolled_back.stage == "canary rollback", rolled_back
    assert any(why in rolled_back.evidence for why in ("failed the safety grader", "worse than production",
                                                        "not shown within 0.15"))  # fmt: skip
    assert report.timeline.index(first) < stages.index("gamed training") < stages.index("unsafe training")
    assert stages.index("unsafe training") < report.timeline.index(rolled_back)
    assert report.audit_ok and report.plot.stat().st_size > 0
    assert json.loads((out / "timeline.json").read_text())["audit_ok"] is True
    # checkpoints kept (LocalBackend.prune_checkpoints): production's and, after a promotion, release 1, where a
    # rollback of production goes (weights only), and the latest (training goes on from it: with its optimizer
    # state); the others pruned
    checkpoints = model_path(backend.path, "demo", "demo-calc") / "checkpoints"
    kept = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    production = good.step if promoted else warm_starts[-1].step
    assert kept == [warm_starts[-1].step, *([good.step] if promoted else []), unsafe.step], kept
    assert [(checkpoints / f"{step:04d}" / OPTIMIZER).exists() for step in kept] == [*[False] * (len(kept) - 1), True]
    assert 0 < report.disk_final <= report.disk_peak
    assert "flywheel audit verify" in printed.getvalue() and "canary rollback" in printed.getvalue()
    with backend.gateway.store.session() as s:
        # every event the timeline names is in the chain, and production is the promoted canary's step (else
        # release 1's)
        named = {i for row in report.timeline for i in row.events}
        assert {e.id for e in audit.events(s, limit=10_000)} >= named
        assert deployments.get(s, "demo-calc@production").step == production
        assert deployments.find(s, "demo-calc@canary") is None
        assert audit.verify(s).ok
