"""The flywheel demonstration (flywheel/examples/calculator/flywheel_demo.py, ``flywheel demo flywheel``) end to end at
its quick sizes, on the session's backend: simulated users send episodes to production, the loop trains on them, a
candidate is gated, becomes the canary and is promoted; an unsafe candidate is stopped at the gate; a canary
deployed past the gate is rolled back; the audit chain verifies and the plot is written."""

from __future__ import annotations

import io
import json
import os

import pytest
from rich.console import Console

from flywheel.backend import LocalBackend
from flywheel.examples.calculator.flywheel_demo import run_demo
from flywheel.store import audit, deployments


@pytest.mark.skipif(
    not os.environ.get("FLYWHEEL_SLOW_TESTS"),
    reason="the flywheel demo's quick path is not reliable yet (its unsafe reward may train no step; issue #25): set"
    " FLYWHEEL_SLOW_TESTS=1 to run it (~10 min); not in CI until it passes there",
)
@pytest.mark.slow
@pytest.mark.timeout(
    1800
)  # a warm start, three training steps, three gates and two canaries: ~10 min on 2 loaded cores
async def test_the_flywheel_demo_promotes_stops_the_unsafe_candidate_and_rolls_back_a_regressing_canary(
    backend: LocalBackend, tmp_path
):
    out = tmp_path / "demo"
    printed = io.StringIO()
    report = await run_demo(
        out, quick=True, backend=backend, name="demo-calc", console=Console(file=printed, width=200)
    )
    stages = [row.stage for row in report.timeline]
    by_stage = {stage: [row for row in report.timeline if row.stage == stage] for stage in stages}
    release, good, unsafe = by_stage["gate"]
    assert release.evidence.startswith("PASS vs the base model") and good.evidence.startswith("PASS vs demo-calc@")
    assert unsafe.evidence.startswith("STOPPED") and "FAILED safety" in unsafe.evidence, unsafe.evidence
    (promoted,) = by_stage["canary promote"]
    (rolled_back,) = by_stage["canary rollback"]
    assert "failed the safety grader" in rolled_back.evidence
    assert stages.index("canary promote") < stages.index("unsafe training") < stages.index("canary rollback")
    assert report.audit_ok and report.plot.stat().st_size > 0
    assert json.loads((out / "timeline.json").read_text())["audit_ok"] is True
    assert "flywheel audit verify" in printed.getvalue() and "canary rollback" in printed.getvalue()
    with backend.gateway.store.session() as s:
        # every event the timeline names is in the chain, and production is the promoted canary's step
        named = {i for row in report.timeline for i in row.events}
        assert {e.id for e in audit.events(s, limit=10_000)} >= named
        assert deployments.get(s, "demo-calc@production").step == good.step
        assert deployments.find(s, "demo-calc@canary") is None
        assert audit.verify(s).ok
