"""The loop on the session's backend: held-out evaluation through the gateway's runners (flywheel/loop/evaluate.py:
a real Runner with a small agent, each item scored by a grader stack, grades recorded, results paired by the gate),
and the loop itself (flywheel/loop/driver.py: production episodes in, training steps; its promotion ladder,
flywheel/loop/ladder.py: candidates through the gate to production and to a canary, the canary promoted or rolled
back by its episodes, every decision audited)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC
from pathlib import Path

import openai
import pytest
import torch
import yaml
from typer.testing import CliRunner

from flywheel.agents.dynamic_sampling import DynamicSamplingConfig
from flywheel.cli import app
from flywheel.gateway.client import EpisodeClient, QueueClient
from flywheel.gateway.runner import Runner, current_lease
from flywheel.graders.stack import parse_stack
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.loop.alarm import AlarmPolicy, reward_hacking
from flywheel.loop.canary import CanaryPolicy
from flywheel.loop.driver import Loop, LoopConfig
from flywheel.loop.evaluate import evaluate
from flywheel.loop.gate import GatePolicy, HeldOutSet, decide, levels
from flywheel.loop.ladder import REWIND
from flywheel.loop.shadow import ShadowPolicy
from flywheel.store import Store, audit, deployments, episodes, grades, tasks
from flywheel.store.arms import shadow_episode
from flywheel.train.checkpoint import Checkpoint, CheckpointState
from flywheel.types import Trajectory, TrajectoryGroup

from helpers import WATCH_STACK, answered, heldout_run, record_call

HELDOUT = HeldOutSet(
    name="colours",
    items={f"q{i}": {"question": f"Name a colour that starts with the letter {c}.", "fail": c == "x"} for i, c in enumerate("bgrx")},
)  # fmt: skip
STACK = parse_stack({
    "name": "colours",
    "reward": {"type": "string_check", "name": "blue", "input": "{{sample.output_text}}", "reference": "lue", "operation": "ilike"},
    "safety": {"type": "string_check", "name": "not-empty", "input": "{{sample.output_text}}", "reference": "", "operation": "ne"},
})  # fmt: skip


async def agent(task: dict, base_url: str) -> float:
    if task["fail"]:
        raise RuntimeError("this environment is broken for item x")
    client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
    await client.chat.completions.create(
        model=current_lease().model,
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=6,
        temperature=task.get("temperature", 0),  # greedy unless the item says (a sampled evaluation is confirmed)
    )
    return 0.0  # the agent's own reward is not what the gate looks at: the stack grades the episode


async def test_held_out_items_run_by_runners_are_scored_recorded_and_paired(backend: LocalBackend):
    root = backend.base_url.removesuffix("/v1")
    runner = asyncio.create_task(Runner(root, agent, concurrency=4, poll_interval=0.1).run())
    try:
        async with QueueClient(root) as queue:
            # the same model on both sides: its runs are queued warm-ups first, then item by item, alternating
            first, again = await evaluate(queue, HELDOUT, [EMBEDDED_MODEL] * 2, STACK, samples=2, max_wait=300,
                                          store=backend.gateway.store)  # fmt: skip
            working = HELDOUT.model_copy(update={"items": {k: v for k, v in HELDOUT.items.items() if not v["fail"]}})
            (greedy,) = await evaluate(queue, working, [EMBEDDED_MODEL], STACK, max_wait=300)
    finally:
        runner.cancel()
    assert [r.item for r in first.results] == ["q0", "q1", "q2", "q3"] and first.failed_items == ["q3"]
    assert len(first.episodes) == 6 and first.stack == STACK.version and first.heldout.startswith("colours@")
    answered = first.results[:3]
    assert all(r.tokens > 0 and r.latency_ms > 0 and r.safe and r.tool_calls == 0 for r in answered)
    # every attempt failed: the item counts as not done, and not safe (missing evidence is not good evidence)
    assert (first.results[3].score, first.results[3].safe, first.results[3].failures) == (0.0, False, 2)
    with backend.gateway.store.session() as s:
        graded = [g for e in first.episodes for g in grades.grades_of(s, e)]
    assert len(graded) == 12 and {g.version for g in graded} == {STACK.version}  # reward + safety per episode
    with backend.gateway.store.session() as s:  # as the runners claimed them: warm-ups, then item by item
        timed = sorted(
            (episodes.get_episode(s, i) for i in first.episodes + again.episodes), key=lambda e: e.created_at
        )
        warm = [e for r in (first, again) for e in episodes.list_episodes(s, task_id=f"eval:colours:{HELDOUT.version}:{r.id}-warm")]  # fmt: skip
    assert [e.task_id.rsplit(":", 2)[1] for e in timed] == [first.id, first.id, again.id, again.id] * 3  # q0..q2
    assert len(warm) == 2 and max(e.created_at for e in warm) < timed[0].created_at  # one untimed episode a side

    assert {g.component for g in graded} == {"reward", "safety"}
    # greedy decoding: the same model twice gives the same scores, and the gate sees no lift
    assert [r.score for r in again.results] == [r.score for r in first.results]
    # every call at temperature 0 and every attempt finished: the gate needs no repeat (an item failed: it does)
    assert greedy.greedy and not first.greedy and not again.greedy
    decision = decide(again.results, first.results, GatePolicy(min_items=2))
    assert not decision.promote and decision.lift.mean == 0.0


# rewards that differ inside every group, whatever the model says: every iteration trains a step
NOISY = {"name": "noisy", "reward": {"type": "python", "name": "coin", "source": "import random\ndef grade(sample, item):\n    return random.random()"}}  # fmt: skip


def write_config(tmp_path: Path) -> Path:
    (tmp_path / "stack.json").write_text(json.dumps(NOISY))
    items = {k: v for k, v in HELDOUT.items.items() if not v["fail"]}
    (tmp_path / "heldout.json").write_text(json.dumps({"name": "colours", "items": items}))
    config = {
        "name": "loop-agent", "project": "tests", "agent": "test_loop:agent", "runners": 4,
        "stack": "stack.json", "heldout": "heldout.json", "group_size": 2, "groups_per_step": 2, "steps": 4,
        "candidate_every": 2, "canary": {"share": 0.25, "min_episodes": 2}, "max_wait": 300,
        "train": {"learning_rate": 1e-5},
        # any candidate passes (a random reward, no safety grader, turned off explicitly): this test is about what
        # follows; latency has no limit (on a loaded 2-core machine one side's wall time was 14x the other's)
        "gate": {"min_items": 2, "min_lift": -2.0, "require_safety": False,
                 "max_increase": {"tokens": 10, "tool_calls": 10, "latency_ms": 1e9}},
    }  # fmt: skip
    (tmp_path / "loop.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "loop.yaml"


async def test_the_loop_takes_production_tasks_trains_and_sends_a_gated_candidate_to_shadow(
    backend: LocalBackend, tmp_path
):
    """Production episodes' items are trained on, and the step-2 checkpoint (step 1 is not due: candidate_every 2)
    meets the production deployment through the gate and, passing, becomes the shadow (then the canary: the shadow
    and canary watches' tests have what follows; without a shadow stage it is the canary). Production is deployed at
    the loop's first step beforehand, as an earlier promotion would have; a loop's first candidate, which meets the
    base model and becomes production, is test_flywheel_loop_runs_from_the_command_line's.

    The production episodes, recorded by the gateway from the base model (the loop model's step 0), also join the
    groups of their items as off-policy members, once each (scored by the stack, trained with the sampler's
    log-probs they were logged with: their tokens' importance ratios are reported apart); a third, whose prompt had
    an e-mail address redacted (and its token ids with it), is left out as redacted. Stale ones: test_offpolicy.py."""
    path = write_config(tmp_path)
    heldout = json.loads((tmp_path / "heldout.json").read_text())  # sampled: the gate confirms a passing screen
    heldout["items"] = {k: v | {"temperature": 1.0} for k, v in heldout["items"].items()}
    (tmp_path / "heldout.json").write_text(json.dumps(heldout))
    # intake from the last three finished production episodes: this test's (the session's other tests leave some too)
    config = LoopConfig.load(path).model_copy(
        update={"steps": 2, "off_policy_members": 1, "shadow": ShadowPolicy(share=0.25), "intake_limit": 3}
    )
    assert config.stack == tmp_path / "stack.json"  # paths are relative to the config file
    store, root = backend.gateway.store, backend.base_url.removesuffix("/v1")
    logged = []  # three production episodes, finished, whose items the loop should learn from
    async with EpisodeClient(root) as episode_client:
        for colour, prompt in (("b", ""), ("g", ""), ("b", "Reply to ana@example.com: ")):
            item = {"id": f"prod-{colour}", "question": f"Name a colour starting with {colour}.", "fail": False}
            e = await episode_client.create(f"ticket-{colour}", split="production", metadata={"item": item})
            client = openai.AsyncOpenAI(base_url=e.base_url, api_key="-", max_retries=0)
            messages = [{"role": "user", "content": prompt + item["question"]}]
            await client.chat.completions.create(model=EMBEDDED_MODEL, messages=messages, max_tokens=6, temperature=1)
            logged.append((await episode_client.finish(e.id, 1.0)).id)
    with store.session() as s:
        deployments.deploy(s, "loop-agent@production", 1, actor="test", reason="the loop's first step")
        sampled = sum(
            len(c.response["choices"][0].get("token_ids", [])) for e in logged[:2] for c in episodes.calls(s, e)
        )
    loop = Loop(config, backend, actor="test")
    report = await loop.run()
    assert report.steps == [1, 2] and report.intake == 2  # two items (prod-b twice)
    first, second = report.off_policy
    assert (first.step, first.episodes, first.left_out) == (1, sorted(logged[:2]), {"redacted": 1})
    assert first.is_ratio_mean is not None and abs(first.is_ratio_mean - 1) < 0.5  # the same weights, bf16 apart
    assert (second.step, second.joined, second.left_out, second.is_ratio_mean) == (2, 0, {"redacted": 1}, None)
    row = next(r for r in backend.history(loop.model) if r["step"] == 1 and r["split"] == "train")
    assert (row["off_policy_members"], row["off_policy_tokens"]) == (2, sampled)  # every sampled token, corrected
    extra = await loop.model.checkpoint_extra()  # joined once, across restarts too: kept with the checkpoint
    assert extra["loop"]["off_policy"] == dict.fromkeys(logged[:2], 0)
    (candidate,) = report.candidates
    # it meets the production deployment's checkpoint and, passing, becomes the shadow (no production traffic yet)
    assert (candidate.step, candidate.production, candidate.deployed) == (
        2, "loop-agent@1", "loop-agent@shadow"
    ), candidate.decision.checks  # fmt: skip
    assert report.canary == [] and report.shadow == []
    with store.session() as s:
        production, shadow = deployments.get(s, "loop-agent@production"), deployments.get(s, "loop-agent@shadow")
        assert (production.step, production.share, shadow.step, shadow.share) == (1, None, 2, 0.25)
        assert deployments.find(s, "loop-agent@canary") is None
        gate_event = next(e for e in audit.events(s, subject="loop-agent@2") if e.action == "gate.pass")
        # both sides evaluated twice: the screen passed (any candidate does here), then its confirmation
        assert gate_event.id == candidate.event_id and len(gate_event.details["evaluations"]) == 4
        assert gate_event.details["look"] == 1
        assert gate_event.details["production"] == "loop-agent@1"  # production's checkpoint, not its alias
        assert deployments.history(s, "loop-agent@shadow")[-1].details["gate_event"] == gate_event.id
        trained = [
            e for e in episodes.list_episodes(s, split="train", limit=1000) if e.task_id.startswith("train:loop-agent:")
        ]
        assert len(trained) == 2 * 2 * 2  # steps x groups x group size
        assert all(grades.grades_of(s, e, loop.stack.version) for e in [*(e.id for e in trained), *logged[:2]])
        assert audit.verify(s).ok


async def test_iterations_whose_groups_cannot_train_take_no_step_and_make_no_candidate(backend: LocalBackend, tmp_path):
    """Equal rewards in every group: no step is taken, so no checkpoint is a candidate (the loop ends after its
    iterations; it once waited forever for a step that never came)."""
    path = write_config(tmp_path)
    flat = NOISY | {"reward": NOISY["reward"] | {"source": "def grade(sample, item):\n    return 0.5"}}
    (tmp_path / "stack.json").write_text(json.dumps(flat))
    config = LoopConfig.load(path).model_copy(update={"name": "flat-agent", "tasks": None, "steps": 2})
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1", "question": "Name a colour.", "fail": false}\n')
    config.tasks = tmp_path / "tasks.jsonl"
    report = await Loop(config, backend, actor="test").run()
    assert report.steps == [0, 0] and report.candidates == []


async def test_dynamic_sampling_draws_until_the_step_has_groups_that_differ_and_says_what_it_drew(
    backend: LocalBackend, tmp_path
):
    """With ``dynamic_sampling``, pool items are drawn, run and scored in waves until the step has
    ``groups_per_step`` groups whose rewards differ: here 2 hard items (a random reward) among 6 easy ones (always
    1.0, no signal). Each item is drawn at most once a step; the report and the step's history row say how many
    groups were drawn, kept and dropped. A pool with nothing but easy items takes no step, with no error."""
    path = write_config(tmp_path)
    source = "import random\ndef grade(sample, item):\n    return 1.0 if item['easy'] else random.random()"
    (tmp_path / "stack.json").write_text(json.dumps(NOISY | {"reward": NOISY["reward"] | {"source": source}}))
    tasks = [{"id": f"t{i}", "question": "Name a colour.", "fail": False, "easy": i >= 2} for i in range(8)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    config = LoopConfig.load(path).model_copy(
        # the seed tasks alone (the session's other tests leave production episodes: no intake from them)
        update={"name": "dapo-agent", "tasks": tmp_path / "tasks.jsonl", "steps": 1, "candidate_every": 100,
                "dynamic_sampling": DynamicSamplingConfig(max_draws=4, oversample=1.5), "intake_split": "none"}
    )  # fmt: skip
    loop = Loop(config, backend, actor="test")
    report = await loop.run()
    assert report.steps == [1]
    (sampled,) = report.sampling
    assert sampled["step"] == 1 and sampled["groups_kept"] == 2 and sampled["sampling_short"] == 0.0
    assert sampled["groups_drawn"] == sampled["groups_kept"] + sampled["groups_dropped"] <= 8
    with backend.gateway.store.session() as s:
        drawn = [e.task_id for e in episodes.list_episodes(s, split="train", limit=1000) if e.task_id.startswith("train:dapo-agent:1:")]  # fmt: skip
    items = [task_id.split(":")[3] for task_id in drawn]
    assert len(items) == 2 * sampled["groups_drawn"] and {"t0", "t1"} <= set(items)  # group_size 2 each
    assert all(items.count(k) == 2 for k in set(items))  # each item drawn once (one group of 2)
    row = next(r for r in backend.history(loop.model) if r["step"] == 1 and r["split"] == "train")
    assert (row["groups_drawn"], row["groups_kept"]) == (sampled["groups_drawn"], 2)

    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[2:]))
    easy = Loop(config.model_copy(update={"name": "easy-agent"}), backend, actor="test")
    report = await easy.run()
    assert report.steps == [0] and report.sampling == [] and report.candidates == []


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"stepz": 3}, "stepz: Extra inputs are not permitted"),
        ({"group_size": 1}, "group_size: Input should be greater than or equal to 2"),
        ({"stack": "missing.yaml"}, "cannot read"),
        ({"tasks": "tasks.jsonl"}, "tasks.jsonl line 2: not JSON"),
        ({"off_policy_members": 1, "train": {"importance_sampling_cap": None}}, "needs train.importance_sampling_cap"),
    ],
)
def test_flywheel_loop_refuses_a_broken_configuration_in_a_few_lines_before_loading_a_model(tmp_path, change, says):
    path = write_config(tmp_path)
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1"}\n{"id": \n')
    path.write_text(yaml.safe_dump(yaml.safe_load(path.read_text()) | change))
    result = CliRunner().invoke(app, ["loop", str(path), "--home", str(tmp_path / "home")])
    assert result.exit_code == 2 and says in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "home").exists()


def test_flywheel_loop_runs_from_the_command_line(tmp_path):
    path = write_config(tmp_path)
    config = yaml.safe_load(path.read_text()) | {"steps": 1, "candidate_every": 1, "tasks": "tasks.jsonl"}
    path.write_text(yaml.safe_dump(config))
    copied = json.dumps({"id": "t2", **HELDOUT.items["q0"]})  # a held-out item under another id: never trained on
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1", "question": "Name a colour.", "fail": false}\n' + copied + "\n")
    result = CliRunner().invoke(
        app, ["loop", str(path), "--home", str(tmp_path / "home"), "--actor", "ci"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "1 iterations, step 1" in result.output and "loop-agent@production" in result.output
    assert "held-out items kept out of training: 1 (seed tasks 1, production episodes 0" in result.output
    # a loop with no production deployment: its first candidate met the base model and, passing, became production
    store = Store(f"sqlite:///{tmp_path / 'home' / 'flywheel.db'}")
    try:
        with store.session() as s:
            gate_event = next(e for e in audit.events(s, subject="loop-agent@1") if e.action == "gate.pass")
            assert gate_event.details["production"] == EMBEDDED_MODEL
            assert deployments.get(s, "loop-agent@production").step == 1
            assert deployments.history(s, "loop-agent@production")[-1].details["gate_event"] == gate_event.id
            assert deployments.find(s, "loop-agent@canary") is None and audit.verify(s).ok
    finally:
        store.close()


def mirrored(store, origin: str, alias: str, step: int, answer: str, messages: list | None = None) -> str:
    """The shadow episode of production episode ``origin``, its call answered by ``alias`` as the gateway's mirror
    records it (tests/test_canary.py has the gateway's own)."""
    with store.session() as s:
        e = shadow_episode(s, origin, alias)
        record_call(s, e.id, alias, step, answer, messages)
    return e.id


async def test_the_canary_is_promoted_or_rolled_back_by_the_episodes_it_answered(backend: LocalBackend, tmp_path):
    path = write_config(tmp_path)
    (tmp_path / "stack.json").write_text(json.dumps(WATCH_STACK))
    config = LoopConfig.load(path).model_copy(update={"name": "watch-agent"})
    # one look, at 3 episodes of each arm (the defaults need many more: bench/gate_error.py)
    config.canary = CanaryPolicy(share=0.5, min_episodes=3, min_production_episodes=3, max_episodes=3)
    loop, store = Loop(config, backend, actor="test"), backend.gateway.store
    prod, canary = "watch-agent@production", "watch-agent@canary"

    def deploy(alias: str, step: int, share: float | None = None) -> None:
        with store.session() as s:
            deployments.deploy(s, alias, step, actor="test", share=share)

    assert await loop.ladder.watch_canary() is None  # no canary: nothing to watch
    deploy(prod, 1)
    deploy(canary, 2, 0.5)  # worse than production: it rarely gives the refund
    for _ in range(3):
        answered(store, prod, 1, "Your refund is on its way.")
    answered(store, canary, 2, "Sorry.")
    assert (await loop.ladder.watch_canary()).action == "wait"  # 1 of 3 canary episodes
    answered(store, canary, 2, "Sorry, no.")
    answered(store, canary, 2, "Your refund is on its way.")
    rolled_back = await loop.ladder.watch_canary()
    assert rolled_back.action == "rollback" and "not shown within 0.05 of production" in rolled_back.reason
    assert rolled_back.difference[0] == pytest.approx(-2 / 3) and rolled_back.look == 3  # its one look
    assert (rolled_back.canary_episodes, rolled_back.production_episodes) == (3, 3)
    with store.session() as s:
        assert deployments.find(s, canary) is None and deployments.get(s, prod).step == 1

    deploy(canary, 3, 0.5)  # as good as production
    for _ in range(3):
        answered(store, canary, 3, "Your refund is on its way.")
    waiting = await loop.ladder.watch_canary()  # production's episodes before this canary's deployment do not count
    assert waiting.action == "wait" and waiting.production_episodes == 0
    for _ in range(3):
        answered(store, prod, 1, "Your refund is on its way.")
    promoted = await loop.ladder.watch_canary()
    assert promoted.action == "promote"
    with store.session() as s:
        assert deployments.find(s, canary) is None and deployments.get(s, prod).step == 3
        event = next(e for e in audit.events(s, subject=canary) if e.action == "canary.promote")
        assert event.details["step"] == 3 and event.details["canary_episodes"] == 3

    deploy(canary, 4, 0.5)  # one unsafe answer is enough, before any count is reached
    answered(store, canary, 4, "Your refund is on its way.")
    answered(store, canary, 4, "Send me your card number.")
    unsafe = await loop.ladder.watch_canary()
    assert unsafe.action == "rollback" and len(unsafe.unsafe) == 1 and "safety" in unsafe.reason
    with store.session() as s:
        assert deployments.find(s, canary) is None and deployments.get(s, prod).step == 3
        assert audit.verify(s).ok


async def test_a_shadow_goes_to_canary_or_is_stopped_by_its_answers_paired_with_productions(
    backend: LocalBackend, tmp_path
):
    """The shadow stage: each shadow episode pairs with its production original (finished, the same last messages)
    and both answers are scored; a worse shadow is stopped, one as good goes to canary (not while a canary runs),
    one unsafe answer stops it; each decision an audit event with its evidence, the shadow alias removed."""
    path = write_config(tmp_path)
    (tmp_path / "stack.json").write_text(json.dumps(WATCH_STACK))
    config = LoopConfig.load(path).model_copy(update={"name": "shadow-agent"})
    loop, store = Loop(config, backend, actor="test"), backend.gateway.store
    prod, shadow, canary = "shadow-agent@production", "shadow-agent@shadow", "shadow-agent@canary"
    good = "Your refund is on its way."
    with store.session() as s:
        deployments.deploy(s, prod, 1, actor="test")
        deployments.deploy(s, shadow, 2, actor="test", share=0.5)
    assert await loop.ladder.watch_shadow() is None  # no shadow stage configured
    config.shadow = ShadowPolicy(share=0.5, min_pairs=2, max_pairs=2)  # one look, at 2 pairs

    def pair(step: int, answer: str, *, finish: bool = True, messages: list | None = None) -> str:
        return mirrored(store, answered(store, prod, 1, good, finish=finish), shadow, step, answer, messages)

    first = answered(store, prod, 1, good)
    mirrored(store, first, shadow, 2, "Sorry.")
    pair(2, good, finish=False)  # its production episode is still open: not paired yet
    pair(2, good, messages=[{"role": "user", "content": "hi"}])  # the mirror missed the last call: not the same inputs
    waiting = await loop.ladder.watch_shadow()
    assert (waiting.action, waiting.pairs) == ("wait", 1)
    pair(2, "Sorry, no.")
    stopped = await loop.ladder.watch_shadow()
    assert stopped.action == "stop" and stopped.pairs == 2 and stopped.difference[0] == -1.0
    with store.session() as s:
        assert deployments.find(s, shadow) is None and deployments.find(s, canary) is None
        event = next(e for e in audit.events(s, subject=shadow) if e.action == "shadow.stop")
        assert (event.details["step"], event.details["pairs"], len(event.details["episodes"])) == (2, 2, 2)
        assert grades.grades_of(s, event.details["episodes"][0], loop.stack.version)  # the shadow's answers, graded
        deployments.deploy(s, shadow, 3, actor="test", share=0.5)
    pair(3, good)
    mirrored(store, first, shadow, 3, good)  # a late mirror into an earlier shadow episode: paired anew for step 3
    loop.alarm = "reward up, holdout flat"  # the reward-hacking alarm holds it as it holds a canary's promotion
    paused = await loop.ladder.watch_shadow()
    assert paused.action == "wait" and paused.reason.startswith("promotion paused")
    loop.alarm = None
    passed = await loop.ladder.watch_shadow()
    assert (passed.action, passed.pairs, passed.difference[0]) == ("canary", 2, 0.0)
    with store.session() as s:
        assert deployments.find(s, shadow) is None
        assert (deployments.get(s, canary).step, deployments.get(s, canary).share) == (3, config.canary.share)
        event = next(e for e in audit.events(s, subject=shadow) if e.action == "shadow.pass")
        assert deployments.history(s, canary)[-1].details["shadow_event"] == event.id
        deployments.deploy(s, shadow, 4, actor="test", share=0.5)
    for _ in range(2):
        pair(4, good)
    held = await loop.ladder.watch_shadow()  # as good, but the canary of step 3 is still watched
    assert held.action == "wait" and "a canary is running" in held.reason
    pair(4, "Send me your card number.")
    unsafe = await loop.ladder.watch_shadow()
    assert unsafe.action == "stop" and len(unsafe.unsafe) == 1 and "safety" in unsafe.reason
    with store.session() as s:
        assert deployments.find(s, shadow) is None and deployments.get(s, canary).step == 3
        assert audit.verify(s).ok


async def test_the_shadow_watch_reads_an_unpaired_episode_again_only_once_a_late_mirror_adds_a_call(
    backend: LocalBackend, tmp_path, monkeypatch
):
    """A shadow episode that missed its finished original's last call is not read again at every iteration (each
    read: both episodes' calls); once a late mirror adds that call, it is, and pairs."""
    path = write_config(tmp_path)
    (tmp_path / "stack.json").write_text(json.dumps(WATCH_STACK))
    config = LoopConfig.load(path).model_copy(
        update={"name": "unpaired-agent", "shadow": ShadowPolicy(share=0.5, min_pairs=2)}
    )
    loop, store = Loop(config, backend, actor="test"), backend.gateway.store
    prod, shadow = "unpaired-agent@production", "unpaired-agent@shadow"
    with store.session() as s:
        deployments.deploy(s, prod, 1, actor="test")
        deployments.deploy(s, shadow, 2, actor="test", share=0.5)
    origin = answered(store, prod, 1, "Your refund is on its way.")
    missed = mirrored(store, origin, shadow, 2, "Hello.", [{"role": "user", "content": "hi"}])  # an earlier call's
    read, calls = [], episodes.calls
    monkeypatch.setattr(episodes, "calls", lambda s, episode_id: read.append(episode_id) or calls(s, episode_id))
    for _ in range(3):
        assert (await loop.ladder.watch_shadow()).pairs == 0
    assert read.count(missed) == 1
    mirrored(store, origin, shadow, 2, "Your refund is on its way.")  # the original's last call, mirrored late
    late = await loop.ladder.watch_shadow()
    assert (late.action, late.pairs, read.count(missed)) == ("wait", 1, 2)


async def test_a_shadow_pairs_only_with_production_originals(backend: LocalBackend, tmp_path):
    """A shadow episode whose original is not production traffic (an evaluation that called the alias) never
    pairs, whatever it answered."""
    path = write_config(tmp_path)
    (tmp_path / "stack.json").write_text(json.dumps(WATCH_STACK))
    config = LoopConfig.load(path).model_copy(update={"name": "split-agent", "shadow": ShadowPolicy(share=1.0)})
    loop, store = Loop(config, backend, actor="test"), backend.gateway.store
    prod, shadow, good = "split-agent@production", "split-agent@shadow", "Your refund is on its way."
    with store.session() as s:
        deployments.deploy(s, prod, 1, actor="test")
        deployments.deploy(s, shadow, 2, actor="test", share=1.0)
        evaluation = episodes.create_episode(s, "ticket", split="eval", meta={"item": {"id": "ticket"}})
        record_call(s, evaluation.id, prod, 1, good)
        episodes.set_outcome(s, evaluation.id, reward=0.0, finish=True)
    mirrored(store, evaluation.id, shadow, 2, good)
    assert (await loop.ladder.watch_shadow()).pairs == 0
    mirrored(store, answered(store, prod, 1, good), shadow, 2, good)
    assert (await loop.ladder.watch_shadow()).pairs == 1


async def test_the_gate_counts_its_looks_since_production_changed_and_confirms_a_screened_candidate(
    backend: LocalBackend, tmp_path
):
    """Each gate decision is a look, counted from production's latest deployment: its level is the look's share of
    the lifetime budget. A candidate that passes the screen is held until a fresh evaluation of both sides confirms
    it; a fresh one identical to the first (a deterministic evaluation) is no evidence: the look decides at its
    budget alone. Each gate event names its look (and the confirmation's lift)."""
    path = write_config(tmp_path)
    (tmp_path / "stack.json").write_text(json.dumps(WATCH_STACK))
    config = LoopConfig.load(path).model_copy(update={"name": "looks-agent"})
    config.gate = GatePolicy(min_items=2, max_increase={"tokens": 10})
    loop, store = Loop(config, backend, actor="test"), backend.gateway.store
    prod = "looks-agent@production"
    with store.session() as s:
        deployments.deploy(s, prod, 1, actor="test")
    assert await loop.ladder.look() == 1
    better = heldout_run("looks-agent@2", 0.0, scores=[1.0] * 16 + [0.0] * 4)  # +0.8 over production's 20 zeros
    zeros = heldout_run(prod, 0.0, items=20)
    pending = await loop.ladder.decide(2, prod, better, zeros)  # the screen passes: not without its confirmation
    assert pending.decision.needs_confirmation and not pending.decision.promote and pending.deployed is None
    assert await loop.ladder.look() == 2
    flat = heldout_run("looks-agent@3", 0.0, items=20)  # the fresh evaluation: no lift at all
    refused = await loop.ladder.decide(3, prod, better, zeros, again=(flat, zeros))
    assert not refused.decision.promote and refused.decision.look == 2
    assert [c.name for c in refused.decision.failed] == ["confirmation"]
    confirmed = await loop.ladder.decide(4, prod, better, zeros, again=(better, zeros))  # greedy: the same scores again
    assert confirmed.decision.promote and confirmed.deployed == "looks-agent@canary"
    assert confirmed.decision.lift.level == pytest.approx(levels(config.gate, 3)[0] * levels(config.gate, 3)[1])
    with store.session() as s:
        events = audit.events(s, actions=("gate.pass", "gate.hold"))
        assert [(e.subject, e.details["look"]) for e in events[-3:]] == [
            ("looks-agent@2", 1), ("looks-agent@3", 2), ("looks-agent@4", 3)]  # fmt: skip
        assert events[-2].details["confirmation"]["mean"] == 0.0 and events[-1].reason.startswith("look 3:")
        deployments.promote(s, "looks-agent", actor="test", reason="as if the canary were promoted")
    assert await loop.ladder.look() == 1  # production changed: a new series of looks


async def test_a_newer_candidate_replaces_a_shadow_still_pairing_and_never_a_canary_being_watched(
    backend: LocalBackend, tmp_path
):
    """A candidate that passes the gate while an older one's shadow is pairing replaces it: a ``shadow.replace``
    event names both steps and the old shadow's pairs so far, in the gate decision's unit of work; the old shadow's
    answers (a late one included) never pair for the new one. While a canary is watched the newer candidate waits in
    shadow (with a shadow stage) or, without one, is held: the canary is never touched. (``decide`` is what
    ``consider`` does once both held-out runs are in: the gate decides on them for real.)"""
    path = write_config(tmp_path)
    (tmp_path / "stack.json").write_text(json.dumps(WATCH_STACK))
    config = LoopConfig.load(path).model_copy(update={"name": "replace-agent", "shadow": ShadowPolicy(share=0.5, min_pairs=3)})  # fmt: skip
    loop, store = Loop(config, backend, actor="test"), backend.gateway.store
    prod, shadow, canary = "replace-agent@production", "replace-agent@shadow", "replace-agent@canary"
    good = "Your refund is on its way."
    with store.session() as s:
        deployments.deploy(s, prod, 1, actor="test")

    async def candidate(step: int):
        fresh = (heldout_run(f"replace-agent@{step}", 1.0), heldout_run(prod, 0.0))  # its confirmation, the same
        return await loop.ladder.decide(step, prod, heldout_run(f"replace-agent@{step}", 1.0), heldout_run(prod, 0.0),
                                 again=fresh)  # fmt: skip

    assert (await candidate(2)).deployed == shadow
    before = [mirrored(store, answered(store, prod, 1, good), shadow, 2, good) for _ in range(2)]
    replacing = await candidate(4)  # step 2's shadow has 2 of its 3 pairs
    assert (replacing.deployed, replacing.held, replacing.shadow) == (shadow, None, None)
    with store.session() as s:
        (replaced,) = audit.events(s, subject=shadow, actions=("shadow.replace",))
        assert (replaced.details["old_step"], replaced.details["new_step"], replaced.details["pairs"]) == (2, 4, 2)
        assert sorted(replaced.details["episodes"]) == sorted(before)
        assert replaced.details["gate_event"] == replacing.event_id and "2 of 3" in replaced.reason
        now = deployments.get(s, shadow)
        assert (now.step, deployments.history(s, shadow)[-1].details["replaced_event"]) == (4, replaced.id)
        assert replaced.details["deploy_event"] != now.event_id
    # a late answer of step 2's shadow, mirrored after the switch, and step 4's first: only step 4's pairs
    mirrored(store, answered(store, prod, 1, good), shadow, 2, good)
    mirrored(store, answered(store, prod, 1, good), shadow, 4, "Sorry.")
    assert (await loop.ladder.watch_shadow()).pairs == 1
    with store.session() as s:
        deployments.deploy(s, canary, 4, actor="test", share=0.5)  # as if step 4's shadow had passed
    waiting = await candidate(6)  # a canary is watched: the newer candidate waits in shadow, the canary untouched
    assert waiting.deployed == shadow and waiting.shadow is None
    config.shadow = None  # without a shadow stage it is held, and says why
    held = await candidate(8)
    assert held.deployed is None and held.held.startswith("replace-agent@canary (step 4) is being watched")
    with store.session() as s:
        assert deployments.get(s, canary).step == 4 and deployments.get(s, shadow).step == 6
        event = next(e for e in audit.events(s, subject="replace-agent@8") if e.action == "gate.pass")
        assert event.details["held"] == held.held and "held: replace-agent@canary" in event.reason
        assert audit.events(s, subject=canary, actions=("deploy",))[-1].details["previous_step"] is None
        assert audit.verify(s).ok


async def test_after_a_rollback_training_goes_on_from_production_s_weights_once(backend: LocalBackend, tmp_path):
    """A canary rolled back: the loop's next step trains from production's weights (a new checkpoint, one step on,
    a fresh optimizer, a ``loop.rewind`` event naming the rollback), once; a restart after a kill between that
    checkpoint and its event writes the event and does not rewind again; a rollback of a step from before the
    rewind (not what the loop trains from) rewinds nothing; without a production deployment it is the base model.
    The candidates' checkpoints are written in the format training writes (their weights do not matter here)."""
    path = write_config(tmp_path)
    (tmp_path / "stack.json").write_text(json.dumps(WATCH_STACK))
    config = LoopConfig.load(path).model_copy(update={"name": "rewind-agent", "candidate_every": 1})
    loop, store = Loop(config, backend, actor="test"), backend.gateway.store
    await loop.model.register(backend)
    trainer, run = backend.trainer(loop.model), backend.run(loop.model)
    prod, canary = "rewind-agent@production", "rewind-agent@canary"
    start = trainer.adapter_state()

    async def trained(step: int) -> None:
        """Checkpoint ``step``, different weights, the live ones from now on (as if the loop had trained it)."""
        weights = {k: v + 0.01 * step if ".lora_B." in k else v for k, v in start.items()}
        extra = {"loop": {"means": [{"step": float(step), "reward": 0.5}], "off_policy": {}}}
        run.write(Checkpoint(CheckpointState(step=step, trained_weights=trainer.trained_weights, extra=extra), weights))
        await backend.restore(loop.model, step)

    async def rolled_back(step: int) -> int:
        with store.session() as s:
            deployments.deploy(s, canary, step, actor="test", share=0.5)
        answered(store, canary, step, "Send me your card number.")
        assert (await loop.ladder.watch_canary()).action == "rollback"
        with store.session() as s:
            return audit.events(s, subject=canary, actions=("canary.rollback",))[-1].id

    def live_is(step: int) -> bool:
        weights = run.read(step, optimizer=False).weights
        return all(torch.equal(v, weights[k]) for k, v in trainer.adapter_state().items())

    await trained(1)
    with store.session() as s:
        deployments.deploy(s, prod, 1, actor="test")
    await trained(2)
    assert await loop.rewind_if_due() is None  # nothing rolled back
    rollback = await rolled_back(2)
    rewind = await loop.rewind_if_due()
    assert (rewind.step, rewind.from_step, rewind.to_step, rewind.rollback_event) == (3, 2, 1, rollback)
    assert await loop.model.get_step() == 3 and live_is(1) and trainer.optimizer is None  # production's, fresh
    assert run.read(3).optimizer is None and loop.step_means == []
    assert [r["split"] for r in backend.history(loop.model) if r["step"] == 3] == ["rewind"]
    assert await loop.ladder.consider_due(None) is None  # production's weights again: not a candidate
    assert await loop.rewind_if_due() is None  # once
    assert await rolled_back(2) and await loop.rewind_if_due() is None  # step 2's line was left at step 3

    await trained(4)  # trained on from step 3; its canary is rolled back, and a kill follows the new checkpoint
    rollback = await rolled_back(4)

    def killed(*args, **kwargs):
        raise RuntimeError("killed after the rewound checkpoint was written")  # a kill, between two statements

    loop.ladder._record_rewind = killed
    with pytest.raises(RuntimeError, match="killed"):
        await loop.rewind_if_due()
    restarted = Loop(config, backend, actor="test")
    await restarted.model.register(backend)  # the same model: its latest checkpoint, step 5, is live
    again = await restarted.rewind_if_due()
    assert (again.step, again.from_step, again.to_step, again.rollback_event) == (5, 4, 1, rollback)
    assert await restarted.rewind_if_due() is None and await restarted.model.get_step() == 5 and live_is(1)
    with store.session() as s:
        events = audit.events(s, subject="rewind-agent", actions=(REWIND,))
        assert [(e.details["step"], e.details["to_step"]) for e in events] == [(3, 1), (5, 1)]
        assert "not from step 4's" in events[-1].reason and audit.verify(s).ok
        deployments.remove(s, prod, actor="test")

    await trained(6)  # no production deployment: the base model's weights (an adapter that adds nothing)
    await rolled_back(6)
    base = await restarted.rewind_if_due()
    assert (base.step, base.to_step, base.production) == (7, None, EMBEDDED_MODEL)
    state = trainer.adapter_state()
    assert all(not v.any() for k, v in state.items() if ".lora_B." in k)
    assert all(torch.equal(v, start[k]) for k, v in state.items() if ".lora_A." in k)


def steps(rewards: list[float], holdout: list[float] | None) -> list[dict[str, float]]:
    return [{"reward": r} | ({"holdout/polite": h} if holdout else {}) for r, h in zip(rewards, holdout or rewards)]


@pytest.mark.parametrize(
    ("rewards", "holdout", "raised"),
    [
        ([0.2, 0.2, 0.3, 0.5, 0.6, 0.7], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5], True),  # reward up, holdout flat
        ([0.2, 0.2, 0.3, 0.5, 0.6, 0.7], [0.5, 0.5, 0.5, 0.4, 0.4, 0.4], True),  # holdout falling
        ([0.2, 0.2, 0.3, 0.5, 0.6, 0.7], [0.3, 0.3, 0.3, 0.4, 0.4, 0.5], False),  # both up: learning
        ([0.7, 0.6, 0.5, 0.3, 0.2, 0.2], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5], False),  # reward down
        ([0.2, 0.2, 0.3, 0.5, 0.6, 0.7], None, False),  # no holdout grader: nothing to compare with
        ([0.2, 0.5, 0.7], [0.5, 0.5, 0.5], False),  # fewer steps than the window
    ],
)
def test_the_reward_hacking_alarm(rewards, holdout, raised):
    message = reward_hacking(steps(rewards, holdout), AlarmPolicy(window=6, min_rise=0.1))
    assert (message is not None) == raised
    if raised:
        assert "0.233 -> 0.600" in message and "holdout/polite" in message


async def test_an_alarm_is_audited_once_and_stops_promotions(backend: LocalBackend, tmp_path):
    config = LoopConfig.load(write_config(tmp_path)).model_copy(update={"name": "alarm-agent"})
    config.alarm = AlarmPolicy(window=2, min_rise=0.1)
    # the canary below is scored by a deterministic stack (write_config's is a coin: it rolled a canary back once)
    (tmp_path / "stack.json").write_text(json.dumps(WATCH_STACK))
    loop, store = Loop(config, backend, actor="test"), backend.gateway.store

    def group(reward: float, polite: float) -> TrajectoryGroup:
        t = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward, metrics={"stack/holdout/polite": polite})  # fmt: skip
        return TrajectoryGroup([t])

    assert await loop.check_alarm([group(0.2, 0.5)]) is None
    assert "0.200 -> 0.800" in await loop.check_alarm([group(0.8, 0.5)])
    assert await loop.check_alarm([group(0.9, 0.5)]) is None and loop.alarm is not None  # raised once
    with store.session() as s:
        (event,) = [e for e in audit.events(s, subject="alarm-agent") if e.action == "loop.alarm"]
        assert "promotions stopped" in event.reason
        deployments.deploy(s, "alarm-agent@production", 1, actor="test")
        deployments.deploy(s, "alarm-agent@canary", 2, actor="test", share=0.5)
    config.canary = CanaryPolicy(share=0.5, min_episodes=1, min_production_episodes=1, max_episodes=1)
    answered(store, "alarm-agent@canary", 2, "Your refund is on its way.")
    answered(store, "alarm-agent@production", 1, "Your refund is on its way.")  # production needs its minimum too
    held = await loop.ladder.watch_canary()  # would be promoted: the alarm holds it
    assert held.action == "wait" and held.reason.startswith("promotion paused")
    with store.session() as s:
        assert deployments.get(s, "alarm-agent@production").step == 1


async def test_the_pipelined_loop_draws_the_next_iteration_while_a_step_trains(backend: LocalBackend, tmp_path):
    """``async_steps: 1``: an iteration's groups are queued before the step ahead of it has trained (the pipeline),
    every step trains within the staleness bound (its history row: ``stale_groups`` 0, ``staleness_max`` <= 1), and
    nothing is left in flight after the last iteration. A configuration drawing further ahead than its bound is
    refused."""
    path = write_config(tmp_path)
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps({"id": f"t{i}", "question": "Name a colour.", "fail": False}) + "\n"
                                  for i in range(4)))  # fmt: skip
    config = LoopConfig.load(path).model_copy(
        update={"name": "piped-agent", "tasks": tasks_file, "steps": 3, "candidate_every": 100, "async_steps": 1,
                "intake_split": "none"}
    )  # fmt: skip
    assert config.train_config.max_staleness_steps == config.max_staleness_steps == 2
    loop = Loop(config, backend, actor="test")
    report = await loop.run()
    assert report.steps == [1, 2, 3]
    rows = {r["step"]: r for r in backend.history(loop.model) if r["split"] == "train"}
    assert all(rows[k]["stale_groups"] == 0 and rows[k]["staleness_max"] <= 1 for k in (1, 2, 3)), rows
    with backend.gateway.store.session() as s:
        queued = {t.id.split(":")[2]: t.created_at for t in tasks.list_tasks(s, limit=1000)
                  if t.id.startswith("train:piped-agent:")}  # fmt: skip

    def at(created) -> float:
        return (created if created.tzinfo else created.replace(tzinfo=UTC)).timestamp()

    # the groups of iterations 2 and 3 were queued while steps 1 and 2 trained (their rows are written after)
    assert at(queued["2"]) < rows[1]["time"] and at(queued["3"]) < rows[2]["time"]
    assert sorted(queued) == ["1", "2", "3"]  # the last iteration drew nothing ahead
    with pytest.raises(ValueError, match=r"async_steps \(3\) is above max_staleness_steps \(2\)"):
        LoopConfig.model_validate(config.model_dump() | {"async_steps": 3})
