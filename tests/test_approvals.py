"""Human approval for high-impact tool calls and per-deployment tool scopes (flywheel.approvals,
flywheel.store.approvals): the store's rules on SQLite and PostgreSQL; the gateway holding a production call of a
high-impact tool until a person decides over HTTP (approve, deny, no decision in time), a policy deciding off
production, a tool outside the scope refused; ``run_agent`` asking an approver before a high-impact tool runs.

The model is the session's real one; a forced tool call (``tool_choice`` naming the tool: guided decoding) makes
it call the tool on every attempt, so each test knows which call it will see."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as seen
from selenium.webdriver.support.ui import WebDriverWait
from typer.testing import CliRunner

from flywheel.agents import run_agent, tool
from flywheel.approvals import GraderApprover, HumanApprover, ToolCallRequest, allow, deny
from flywheel.cli import app
from flywheel.dashboard.app import create_dashboard_app
from flywheel.dashboard.app import mount as mount_dashboard
from flywheel.gateway.client import EpisodeClient
from flywheel.gateway.recorder import Gateway
from flywheel.graders import parse_grader
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.inference.registry import ModelRegistry
from flywheel.local.backend import LocalBackend
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store, approvals, audit, deployments
from flywheel.store.approvals import ApprovalClosedError, NoToolPolicyError, UnknownApprovalError

from helpers import emulate, fuzz_routes

MODEL = "appr"
ALIAS = f"{MODEL}@production"
REFUND = {
    "type": "function",
    "function": {
        "name": "issue_refund",
        "description": "Refund an order.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "integer"}, "amount": {"type": "number"}},
            "required": ["order_id", "amount"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Read an order.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]},
    },
}
DELETE = {"type": "function", "function": {"name": "delete_account", "parameters": {"type": "object"}}}


def forced(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


ASK = {"messages": [{"role": "user", "content": "Refund order 7, 20 dollars."}], "max_tokens": 48, "temperature": 0}


# ---- the store ----------------------------------------------------------------------------------------------------


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def test_a_policy_is_checked_before_anything_is_written(store):
    with store.session() as s:
        with pytest.raises(ValueError, match="'issue_refund' is not in the allowed tools"):
            approvals.set_policy(s, ALIAS, high_impact=["issue_refund"], allowed=["lookup_order"], actor="ana")
        with pytest.raises(ValueError, match="timeout_s was 0"):
            approvals.set_policy(s, ALIAS, high_impact=[], timeout_s=0, actor="ana")
        with pytest.raises(ValueError, match="otherwise was 'maybe'"):
            approvals.set_policy(s, ALIAS, high_impact=[], otherwise="maybe", actor="ana")
        with pytest.raises(ValueError, match="a grader is needed exactly when"):
            approvals.set_policy(s, ALIAS, high_impact=[], otherwise="grader", actor="ana")
        with pytest.raises(deployments.InvalidAliasError):
            approvals.set_policy(s, "appr", high_impact=[], actor="ana")
        with pytest.raises(NoToolPolicyError, match="'appr@canary' has no tool policy"):
            approvals.get_policy(s, "appr@canary")
        assert audit.events(s) == []
        policy = approvals.set_policy(
            s, ALIAS, high_impact=["issue_refund", "issue_refund"], allowed=["lookup_order", "issue_refund"],
            actor="ana", reason="refunds move money",
        )  # fmt: skip
        assert (policy.high_impact, policy.allowed, policy.otherwise) == (
            ["issue_refund"],
            ["issue_refund", "lookup_order"],
            "deny",
        )
        assert policy.in_scope("lookup_order") and not policy.in_scope("delete_account")
        [event] = audit.events(s)
        assert (event.action, event.subject, event.actor, event.reason) == (
            "tools.policy",
            ALIAS,
            "ana",
            "refunds move money",
        )


def test_an_approval_is_decided_once_and_every_step_is_in_the_audit_chain(store):
    with store.session() as s:
        first = approvals.request(s, tool="issue_refund", arguments='{"amount": 20}', timeout_s=60, actor="gw")
        second = approvals.request(s, tool="issue_refund", arguments="{}", timeout_s=60, actor="gw")
        assert first.status == "pending" and approvals.count_pending(s) == 2
        assert [a.id for a in approvals.list_approvals(s, status=approvals.ApprovalStatus.pending)] == [
            first.id,
            second.id,
        ]  # oldest first: the order to decide them in
    with store.session() as s:
        approved = approvals.decide(s, first.id, approve=True, actor="ana", reason="within policy")
        assert (approved.status, approved.decided_by, approved.reason) == ("approved", "ana", "within policy")
    with store.session() as s, pytest.raises(ApprovalClosedError, match=r"is approved by ana"):
        approvals.decide(s, first.id, approve=False, actor="bo")
    with (
        store.session() as s,
        pytest.raises(UnknownApprovalError, match=f"No approval 999 \\(the latest is {second.id}\\)"),
    ):
        approvals.get(s, 999)
    with store.session() as s:
        approvals.decide(s, second.id, approve=False, actor="bo", reason="over the cap")
        events = audit.events(s)
        assert [(e.action, e.subject, e.actor) for e in events] == [
            ("approval.request", f"approval/{first.id}", "gw"),
            ("approval.request", f"approval/{second.id}", "gw"),
            ("approval.approve", f"approval/{first.id}", "ana"),
            ("approval.deny", f"approval/{second.id}", "bo"),
        ]
        assert approvals.get(s, first.id).decision_event == events[2].id
        assert audit.verify(s).ok


def test_an_approval_past_its_deadline_is_expired_and_cannot_be_approved_any_more(store):
    with store.session() as s:
        late = approvals.request(s, tool="issue_refund", arguments="{}", timeout_s=0.05, actor="gw")
    time.sleep(0.1)
    with store.session() as s:
        closed = approvals.decide(s, late.id, approve=True, actor="ana")
        assert (closed.status, closed.decided_by) == ("expired", "timeout")  # too late: expired, not approved
    with store.session() as s, pytest.raises(ApprovalClosedError, match="is expired by timeout"):
        approvals.decide(s, late.id, approve=True, actor="ana")
    with store.session() as s:
        other = approvals.request(s, tool="issue_refund", arguments="{}", timeout_s=0.05, actor="gw")
    time.sleep(0.1)
    with store.session() as s:  # what a server stopped while it waited leaves: expired when listed
        assert approvals.expire_due(s) == 1
        assert approvals.get(s, other.id).status == "expired" and approvals.count_pending(s) == 0


# ---- the gateway -------------------------------------------------------------------------------------------------


@pytest.fixture
def served(backend: LocalBackend):
    """``appr@1`` served (the session's engine under that name: no model loads), ``appr@production`` pointing at
    it; the deployment's tool policy is each test's. Yields the server's root URL."""
    backend.registry.add(f"{MODEL}@1", backend.engine(EMBEDDED_MODEL), step=1)
    assert backend.gateway is not None
    store = backend.gateway.store
    with store.session() as s:
        deployments.deploy(s, ALIAS, 1, actor="ana")
    yield backend.base_url.removesuffix("/v1")
    with store.session() as s:
        deployments.remove(s, ALIAS, actor="ana")
        if approvals.find_policy(s, ALIAS) is not None:
            approvals.remove_policy(s, ALIAS, actor="ana")
    backend.registry.remove(f"{MODEL}@1")


def set_policy(backend: LocalBackend, **fields) -> None:
    assert backend.gateway is not None
    with backend.gateway.store.session() as s:
        approvals.set_policy(s, ALIAS, actor="ana", **({"high_impact": ["issue_refund"]} | fields))


async def pending(http: httpx.AsyncClient, count: int = 1) -> list[dict]:
    """The pending approvals once there are ``count`` (bounded wait: generating the call takes seconds alone, far
    more on a loaded machine)."""
    for _ in range(2400):
        found = (await http.get("/approvals", params={"status": "pending"})).json()["data"]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {count} pending approval(s) after 120 s")


async def test_a_production_call_of_a_high_impact_tool_waits_for_a_person_and_passes_once_approved(backend, served):
    set_policy(backend, allowed=["issue_refund", "lookup_order"])
    async with EpisodeClient(served) as episodes, httpx.AsyncClient(base_url=served, timeout=30) as http:
        episode = await episodes.create("refund-7", split="production")
        agent = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
        began = time.perf_counter()
        call = asyncio.create_task(
            agent.chat.completions.create(
                model=ALIAS, tools=[REFUND, LOOKUP], tool_choice=forced("issue_refund"), **ASK
            )
        )
        [waiting] = await pending(http)
        assert (waiting["tool"], waiting["deployment"], waiting["episode_id"]) == ("issue_refund", ALIAS, episode.id)
        assert "order_id" in json.loads(waiting["arguments"])  # what the model wrote, for the person to read
        await asyncio.sleep(1.0)
        assert not call.done()  # held while nobody decided
        approved = await http.post(f"/approvals/{waiting['id']}/approve", json={"by": "ana", "reason": "within policy"})
        assert approved.status_code == 200 and approved.json()["status"] == "approved"
        reply = await asyncio.wait_for(call, 30)
        total = time.perf_counter() - began
        [made] = reply.choices[0].message.tool_calls or []
        assert made.function.name == "issue_refund" and reply.choices[0].finish_reason == "tool_calls"
        [decision] = (reply.model_extra or {})["flywheel_approvals"]
        assert (decision["verdict"], decision["by"], decision["approval_id"]) == ("approved", "ana", waiting["id"])
        again = await http.post(f"/approvals/{waiting['id']}/deny", json={"by": "bo"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "approval_closed"
        [recorded] = await episodes.calls(episode.id)
    assert recorded["response"]["flywheel_approvals"][0]["verdict"] == "approved"
    assert recorded["latency_ms"] / 1000 < total - 0.9  # the person's time is not the model's latency
    with backend.gateway.store.session() as s:
        trail = [(e.action, e.actor) for e in audit.events(s, subject=f"approval/{waiting['id']}")]
    assert trail == [("approval.request", "gateway"), ("approval.approve", "ana")]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_denied_call_reaches_the_agent_as_a_notice_and_no_call(backend, served, stream):
    set_policy(backend)
    async with httpx.AsyncClient(base_url=served, timeout=30) as http:
        agent = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)  # no episode: production
        request = {"model": ALIAS, "tools": [REFUND], "tool_choice": forced("issue_refund"), "stream": stream, **ASK}
        call = asyncio.create_task(agent.chat.completions.create(**request))
        [waiting] = await pending(http)
        denied = await http.post(f"/approvals/{waiting['id']}/deny", json={"by": "bo", "reason": "over the cap"})
        assert denied.json()["status"] == "denied"
        reply = await asyncio.wait_for(call, 30)
    if stream:
        chunks = [chunk async for chunk in reply]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    else:
        message = reply.choices[0].message
        text, finish = message.content or "", reply.choices[0].finish_reason
        assert message.tool_calls is None
        assert (reply.model_extra or {})["flywheel_approvals"][0]["verdict"] == "denied"
    assert "The call to issue_refund was denied by bo: over the cap. Nothing was done." in text
    assert finish == "stop"


async def test_a_call_nobody_decides_in_time_is_denied_and_expired(backend, served):
    set_policy(backend, timeout_s=1.0)
    async with httpx.AsyncClient(base_url=served, timeout=30) as http:
        agent = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
        reply = await agent.chat.completions.create(
            model=ALIAS, tools=[REFUND], tool_choice=forced("issue_refund"), **ASK
        )
        assert "The call to issue_refund got no decision in time. Nothing was done." in (
            reply.choices[0].message.content or ""
        )
        [decision] = (reply.model_extra or {})["flywheel_approvals"]
        expired = (await http.get(f"/approvals/{decision['approval_id']}")).json()
        assert (expired["status"], expired["decided_by"]) == ("expired", "timeout")
        late = await http.post(f"/approvals/{expired['id']}/approve", json={"by": "ana"})
        assert late.status_code == 409 and "is expired by timeout" in late.json()["error"]["message"]


async def test_off_production_the_policy_decides_at_once_and_a_tool_outside_the_scope_is_refused(backend, served):
    set_policy(backend, allowed=["issue_refund", "lookup_order"], otherwise="allow")
    async with EpisodeClient(served) as episodes, httpx.AsyncClient(base_url=served, timeout=30) as http:
        episode = await episodes.create("refund-7", split="train")
        agent = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
        reply = await agent.chat.completions.create(
            model=ALIAS, tools=[REFUND], tool_choice=forced("issue_refund"), **ASK
        )  # a training rollout never waits for a person
        [decision] = (reply.model_extra or {})["flywheel_approvals"]
        assert (decision["verdict"], decision["by"]) == ("approved", "policy:allow")
        assert reply.choices[0].message.tool_calls
        recorded = (await http.get(f"/approvals/{decision['approval_id']}")).json()
        assert (recorded["status"], recorded["split"], recorded["episode_id"]) == ("approved", "train", episode.id)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await agent.chat.completions.create(model=ALIAS, tools=[REFUND, DELETE], **ASK)
        error = refused.value.body
        assert isinstance(error, dict) and (error["code"], error["param"]) == ("tool_not_allowed", "tools")
        assert "may not call the tool 'delete_account'" in error["message"]
        assert "issue_refund, lookup_order" in error["message"]
        plain = await agent.chat.completions.create(model=f"{MODEL}@1", tools=[DELETE], **ASK)
        assert plain.choices  # a checkpoint asked by its step is no deployment: no policy applies


# ---- run_agent ---------------------------------------------------------------------------------------------------


def refund_tool(done: list[dict]):
    @tool(high_impact=True)
    def issue_refund(order_id: int, amount: float) -> str:
        """Refund an order.

        Args:
            order_id: The order.
            amount: Dollars.
        """
        done.append({"order_id": order_id, "amount": amount})
        return "refunded"

    return issue_refund


async def agent_run(backend: LocalBackend, done: list[dict], **kw):
    client = openai.AsyncOpenAI(base_url=backend.base_url, api_key="unused", max_retries=0)
    return await run_agent(
        client, EMBEDDED_MODEL, ASK["messages"], [refund_tool(done)], max_turns=1, temperature=0, max_tokens=48,
        tool_choice=forced("issue_refund"), **kw,
    )  # fmt: skip


def tool_reply(trajectory) -> str:
    return next(m["content"] for m in trajectory.messages_and_choices if isinstance(m, dict) and m["role"] == "tool")


async def test_run_agent_asks_before_a_high_impact_tool_runs(backend):
    done: list[dict] = []
    with pytest.raises(ValueError, match="tool 'issue_refund' is high-impact: pass approve="):
        await agent_run(backend, done)
    denied = await agent_run(backend, done, approve=deny)
    assert done == [] and denied.metrics["denied_calls"] == 1
    assert tool_reply(denied).startswith("Error: The call to issue_refund was denied by policy:deny")
    allowed = await agent_run(backend, done, approve=allow)
    assert len(done) == 1 and allowed.metrics["approved_calls"] == 1 and tool_reply(allowed) == "refunded"
    small = parse_grader({"type": "python", "name": "small", "source": "def grade(sample, item):\n    return 1.0 if item['arguments']['amount'] <= 5 else 0.0\n"})  # fmt: skip
    decision = await GraderApprover(small)(
        ToolCallRequest(tool="issue_refund", arguments='{"order_id": 7, "amount": 20}')
    )
    assert (decision.verdict, decision.by, decision.reason) == ("denied", "policy:grader:small", "reward 0 < 0.5")
    decision = await GraderApprover(small)(
        ToolCallRequest(tool="issue_refund", arguments='{"order_id": 7, "amount": 2}')
    )
    assert decision.allowed


async def test_run_agent_in_production_waits_for_a_person_through_the_server(backend, served):
    done: list[dict] = []
    approver = HumanApprover(served, timeout_s=60, deployment=ALIAS)
    async with httpx.AsyncClient(base_url=served, timeout=30) as http:
        run = asyncio.create_task(agent_run(backend, done, approve=approver))
        [waiting] = await pending(http)
        assert (waiting["tool"], waiting["split"], waiting["deployment"]) == ("issue_refund", "production", ALIAS)
        assert done == [] and not run.done()
        await http.post(f"/approvals/{waiting['id']}/approve", json={"by": "ana"})
        trajectory = await asyncio.wait_for(run, 60)
    assert len(done) == 1 and tool_reply(trajectory) == "refunded"
    unreachable = await HumanApprover("http://127.0.0.1:9", timeout_s=5)(ToolCallRequest(tool="issue_refund"))
    assert unreachable.verdict == "denied" and "the approval service at http://127.0.0.1:9 failed" in (
        unreachable.reason or ""
    )


# ---- the command line -----------------------------------------------------------------------------------------


def test_the_command_line_sets_a_policy_lists_and_decides(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    runner = CliRunner()

    def flywheel(*args: str):
        return runner.invoke(app, [*args, "--db", url], env={"COLUMNS": "200", "USER": "ana"})

    grader = tmp_path / "small.json"
    grader.write_text(json.dumps({"type": "string_check", "name": "yes", "input": "{{sample.output_text}}",
                                  "reference": "yes", "operation": "eq"}))  # fmt: skip
    out = flywheel("approvals", "policy", ALIAS, "--high-impact", "issue_refund", "--allow", "issue_refund,lookup_order",
                   "--otherwise", "grader", "--grader", str(grader), "--why", "refunds move money")  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "may call issue_refund, lookup_order; issue_refund needs a person's approval" in out.output
    bad = flywheel("approvals", "policy", ALIAS, "--high-impact", "delete_account", "--allow", "lookup_order")
    assert bad.exit_code == 2 and "'delete_account' is not in the allowed tools" in bad.output
    (tmp_path / "broken.json").write_text('{"type": "string_check", "name": "x"}')
    broken = flywheel("approvals", "policy", ALIAS, "--high-impact", "x", "--otherwise", "grader", "--grader",
                      str(tmp_path / "broken.json"))  # fmt: skip
    assert broken.exit_code == 2 and "broken.json" in broken.output  # refused now, not at the first call it decides
    assert "lookup_order" in flywheel("approvals", "policies").output
    store = Store(url)
    with store.session() as s:
        first = approvals.request(s, tool="issue_refund", arguments='{"order_id": 7, "amount": 20}',
                                        timeout_s=600, actor="gateway", deployment=ALIAS)  # fmt: skip
        second = approvals.request(s, tool="issue_refund", arguments="{}", timeout_s=600, actor="gateway")
    listed = flywheel("approvals", "list")
    assert listed.exit_code == 0 and f"{ALIAS}" in listed.output and '"amount": 20' in listed.output
    assert '"amount": 20' in flywheel("approvals", "show", str(first.id)).output
    approved = flywheel("approvals", "approve", str(first.id), "--why", "within policy")
    assert approved.exit_code == 0 and f"Approval {first.id} (issue_refund) approved by ana." in approved.output
    again = flywheel("approvals", "deny", str(first.id))
    assert again.exit_code == 2 and "is approved by ana" in again.output
    assert flywheel("approvals", "deny", str(second.id), "--why", "no order").exit_code == 0
    assert "No pending approvals." in flywheel("approvals", "list").output
    unknown = flywheel("approvals", "approve", "99")
    assert unknown.exit_code == 2 and "No approval 99" in unknown.output
    with store.session() as s:
        assert [e.action for e in audit.events(s)][-2:] == ["approval.approve", "approval.deny"]
        assert approvals.get(s, first.id).reason == "within policy"
        assert audit.verify(s).ok
    store.close()
    assert flywheel("approvals", "unset", ALIAS).exit_code == 0
    assert "No tool policies" in flywheel("approvals", "policies").output


# ---- the dashboard -----------------------------------------------------------------------------------------------

AGENT = """
import json, sys
import openai
agent = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=120)
reply = agent.chat.completions.create(model=sys.argv[2], tools=[json.loads(sys.argv[3])],
    tool_choice={"type": "function", "function": {"name": "issue_refund"}}, **json.loads(sys.argv[4]))
message = reply.choices[0].message
calls = [c.function.name for c in message.tool_calls or []]
print(json.dumps({"calls": calls, "approvals": (reply.model_extra or {}).get("flywheel_approvals")}))
"""
DOCS_IMAGE = Path(__file__).parent.parent / "docs" / "images" / "dashboard-approvals.png"


def test_a_person_approves_a_waiting_call_in_the_dashboard_and_the_agent_goes_on(backend, served, browser, tmp_path):
    """An agent in a process of its own calls the deployment; its call of the high-impact tool waits; a person opens
    the dashboard (``flywheel dashboard``'s app: another server on the same store, so the decision reaches the
    gateway through the store), reads the call and approves it; the agent receives the call and ends."""
    set_policy(backend, allowed=["issue_refund"])
    dashboard = BackgroundServer(create_dashboard_app(backend.gateway.store, backend.path)).start()
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, f"{served}/v1", ALIAS, json.dumps(REFUND), json.dumps(ASK)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait = WebDriverWait(browser, 60)
    try:
        emulate(browser, 1280, 800)
        browser.get(f"http://{dashboard.host}:{dashboard.port}/ui/#/runs")
        wait.until(seen.element_to_be_clickable((By.LINK_TEXT, "Approvals"))).click()
        card = WebDriverWait(browser, 180).until(  # once the model has made the call (far slower on a loaded machine)
            seen.visibility_of_element_located((By.CSS_SELECTOR, "section.approval"))
        )
        approval_id = card.get_attribute("data-approval")
        assert "issue_refund" in card.text and ALIAS in card.text and "order_id" in card.text
        assert agent.poll() is None  # still waiting for the decision
        card.find_element(By.CSS_SELECTOR, "button.approve").click()  # nobody named yet: the page asks who decides
        wait.until(seen.text_to_be_present_in_element((By.CSS_SELECTOR, "section.approval .status"), "Say who decides"))
        browser.find_element(By.ID, "reviewer").send_keys("ana")
        card.find_element(By.NAME, "reason").send_keys("within the refund policy")
        browser.save_screenshot(str(tmp_path / "approvals-1280.png"))
        card.find_element(By.CSS_SELECTOR, "button.approve").click()
        row = wait.until(
            seen.visibility_of_element_located((By.CSS_SELECTOR, f'tr[data-approval="{approval_id}"]'))
        )  # decided: listed among the latest decisions
        assert "approved" in row.text and "ana" in row.text and "within the refund policy" in row.text
        out, err = agent.communicate(timeout=60)
        assert agent.returncode == 0, err
        result = json.loads(out)
        assert result["calls"] == ["issue_refund"]
        assert [(a["verdict"], a["by"], a["approval_id"]) for a in result["approvals"]] == [
            ("approved", "ana", int(approval_id))
        ]
        assert "Nothing waits for a decision." in browser.find_element(By.ID, "view").text
    finally:
        agent.kill()
        dashboard.stop()
    if os.environ.get("FLYWHEEL_DOCS_SCREENSHOT"):  # FLYWHEEL_DOCS_SCREENSHOT=1 refreshes the docs' picture
        shutil.copy(tmp_path / "approvals-1280.png", DOCS_IMAGE)


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_the_approvals_and_dashboard_apis_answer_whatever_they_are_sent_without_a_server_error(tmp_path, mode):
    """Schemathesis sends every approvals, tool-policy and dashboard route (``/ui/api``: runs, the loop, approvals)
    what the server's own OpenAPI schema allows (positive) and what it does not (negative), on a server of its own
    (no model: these routes need none): never a 5xx, every 4xx in OpenAI's shape. The decision's long poll is left
    out (a pending approval makes it wait up to 30 s a case); the tests above call it."""
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    app = create_app(ModelRegistry(), Gateway(store))
    mount_dashboard(app, store, tmp_path)
    server = BackgroundServer(app).start()
    try:
        base = f"http://{server.host}:{server.port}"
        called, routes = fuzz_routes(
            base, r"^/(approvals|tool-policies|ui/api)", mode, max_examples=8, exclude=r"/decision$"
        )
    finally:
        server.stop()
        store.close()
    assert routes >= 20  # approvals (5), tool policies (4), the dashboard's (runs 7, loop 6, approvals 2)
    assert len(called) >= (routes if mode == schemathesis.GenerationMode.POSITIVE else 5), sorted(called)
