"""The dashboard (flywheel/dashboard): its API over a run written as LocalBackend writes one (RunStore: checkpoints
that commit their history rows, validation rows appended, trajectories saved with their step) in a real SQLite store,
one checkpoint deployed; its mount on ``flywheel serve``'s app behind admin keys; and its page driven in a real
headless Chromium (Debian's chromium and chromium-driver, through Selenium)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

from flywheel.checkpoints.layout import model_path
from flywheel.checkpoints.run import RunStore
from flywheel.dashboard.app import create_dashboard_app, mount
from flywheel.gateway.auth import ApiKeys
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.store import Store, deployments, history
from flywheel.store.db import default_url
from flywheel.store.history import RunKey
from flywheel.train.checkpoint import Checkpoint, CheckpointState
from flywheel.train.config import TrainedWeights
from flywheel.types import Trajectory, set_intermediate_reward

from helpers import emulate, sampled

PROJECT, NAME = "dash", "calc-agent"
BASE = "Qwen/Qwen3-0.6B"
STEPS = 3
QUESTIONS = ["What is 2+3?", "What is 7*6?"]
REWARDS = [0.2, 0.9, 0.5]  # a group's members in the order saved: ranked, the second comes first
VAL_REWARDS = [0.3, 0.7, 0.5]  # step 2 is the best checkpoint
LOGPROBS = [-0.01, -0.3, -1.2, -4.0]  # the answer's tokens: sure, fairly sure, unsure, a guess
SYSTEM = {"role": "system", "content": "You answer with the calculator's result."}
ADMIN, AGENT = "admin-key-0123456789", "agent-key-0123456789"
DOCS_IMAGE = Path(__file__).parent.parent / "docs" / "images" / "dashboard-run.png"


def answer(member: int) -> Choice:
    """The sampled answer with the per-token log-probs the server returns when asked (``logprobs: true``)."""
    choice = sampled(None, [1, 2, 3, 4, 5], list(range(6, 6 + len(LOGPROBS))))
    texts = ["The", " answer", " is", f" {member}."]
    choice.message.content = "".join(texts)
    choice.logprobs = ChoiceLogprobs(
        content=[ChatCompletionTokenLogprob(token=t, logprob=lp, top_logprobs=[]) for t, lp in zip(texts, LOGPROBS)]
    )
    return choice


def trajectory(question: str, member: int, reward: float) -> Trajectory:
    """A tool agent's episode as run_agent records it: a sampled tool call (no log-probs asked), its result, a reply
    the agent edited (given as text: retokenized), the sampled answer with its log-probs; a grader's score and
    RULER's line about it as flywheel.graders.scoring and flywheel.rewards.ruler record them."""
    call = sampled(None, [1, 2], [3, 4], call=f"call-{member}")
    set_intermediate_reward(call, 0.25)
    return Trajectory(
        messages_and_choices=[
            SYSTEM,
            {"role": "user", "content": question},
            call,
            {"role": "tool", "tool_call_id": f"call-{member}", "content": "5"},
            {"role": "assistant", "content": "The calculator says 5."},
            {"role": "user", "content": "And the answer?"},
            answer(member),
        ],
        tools=[{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}],
        reward=reward,
        metrics={"grader/exact/reward": reward, "ruler_score": reward},
        logs=[f"RULER (judge) score {reward:.3f}: answer {member} explained"],
    )


def train_row(step: int) -> dict:
    """A training step's row with the trainer's metric names; the KL of step 2 is NaN, step 2 was skipped (no group
    had reward variance), and one metric is no chart's."""
    return {
        "time": 1000.0 + 10 * step,
        "step": step,
        "split": "train",
        "reward_mean": sum(REWARDS) / len(REWARDS) + 0.1 * step,
        "loss": 1.0 / step,
        "kl": float("nan") if step == 2 else 0.01 * step,
        "entropy": 2.0 - 0.1 * step,
        "clip_fraction": 0.0,
        "is_ratio_mean": 1.0,
        "is_ratio_max": 1.5 + step,
        "is_clipped_fraction": 0.01,
        "sampler_logprob_gap": 0.004,
        "rollout_seconds": 6.0,
        "score_seconds": 1.0,
        "train_seconds": 2.0,
        "tokens_trained": 100 * step,
        "groups_drawn": 4,
        "groups_kept": 2,
        "groups_dropped": 2,
        "zero_variance_fraction": 0.5,
        "my_metric": 7.0,
        "skipped": 1.0 if step == 2 else 0.0,
        **({"skip_reason": 1.0} if step == 2 else {}),
        "checkpoint": True,
    }


def write_run(home: Path) -> RunStore:
    """STEPS steps, each: its groups' trajectories saved, a checkpoint committing its row, a validation row and
    trajectories (as LocalBackend.train and .log do); step 2 deployed; and a run of another machine in the store."""
    run = RunStore(model_path(home, PROJECT, NAME))
    for step in range(1, STEPS + 1):
        groups = [trajectory(q, j, r) for q in QUESTIONS for j, r in enumerate(REWARDS)]
        run.save_trajectories("train", step, groups)
        state = CheckpointState(step=step, trained_weights=TrainedWeights(), rows=[train_row(step)])
        adapter = {"peft_type": "LORA", "base_model_name_or_path": BASE}  # as the trainer writes a LoRA checkpoint's
        run.write(Checkpoint(state=state, weights={"w": torch.zeros(2)}, adapter_config=adapter))
        run.save_trajectories("val", step, [trajectory(QUESTIONS[0], 0, VAL_REWARDS[step - 1])])
        reward = VAL_REWARDS[step - 1]
        run.append([{"time": 1005.0 + 10 * step, "step": step, "split": "val", "val/reward": reward, "val/n": 1}])
    store = Store(default_url(home))
    with store.session() as s:
        deployments.deploy(s, f"{NAME}@production", 2, actor="test")
        history.add(s, RunKey("other", "far-away", "r2"), [{"time": 5.0, "step": 4, "split": "train", "loss": 1}])
    store.close()
    return run


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("dashboard-home")
    write_run(home)
    return home


@pytest.fixture(scope="module")
def store(home: Path):
    store = Store(default_url(home))
    yield store
    store.close()


@pytest.fixture(scope="module")
def client(store: Store, home: Path) -> TestClient:
    return TestClient(create_dashboard_app(store, home))


RUN = f"/ui/api/runs/{PROJECT}/{NAME}"


def test_runs_their_status_and_best_validation(client: TestClient, home: Path):
    runs = client.get("/ui/api/runs").json()
    assert [(r["project"], r["name"]) for r in runs] == [("other", "far-away"), (PROJECT, NAME)]  # latest first
    ours = runs[1]
    assert ours["status"] == "stopped" and ours["last_step"] == STEPS and ours["rows"] == 2 * STEPS
    assert (ours["best_val_reward"], ours["best_val_step"]) == (0.7, 2)
    assert ours["wall_seconds"] == (1005.0 + 10 * STEPS) - 1010.0
    assert ours["base_model"] == BASE  # from its latest checkpoint's adapter config
    assert (ours["tokens_trained"], ours["step_seconds"]) == (100 * (1 + 2 + 3), STEPS * (6.0 + 1.0 + 2.0))
    assert runs[0]["status"] == "elsewhere" and runs[0]["best_val_reward"] is None
    assert (runs[0]["base_model"], runs[0]["tokens_trained"], runs[0]["step_seconds"]) == (None, None, None)
    held = RunStore(model_path(home, PROJECT, NAME))
    held.lock()  # a backend has the model registered
    try:
        assert client.get("/ui/api/runs").json()[1]["status"] == "training"
    finally:
        held.unlock()
    assert client.get("/ui/api/runs").json()[1]["status"] == "stopped"


def test_history_rows_with_nan_as_null(client: TestClient):
    response = client.get(f"{RUN}/history")
    assert "NaN" not in response.text
    rows = response.json()["rows"]
    assert [(r["step"], r["split"]) for r in rows] == [(s, split) for s in (1, 2, 3) for split in ("train", "val")]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["metrics"]["kl"] for r in train] == [0.01, None, 0.03]
    assert all(r["checkpoint"] for r in train) and "checkpoint" not in train[0]["metrics"]
    assert rows[1]["metrics"] == {"val/reward": 0.3, "val/n": 1.0}


def test_checkpoints_best_and_deployed(client: TestClient):
    body = client.get(f"{RUN}/checkpoints").json()
    assert body["directory"].endswith(f"{PROJECT}/models/{NAME}")
    assert [
        (c["step"], c["val_reward"], c["best"], [d["name"] for d in c["deployed"]]) for c in body["checkpoints"]
    ] == [
        (1, 0.3, False, []),
        (2, 0.7, True, [f"{NAME}@production"]),
        (3, 0.5, False, []),
    ]
    where = body["checkpoints"][1]["deployed"][0]  # deployed where: the alias, its stage and share, and since when
    assert (where["stage"], where["share"], where["serves"], where["updated_by"]) == (
        "production",
        None,
        f"{NAME}@2",
        "test",
    )
    assert all(c["gate"] is None for c in body["checkpoints"])  # no gate asked here (tests/test_dashboard_loop.py)
    assert client.get("/ui/api/runs/other/far-away/checkpoints").json() == {"directory": None, "checkpoints": []}


def test_rollouts_paged_groups_ranked_and_one_trajectory(client: TestClient):
    steps = client.get(f"{RUN}/rollouts").json()
    assert [(s["split"], s["step"], s["trajectories"]) for s in steps] == [
        *(("train", s, 6) for s in (1, 2, 3)),
        *(("val", s, 1) for s in (1, 2, 3)),
    ]
    first = client.get(f"{RUN}/trajectories", params={"step": 2, "limit": 4}).json()
    assert len(first["items"]) == 4 and first["next_offset"] == 4
    rest = client.get(f"{RUN}/trajectories", params={"step": 2, "limit": 4, "offset": 4}).json()
    assert len(rest["items"]) == 2 and rest["next_offset"] is None
    assert len({t["id"] for t in first["items"] + rest["items"]}) == 6
    assert first["items"][0]["tool_calls"] == 1 and first["items"][0]["answer"] == "The answer is 0."

    groups = client.get(f"{RUN}/groups", params={"step": 2}).json()
    assert [g["prompt"] for g in groups] == QUESTIONS
    assert [m["reward"] for m in groups[1]["members"]] == sorted(REWARDS, reverse=True)
    assert groups[0]["reward_spread"] == pytest.approx(max(REWARDS) - min(REWARDS))
    group = client.get(f"{RUN}/groups/1", params={"step": 2}).json()
    assert [t["reward"] for t in group["members"]] == sorted(REWARDS, reverse=True)

    best = group["members"][0]
    one = client.get(f"/ui/api/trajectories/{best['id']}").json()
    assert one == best and (one["split"], one["step"], one["branch"]) == ("train", 2, None)
    call, result = one["messages"][2], one["messages"][3]
    assert call["sampled"] and call["reward"] == 0.25
    assert call["tool_calls"] == [{"id": "call-1", "name": "calc", "arguments": '{"e": "2+3"}'}]
    assert (result["role"], result["tool_call_id"], result["content"]) == ("tool", "call-1", "5")
    assert one["graders"] == {"grader/exact/reward": 0.9, "ruler_score": 0.9}
    assert one["judge"] == ["RULER (judge) score 0.900: answer 1 explained"] and one["tools"] == ["calc"]
    edited, last = one["messages"][4], one["messages"][6]
    assert call["tokens"] is None and not call["retokenized"]  # sampled without log-probs: none to show
    assert edited["retokenized"] and not edited["sampled"] and edited["tokens"] is None
    assert [(t["text"], t["logprob"]) for t in last["tokens"]] == list(zip(["The", " answer", " is", " 1."], LOGPROBS))
    assert not any(m["retokenized"] for m in one["messages"] if m["role"] != "assistant")


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/ui/api/trajectories/99999", 404, "No saved trajectory has the id 99999"),
        ("/ui/api/runs/dash/nobody/history", 404, "Runs: dash/calc-agent, other/far-away"),
        (f"{RUN}/history?run=nope", 404, "has no run 'nope'"),
        (f"{RUN}/groups/7?step=1", 404, "has 2 group(s)"),
        (f"{RUN}/groups?step=9", 404, "no trajectories of split 'train' at step 9"),
        (f"{RUN}/trajectories?limit=0", 422, "greater than or equal to 1"),
        (f"{RUN}/trajectories?offset=-1", 422, "greater than or equal to 0"),
        (f"{RUN}/groups?step=x", 422, "valid integer"),
        ("/ui/api/trajectories/abc", 422, "valid integer"),
    ],
)
def test_bad_ids_are_404s_and_bad_parameters_422s(client: TestClient, path: str, status: int, says: str):
    response = client.get(path)
    assert response.status_code == status and says in response.text


def test_the_page_and_its_vendored_chart_library_are_served(client: TestClient):
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and 'src="app.js"' in page.text and "http" not in page.text  # nothing from a CDN
    assert client.get("/ui/vendor/uPlot.iife.min.js").text.startswith("/*! https://github.com/leeoniya/uPlot")
    assert client.get("/ui/app.js").headers["content-type"].startswith("text/javascript")


def test_on_flywheel_serve_the_page_is_public_and_its_api_admin_only(store: Store, home: Path):
    app = create_app(ModelRegistry(), auth=ApiKeys([("admin", ADMIN), ("agent", AGENT)]))
    mount(app, store, home)
    http = TestClient(app)
    assert http.get("/ui/").status_code == 200 and http.get("/ui/app.js").status_code == 200
    assert http.get("/ui/api/runs").status_code == 401
    assert http.get("/ui/api/runs", headers={"X-API-Key": AGENT}).status_code == 403
    assert len(http.get("/ui/api/runs", headers={"X-API-Key": ADMIN}).json()) == 2
    missing = http.get("/ui/api/trajectories/99999", headers={"X-API-Key": ADMIN})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    bad = http.get(f"{RUN}/trajectories?limit=0", headers={"X-API-Key": ADMIN})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.limit"  # serve's shape for bad input


# ---- the page in a real browser ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(store: Store, home: Path):
    """The dashboard on a loopback port: a real uvicorn server on a thread."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_dashboard_app(store, home), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_the_page_in_chromium(browser, served: str):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    shots = Path(tempfile.mkdtemp(prefix="dashboard-shots-"))
    wait = WebDriverWait(browser, 10)

    def size(width: int, height: int, dark: bool = False) -> None:
        emulate(browser, width, height, dark)

    def click(text: str) -> None:
        wait.until(seen.element_to_be_clickable((By.LINK_TEXT, text))).click()

    size(1280, 800)
    browser.get(f"{served}/ui/")
    ours = wait.until(seen.visibility_of_element_located((By.XPATH, f"//tr[td/a[text()='{NAME}']]")))
    assert ours.find_element(By.CSS_SELECTOR, ".base-model").text == BASE
    assert ours.find_element(By.CSS_SELECTOR, ".cost").text == "600 tokens trained · 27s in steps"
    far = browser.find_element(By.XPATH, "//tr[td/a[text()='far-away']]")
    unknown = "\N{EN DASH}"  # what the page shows for what the store does not know
    assert [far.find_element(By.CSS_SELECTOR, c).text for c in (".base-model", ".cost")] == [unknown, unknown]
    browser.save_screenshot(str(shots / "runs-1280.png"))
    click(NAME)  # the runs table links to the run
    loss = wait.until(seen.visibility_of_element_located((By.CSS_SELECTOR, 'figure[data-chart="loss"] canvas')))
    sections = [s.get_attribute("data-section") for s in browser.find_elements(By.CSS_SELECTOR, "section.curves")]
    assert sections == ["reward", "policy", "importance", "time", "sampling", "other"]  # no staleness metric: none
    charts = {f.get_attribute("data-chart"): f for f in browser.find_elements(By.CSS_SELECTOR, "figure.chart")}

    def points(chart: str) -> dict[str, int]:
        legend = charts[chart].find_elements(By.CSS_SELECTOR, "li[data-series]")
        return {li.get_attribute("data-series"): int(li.get_attribute("data-points")) for li in legend}

    assert points("reward") == {"reward_mean": STEPS, "val/reward": STEPS}  # train and validation rows, one chart
    assert points("is_ratio") == {"is_ratio_mean": STEPS, "is_ratio_max": STEPS}
    assert points("seconds") == {"rollout_seconds": STEPS, "score_seconds": STEPS, "train_seconds": STEPS}
    assert points("tokens_per_second") == {"tokens_per_second": STEPS}  # derived: tokens_trained / train_seconds
    assert points("groups") == {"groups_drawn": STEPS, "groups_kept": STEPS, "groups_dropped": STEPS}
    assert points("loss") == {"loss": STEPS} and points("kl") == {"kl": STEPS - 1}  # its NaN is no point
    other = browser.find_element(By.CSS_SELECTOR, 'section[data-section="other"]')
    assert [f.get_attribute("data-chart") for f in other.find_elements(By.CSS_SELECTOR, "figure")] == [
        "my_metric",
        "val/n",
    ]
    label = charts["reward"].get_attribute("aria-label")
    assert "reward_mean 3 points" in label and "val/reward 3 points, last 0.5" in label
    assert charts["reward"].get_attribute("data-skipped") == "2" and "skipped steps 2" in label  # the marker
    assert "skipped: step 2" in charts["reward"].text
    assert browser.find_element(By.ID, "skipped").text == "1"  # and the count in the facts
    assert charts["loss"].get_attribute("data-skipped") is None
    assert loss.size["width"] > 200
    best = browser.find_element(By.CSS_SELECTOR, ".badge.best").find_element(By.XPATH, "./ancestor::tr")
    assert best.text.startswith("2 ") and f"{NAME}@production" in best.text
    browser.save_screenshot(str(shots / "run-1280.png"))
    size(390, 844, dark=True)  # a phone, in the dark: the page is drawn again, its charts to the phone's width
    wait.until(seen.staleness_of(loss))
    browser.save_screenshot(str(shots / "run-phone-dark.png"))
    drawn = browser.find_element(By.CSS_SELECTOR, "figure.chart")
    size(1280, 800)
    wait.until(seen.staleness_of(drawn))  # drawn again: what follows clicks the new page's links

    click("Rollouts →")
    wait.until(seen.visibility_of_element_located((By.XPATH, "//td[text()='train']")))
    browser.find_element(By.CSS_SELECTOR, f"a[href*='groups?split=train&step={STEPS}']").click()
    group = wait.until(seen.visibility_of_element_located((By.CSS_SELECTOR, 'section[data-group="1"]')))
    ranking = [float(li.get_attribute("data-reward")) for li in group.find_elements(By.CSS_SELECTOR, "ol.ranking li")]
    assert ranking == sorted(REWARDS, reverse=True) and QUESTIONS[1] in group.text
    group.find_element(By.LINK_TEXT, "side by side →").click()
    first = wait.until(seen.visibility_of_element_located((By.CSS_SELECTOR, 'section[data-rank="1"]')))
    assert "reward 0.9" in first.text and "answer 1 explained" in first.text  # the judge's explanation
    browser.save_screenshot(str(shots / "group-1280.png"))

    first.find_element(By.LINK_TEXT, "open").click()
    call = wait.until(seen.visibility_of_element_located((By.CSS_SELECTOR, '.call[data-tool="calc"]')))
    assert call.text == '→ calc({"e": "2+3"})'
    assert browser.find_element(By.ID, "reward").text == "0.9"
    assert "result of call-1" in browser.find_element(By.CSS_SELECTOR, ".msg.tool").text
    badges = browser.find_elements(By.CSS_SELECTOR, ".badge.retokenized")
    assert len(badges) == 1 and badges[0].find_element(By.XPATH, "./ancestor::article").text.endswith("says 5.")
    assert browser.find_element(By.ID, "retokenized").text == "1"
    assert not browser.find_elements(By.CSS_SELECTOR, ".tok")  # uncoloured until asked
    browser.find_element(By.ID, "by-logprob").click()  # the toggle colours the sampled tokens
    spans = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".msg pre.tokens .tok"))
    assert [float(t.get_attribute("data-logprob")) for t in spans] == LOGPROBS
    assert [t.get_attribute("class") for t in spans] == ["tok lp0", "tok lp1", "tok lp2", "tok lp4"]
    assert (
        spans[2].get_attribute("title") == '" is": log-prob -1.2, p 0.301'
        and spans[3].get_attribute("textContent") == " 1."
    )
    assert len(browser.find_elements(By.CSS_SELECTOR, ".tokens-legend li")) == 5
    unsaved = browser.find_elements(By.CSS_SELECTOR, ".no-logprobs")  # the tool call asked for none: said, not faked
    assert len(unsaved) == 1 and unsaved[0].find_element(By.XPATH, "./ancestor::article").text.count("→ calc") == 1
    browser.save_screenshot(str(shots / "trajectory-1280.png"))
    size(390, 844, dark=True)  # the coloured tokens at a phone's width, in the dark
    wait.until(seen.staleness_of(spans[0]))  # drawn again
    coloured = browser.find_element(By.CSS_SELECTOR, ".msg pre.tokens")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", coloured)
    browser.save_screenshot(str(shots / "trajectory-phone-dark.png"))
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    print(f"screenshots: {shots}")
    if os.environ.get("FLYWHEEL_DOCS_SCREENSHOT"):  # FLYWHEEL_DOCS_SCREENSHOT=1 refreshes the docs' picture
        shutil.copy(shots / "run-1280.png", DOCS_IMAGE)
