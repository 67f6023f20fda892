"""The dashboard's loop view (flywheel/dashboard/loop_api.py and its page) after a real gate decision and a real
rollback: the promotion ladder (flywheel/loop/ladder.py) of a loop on the session's backend decides, the dashboard
serves that backend's store on a loopback port, and a real headless Chromium finds both with their evidence (the
gate's lift and interval, the rollback's reason), the deployments, the production episodes with their grades, the
review agreement table and the audit trail marked verified.

Shortcuts, to keep it fast (tests/test_loop.py runs the real thing): the gate decides on held-out runs built as
``evaluate`` returns them (``heldout_run``), not run through runners; the canary's episodes are recorded as the
gateway records them (``answered``), not answered by a model; production is deployed at step 1 beforehand, as an
earlier promotion would have. No model loads beyond the session's, and no step trains."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import httpx

from flywheel.dashboard.app import create_dashboard_app
from flywheel.graders.stack import score
from flywheel.local.backend import LocalBackend
from flywheel.loop.canary import CanaryPolicy
from flywheel.loop.driver import Loop, LoopConfig
from flywheel.loop.gate import GatePolicy
from flywheel.server.background import BackgroundServer
from flywheel.store import audit, deployments, reviews
from flywheel.store.reviews import LabelKind

from helpers import WATCH_STACK, answered, emulate, heldout_run

MODEL = "dash-loop-agent"
PRODUCTION, CANARY = f"{MODEL}@production", f"{MODEL}@canary"
GOOD, BAD = "Your refund is on its way.", "Sorry, no."
DOCS_IMAGE = Path(__file__).parent.parent / "docs" / "images" / "dashboard-loop.png"


def loop_of(backend: LocalBackend, directory: Path) -> Loop:
    """A loop of MODEL on the session's backend whose canary is decided at 3 episodes of each arm; its grader stack
    is WATCH_STACK under a name of its own (its grades and labels are this test's only)."""
    (directory / "stack.json").write_text(json.dumps(WATCH_STACK | {"name": "dashboard-support"}))
    (directory / "heldout.json").write_text(json.dumps({"name": "tickets", "items": {"q0": {"question": "refund?"}}}))
    config = LoopConfig(
        name=MODEL, agent="unused:agent", stack=directory / "stack.json", heldout=directory / "heldout.json",
        gate=GatePolicy(min_items=2, max_increase={"tokens": 10}),
        canary=CanaryPolicy(share=0.5, min_episodes=3, min_production_episodes=3, max_episodes=3),
    )  # fmt: skip
    return Loop(config, backend, actor="test")


async def test_the_loop_view_shows_a_gate_decision_and_a_rollback_with_their_evidence(
    backend: LocalBackend, browser, tmp_path: Path
):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    loop, store = loop_of(backend, tmp_path), backend.gateway.store
    with store.session() as s:
        deployments.deploy(s, PRODUCTION, 1, actor="test", reason="an earlier promotion")
    # the gate decides for real on step 2's held-out run against production's (and the fresh pair confirming it)
    better, zeros = heldout_run(f"{MODEL}@2", 0.0, scores=[1.0] * 16 + [0.0] * 4), heldout_run(PRODUCTION, 0.0, 20)
    candidate = await loop.ladder.decide(2, PRODUCTION, better, zeros, again=(better, zeros))
    assert candidate.decision.promote and candidate.deployed == CANARY
    lift = candidate.decision.lift
    # the canary answers worse than production: the canary watch rolls it back on its interval
    episodes = [answered(store, PRODUCTION, 1, GOOD) for _ in range(3)] + [answered(store, CANARY, 2, BAD) for _ in range(3)]  # fmt: skip
    rolled_back = await loop.ladder.watch_canary()
    assert rolled_back.action == "rollback" and rolled_back.reason.endswith("worse than production")
    # the episodes graded by the loop's stack (as the shadow watch records them), all six reviewed, one label that
    # disagrees with the reward grader
    graded = {e: await score(loop.stack, GOOD if i < 3 else BAD, {}) for i, e in enumerate(episodes)}
    with store.session() as s:
        loop.stack.register(s, actor="test")
        for episode, result in graded.items():
            result.record(s, episode)
        sampled = reviews.sample(s, 1.0, seed=0, actor="test", split="production")
        assert set(episodes) <= set(sampled.queued)
        for i, episode in enumerate(episodes):
            reviews.label(s, episode, float(i < 3 or i == 5), LabelKind.pass_fail, actor="reviewer")
        rollback = audit.events(s, subject=CANARY, actions=("canary.rollback",))[-1]
        assert audit.verify(s).ok

    server = BackgroundServer(create_dashboard_app(store, backend.path)).start()
    shots = Path(tempfile.mkdtemp(prefix="dashboard-loop-shots-", dir=tmp_path))
    wait = WebDriverWait(browser, 10)
    try:
        api = f"http://{server.host}:{server.port}/ui/api/loop"
        for path, status, says in (
            ("/timeline?model=nobody", 404, "nothing of model 'nobody'. Models: "),  # the session's other tests' too
            ("/deployments?model=nobody", 404, "Models: "),
            ("/audit/999999", 404, "the trail has events 1 to"),
            ("/episodes?split=nowhere", 404, "Splits: "),
            ("/audit?limit=0", 422, "greater than or equal to 1"),
        ):
            response = httpx.get(api + path)
            assert response.status_code == status and says in response.text, (path, response.text)
        assert MODEL in httpx.get(f"{api}/timeline?model=nobody").json()["error"]["message"]
        page = httpx.get(f"{api}/timeline", params={"model": MODEL, "limit": 2}).json()  # paged, the latest first
        assert (page["total"], page["next_offset"]) == (5, 2)  # production's deploy, the gate, the canary's three
        assert [e["action"] for e in page["items"]] == ["remove", "canary.rollback"]
        emulate(browser, 1280, 800)
        browser.get(f"http://{server.host}:{server.port}/ui/#/runs")
        wait.until(seen.element_to_be_clickable((By.LINK_TEXT, "The loop"))).click()  # from the header's menu
        wait.until(seen.visibility_of_element_located((By.ID, "audit-status")))
        browser.find_element(By.LINK_TEXT, MODEL).click()  # the timeline of this model only
        wait.until(seen.text_to_be_present_in_element((By.TAG_NAME, "h1"), f"The loop of {MODEL}"))
        gate = wait.until(seen.visibility_of_element_located((By.CSS_SELECTOR, 'li[data-action="gate.pass"]')))
        assert f"{MODEL}@2" in gate.text and gate.get_attribute("data-event") == str(candidate.event_id)
        assert (
            f"lift {lift.mean:+.3f} [{lift.low:+.3f}, {lift.high:+.3f}] at level" in gate.text and "look 1" in gate.text
        )
        back = browser.find_element(By.CSS_SELECTOR, 'li[data-action="canary.rollback"]')
        assert back.get_attribute("data-event") == str(rollback.id) and rolled_back.reason in back.text
        assert "3 canary / 3 production episodes" in back.text
        mean, low, high = rolled_back.difference  # canary 0 of 3 refunds, production 3 of 3
        assert mean == -1.0 and f"canary \N{MINUS SIGN} production {mean:+.3f} [{low:+.3f}, {high:+.3f}]" in back.text
        removed = browser.find_element(By.CSS_SELECTOR, 'li[data-action="remove"]')
        assert CANARY in removed.text and f"event {rollback.id}" in removed.text  # the canary's removal follows it
        table = {
            r.get_attribute("data-deployment"): r.text
            for r in browser.find_elements(By.CSS_SELECTOR, "tr[data-deployment]")
        }
        assert list(table) == [PRODUCTION] and f"{MODEL}@1" in table[PRODUCTION] and "all traffic" in table[PRODUCTION]
        status = browser.find_element(By.ID, "audit-status")
        assert status.get_attribute("data-ok") == "true" and status.text.startswith("verified")
        rows = {
            r.get_attribute("data-episode"): r.text for r in browser.find_elements(By.CSS_SELECTOR, "tr[data-episode]")
        }
        assert (
            set(episodes) <= set(rows) and "reward 1 safety 1" in rows[episodes[0]] and f"{CANARY}" in rows[episodes[5]]
        )
        agreement = browser.find_element(By.CSS_SELECTOR, 'tr[data-grader="refund"]')
        assert "dashboard-support" in agreement.text and " 6 " in f" {agreement.text} "  # six labels, one disagreeing
        browser.save_screenshot(str(shots / "loop-1280.png"))
        emulate(browser, 390, 844, dark=True)  # a phone, in the dark
        browser.save_screenshot(str(shots / "loop-phone-dark.png"))
        emulate(browser, 1280, 800)

        # the decision's whole record; the page redraws after a resize (and whenever the store changes), so the link
        # is looked up afresh until a click lands
        WebDriverWait(browser, 10, ignored_exceptions=[StaleElementReferenceException]).until(
            lambda b: (
                b.find_element(By.CSS_SELECTOR, 'li[data-action="gate.pass"]')
                .find_element(By.LINK_TEXT, f"event {candidate.event_id}")
                .click()
                or True
            )
        )
        details = wait.until(seen.visibility_of_element_located((By.CSS_SELECTOR, "pre.details")))
        assert json.loads(details.text)["lift"]["low"] == lift.low  # its evidence as the audit event recorded it
        assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        server.stop()
    print(f"screenshots: {shots}")
    if os.environ.get("FLYWHEEL_DOCS_SCREENSHOT"):  # FLYWHEEL_DOCS_SCREENSHOT=1 refreshes the docs' picture
        shutil.copy(shots / "loop-1280.png", DOCS_IMAGE)
