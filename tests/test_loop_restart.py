"""The loop killed and started again comes back to the same decisions (flywheel/loop/driver.py, ``Loop.resume``): the
tasks an earlier run left open are cancelled (``store.tasks.cancel``) and runners' late results for them change
nothing; the reward-hacking alarm is the audit trail's, raised until an audited clearing (``flywheel loop CONFIG
--clear-alarm``); and a real ``flywheel loop`` process SIGKILLed at random moments and restarted (slow), with a
shadow stage, while simulated users' production episodes flow through a gateway of the test's own."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import closing
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from test_loop import NOISY, write_config
from typer.testing import CliRunner
from users import Users, differences

from flywheel.checkpoints.run import RunStore
from flywheel.cli import app
from flywheel.gateway.recorder import Gateway
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.registry import ModelRegistry, ServedModel
from flywheel.local.backend import LocalBackend
from flywheel.loop import alarm as alarms
from flywheel.loop.driver import Loop, LoopConfig
from flywheel.loop.ladder import GATE_ACTIONS, REWIND, ROLLBACKS
from flywheel.model import TrainableModel
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store, audit, deployments, episodes, tasks
from flywheel.store.tasks import LeaseLostError, TaskStatus
from flywheel.train.trainer import load_for_serving

REASON = "cancelled: its loop restarted"


def test_cancel_ends_the_open_tasks_of_a_prefix_and_late_results_change_nothing(db_url):
    store = Store(db_url)
    try:
        with store.session() as s:
            tasks.enqueue(s, "train:a_b:0:z:04", {"q": 4}, group_size=1)
            tasks.complete(s, *_ids(tasks.claim(s, "runner", 60)), reward=0.0)  # z: complete, left as it is
            tasks.enqueue(s, "train:a_b:1:x:01", {"q": 1}, group_size=3)
            tasks.enqueue(s, "train:a_b:1:y:02", {"q": 2}, group_size=1)
            tasks.enqueue(s, "train:axb:1:x:03", {"q": 3}, group_size=1)  # another loop ('_' is no wildcard)
            done, running, finished_unreported, _ = [tasks.claim(s, "runner", 60) for _ in range(4)]  # x's, y's
        with store.session() as s:
            tasks.complete(s, *_ids(done), reward=1.0)
            # finished through the episode API, its result not posted yet: it is the attempt's result all the same
            episodes.set_outcome(s, finished_unreported.episode.id, reward=0.5, finish=True)
        with store.session() as s:
            assert tasks.cancel(s, "train:a_b:", REASON) == ["train:a_b:1:x:01", "train:a_b:1:y:02"]
        with store.session() as s:
            x, attempts = tasks.get_task(s, "train:a_b:1:x:01")
            assert x.status == TaskStatus.failed and [a.status for a in attempts] == ["finished", "failed", "finished"]
            assert episodes.get_episode(s, running.episode.id).status == "abandoned"
            assert episodes.get_episode(s, running.episode.id).meta["abandoned_because"] == REASON
            assert tasks.get_task(s, "train:a_b:1:y:02")[0].status == TaskStatus.failed
            assert tasks.get_task(s, "train:a_b:0:z:04")[0].status == TaskStatus.complete
            assert tasks.get_task(s, "train:axb:1:x:03")[0].status == TaskStatus.open
        for late in (
            lambda s: tasks.complete(s, running.attempt.id, running.episode.id, reward=1.0),
            lambda s: tasks.heartbeat(s, running.attempt.id, running.episode.id),
        ):
            with pytest.raises(LeaseLostError, match="cancelled: its loop restarted"), store.session() as s:
                late(s)
        with store.session() as s:
            assert tasks.get_task(s, "train:a_b:1:x:01")[0].counts[tasks.AttemptStatus.finished] == 2
            assert tasks.cancel(s, "train:a_b:", REASON) == []  # nothing open is left
            assert tasks.claim(s, "runner", 60).attempt.task_id == "train:axb:1:x:03"  # the other loop's only
            with pytest.raises(ValueError, match="empty one would name every task"):
                tasks.cancel(s, "", REASON)
    finally:
        store.close()


def _ids(lease: tasks.Claim | None) -> tuple[str, str]:
    assert lease is not None
    return lease.attempt.id, lease.episode.id


def _raise(store: Store, loop: str, message: str = "the training reward rose 0.2 -> 0.8") -> None:
    with store.session() as s:
        audit.append(s, actor="test", action=alarms.RAISED, subject=loop, details={"message": message, "step": 4})


def test_an_alarm_stays_raised_until_an_audited_clearing_from_the_command_line(tmp_path):
    path = write_config(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    store = Store(f"sqlite:///{home / 'flywheel.db'}")
    try:
        cli = ["loop", str(path), "--home", str(home), "--actor", "alice"]
        nothing = CliRunner().invoke(app, [*cli, "--clear-alarm", "--why", "looked"])
        assert nothing.exit_code == 2 and "has no reward-hacking alarm raised" in nothing.output, nothing.output
        _raise(store, "loop-agent")
        _raise(store, "other-agent")
        with store.session() as s:
            assert alarms.state(s, "loop-agent").raised == "the training reward rose 0.2 -> 0.8"
        unsaid = CliRunner().invoke(app, [*cli, "--clear-alarm"])
        assert unsaid.exit_code == 2 and "--clear-alarm needs --why" in unsaid.output, unsaid.output
        cleared = CliRunner().invoke(app, [*cli, "--clear-alarm", "--why", "holdout grader was broken"])
        assert cleared.exit_code == 0 and "is cleared" in cleared.output, cleared.output
        assert "Traceback" not in nothing.output + unsaid.output + cleared.output
        with store.session() as s:
            assert alarms.state(s, "loop-agent") == alarms.AlarmState(raised=None, cleared_at_step=0)
            assert alarms.state(s, "other-agent").raised is not None  # another loop's alarm stays
            (event,) = audit.events(s, subject="loop-agent", actions=(alarms.CLEARED,))
            assert (event.actor, event.reason) == ("alice", "holdout grader was broken")
            with pytest.raises(alarms.NoAlarmError):
                alarms.clear(s, "loop-agent", step=0, actor="alice", reason="again")
            assert audit.verify(s).ok
    finally:
        store.close()


async def test_a_restarted_loop_keeps_the_alarm_and_cancels_what_its_predecessor_left_open(
    backend: LocalBackend, model: TrainableModel, tmp_path
):
    """On the session's model (its name: registering it again loads nothing); no step is trained."""
    config = LoopConfig.load(write_config(tmp_path)).model_copy(update={"name": model.name, "project": model.project})
    store = backend.gateway.store
    stale = [f"train:{model.name}:3:q0:aa", f"eval:{model.name}:colours:v1:run:q1"]
    with store.session() as s:
        for task_id in [*stale, f"train:{model.name}-2:3:q0:bb"]:  # the last: another loop's
            tasks.enqueue(s, task_id, {"question": "?", "fail": False}, group_size=2, model=model.name)
    _raise(store, model.name)
    loop = Loop(config, backend, actor="test")
    await loop.model.register(backend)
    try:
        assert await loop.resume() == stale
        assert loop.alarm == "the training reward rose 0.2 -> 0.8"
        with store.session() as s:
            assert [tasks.get_task(s, t)[0].status for t in stale] == [TaskStatus.failed] * 2
            assert tasks.get_task(s, f"train:{model.name}-2:3:q0:bb")[0].status == TaskStatus.open
            (event,) = audit.events(s, subject=model.name, actions=("loop.cancel",))
            assert event.details == {"tasks": stale, "count": 2}
        assert await loop.resume() == []  # again: nothing is left to cancel, and no second event says so
        step = await model.get_step()
        with store.session() as s:
            assert len(audit.events(s, subject=model.name, actions=("loop.cancel",))) == 1
            alarms.clear(s, model.name, step=step, actor="test", reason="checked")
        await loop.read_alarm()  # what each iteration does first: a clearing counts while the loop runs
        assert loop.alarm is None
    finally:
        with store.session() as s:
            tasks.cancel(s, f"train:{model.name}-2:", "test over")
            if alarms.state(s, model.name).raised is not None:
                alarms.clear(s, model.name, step=0, actor="test", reason="test over")


def test_a_second_flywheel_loop_of_the_same_name_is_refused_while_one_runs(tmp_path):
    """What keeps two runs of a loop from cancelling each other's tasks: the model's lock, taken before anything."""
    path = write_config(tmp_path)
    running = RunStore(tmp_path / "home" / "tests" / "models" / "loop-agent")
    running.lock()  # as the running loop's backend holds it
    try:
        result = CliRunner().invoke(app, ["loop", str(path), "--home", str(tmp_path / "home")])
    finally:
        running.unlock()
    assert result.exit_code == 2 and "is in use: a backend in process" in result.output, result.output
    assert "Traceback" not in result.output


def test_a_restarted_run_never_reuses_an_earlier_run_s_task_ids(backend: LocalBackend, tmp_path):
    """The same seed and pool at the same step once gave the same ids: a second restart at one step got the first's
    cancelled task back (the same task again is accepted) and trained on its partial group."""
    config = LoopConfig.load(write_config(tmp_path))
    config.tasks = tmp_path / "tasks.jsonl"
    config.tasks.write_text('{"id": "t1", "question": "Name a colour.", "fail": false}\n')
    first, second = (Loop(config, backend).specs(7) for _ in range(2))
    assert [s.payload for s in first] == [s.payload for s in second]  # the same choice: the seed's
    assert not {s.task_id for s in first} & {s.task_id for s in second}
    assert all(s.task_id.startswith(f"train:{config.name}:8:t1:") for s in first)


@pytest.mark.parametrize("name", ["a:b", "a/b", "calc@production", "two words", ""])
def test_a_loop_name_that_its_task_ids_or_aliases_could_not_carry_is_refused(tmp_path, name):
    data = yaml.safe_load(write_config(tmp_path).read_text()) | {"name": name}
    with pytest.raises(ValidationError, match="name"):
        LoopConfig.model_validate(data)


KILLS = int(os.environ.get("FLYWHEEL_LOOP_KILLS", "2"))  # CI: 2 (about 5 minutes); docs/benchmarks.md: 10


def _spawn(path: Path, home: Path, log: Path) -> subprocess.Popen:
    tests = str(Path(__file__).parent)  # the agent, test_loop:agent
    env = {**os.environ, "PYTHONPATH": tests, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}  # one thread: see test_crash
    flywheel = str(Path(sys.executable).parent / "flywheel")
    return subprocess.Popen(
        [flywheel, "loop", str(path), "--home", str(home), "--actor", "kill-test"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip


def _collecting(database: Path) -> set[str]:
    """The training tasks with attempts queued or running (read-only: the loop's process is the writer)."""
    if not database.exists():
        return set()
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5)) as connection:
        try:
            query = "SELECT task_id FROM attempts WHERE status IN ('queued', 'leased') AND task_id LIKE 'train:%'"
            return {row[0] for row in connection.execute(query)}
        except sqlite3.OperationalError:  # not migrated yet
            return set()


def _wait_for(condition, timeout: float, proc: subprocess.Popen) -> bool:
    """Until ``condition()``; False if the process ended first or the time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if condition():
            return True
        time.sleep(0.2)
    return False


MODEL = "restart-agent"


def _deployed(database: Path) -> dict[str, int]:
    """The loop's deployments, alias -> step (read-only: the loop's process writes them)."""
    if not database.exists():
        return {}
    with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5)) as connection:
        try:
            return dict(connection.execute("SELECT name, step FROM deployments WHERE model = ?", (MODEL,)))
        except sqlite3.OperationalError:  # not migrated yet
            return {}


class _Checkpoints:
    """The registry of the test's own gateway: the base model, and the loop's checkpoints on demand
    (``restart-agent@<step>``: the base model with that checkpoint's weights, as a gateway that serves the loop's
    deployments from another process loads them). What the users' calls to the aliases reach."""

    def __init__(self, engine: InferenceEngine, run: RunStore):
        self.run, self.engines, self.lock = run, [], threading.Lock()
        self.registry = ModelRegistry(loader=self.load)
        self.registry.add(EMBEDDED_MODEL, engine)

    def load(self, name: str) -> ServedModel | None:
        model, _, step = name.rpartition("@")
        if model != MODEL or not step.isdigit():
            return None
        with self.lock:  # one load at a time; a second request for it waits and finds it
            try:
                return self.registry.get(name)
            except LookupError:
                pass
            if int(step) not in self.run.steps():
                return None
            base, tokenizer, _ = load_model(EMBEDDED_MODEL)
            load_for_serving(base, self.run.read(int(step), optimizer=False))
            self.engines.append(InferenceEngine(base, tokenizer, max_batch=8))
            self.registry.add(name, self.engines[-1], owned_by="tests", step=int(step))
            return self.registry.get(name)


@pytest.mark.slow
@pytest.mark.timeout(300 + 150 * KILLS)  # on a loaded 2-core machine a kill and its restart took 2 minutes
def test_the_loop_killed_at_random_moments_comes_back_to_the_same_decisions(tmp_path, engine: InferenceEngine):
    """``flywheel loop`` (with a shadow stage) SIGKILLed while it starts, collects groups, trains or evaluates a
    candidate, or watches a shadow, and started again each time; then one run to its end. Meanwhile simulated users
    run production episodes through a gateway of the test's own on the same database (not the loop's: it is not
    killed), calling ``restart-agent@production`` once it exists, so that the shadow gets mirrored calls and the
    canary a share of the episodes. Every episode a user was answered for is stored once (none lost); the audit
    chain verifies; no checkpoint is decided twice and every due one is decided; deployments point at checkpoints
    after every kill, and each stage's switch (a shadow to canary, stopped or replaced, a canary promoted or rolled
    back) is whole; a rollback is rewound from (production's weights: no candidate) at most once; the step never
    goes back, no task is left open, and a raised alarm holds every candidate after it (runs differ: the reward is
    a coin)."""
    seed = int(os.environ.get("FLYWHEEL_CRASH_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    path = write_config(tmp_path)
    stack = NOISY | {"holdout": {"flat": {"type": "string_check", "name": "flat", "input": "{{sample.output_text}}",
                                          "reference": "never said", "operation": "eq"}}}  # fmt: skip
    (tmp_path / "stack.json").write_text(json.dumps(stack))
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1", "question": "Name a colour.", "fail": false}\n')
    # the alarm rarely rises (a coin's 4-step rise of 0.4), so that candidates usually reach the shadow and canary
    config = yaml.safe_load(path.read_text()) | {
        "name": MODEL, "runners": 2, "steps": 3, "candidate_every": 2, "group_size": 2, "groups_per_step": 1,
        "tasks": "tasks.jsonl", "alarm": {"window": 4, "min_rise": 0.4}, "shadow": {"share": 1.0, "min_pairs": 2, "max_pairs": 2},
        "canary": {"share": 0.5, "min_episodes": 2, "min_production_episodes": 2, "max_episodes": 2},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    home = tmp_path / "home"
    database = home / "flywheel.db"
    run = RunStore(home / "tests" / "models" / MODEL)
    store = Store(f"sqlite:///{database}")
    served = _Checkpoints(engine, run)
    gateway = Gateway(store)
    server = BackgroundServer(create_app(served.registry, gateway)).start()
    production = f"{MODEL}@production"

    def asked() -> str:  # the production alias once the loop's first candidate is deployed, the base model before
        return production if production in _deployed(database) else EMBEDDED_MODEL

    users = Users(server.base_url.removesuffix("/v1"), asked, users=2, pause=0.5)
    stop = threading.Event()
    traffic = threading.Thread(target=lambda: asyncio.run(users.run(stop)), name="users", daemon=True)
    traffic.start()
    started, kills, latest = time.monotonic(), [], [0]
    try:
        for n in range(2 * KILLS):
            if len(kills) == KILLS:
                break
            proc = _spawn(path, home, tmp_path / f"run-{n}.log")
            before = run.latest() or 0
            places = ["start", "collecting", "after a step", "after a step"]
            where = rng.choice(places + ["shadow"] * 2 if production in _deployed(database) else places)
            if where == "start":  # imports, the model, resuming
                ready = True
                time.sleep(rng.uniform(1, 15))
            elif where == "collecting":  # while runners run the groups it queued (not those a killed run left)
                left = _collecting(database)
                ready = _wait_for(lambda: bool(_collecting(database) - left), 300, proc)
                time.sleep(rng.uniform(0, 1.5))
            elif where == "shadow":  # while a shadow serves: pairing its episodes, deciding, switching to canary
                ready = _wait_for(lambda: f"{MODEL}@shadow" in _deployed(database), 300, proc)
                time.sleep(rng.uniform(0, 6))
            else:  # once it has trained a step: collecting the next groups, training, or deciding a candidate
                ready = _wait_for(lambda b=before: (run.latest() or 0) > b, 300, proc)
                time.sleep(rng.uniform(0, 8))
            if ready and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills.append((where, run.latest() or 0))
            assert proc.wait(timeout=300) in (0, -signal.SIGKILL), (tmp_path / f"run-{n}.log").read_text()[-3000:]
            latest.append(run.latest() or 0)
            steps = set(run.steps())  # whatever the kill interrupted, every alias points at a checkpoint
            assert all(step in steps for step in _deployed(database).values()), (_deployed(database), steps)
        final = _spawn(path, home, tmp_path / "final.log")
        assert final.wait(timeout=400) == 0, (tmp_path / "final.log").read_text()[-3000:]
        latest.append(run.latest() or 0)
        seconds = time.monotonic() - started
    finally:
        stop.set()
        traffic.join(timeout=300)
        server.stop()  # the calls it answered are committed first
        for checkpoint in served.engines:
            checkpoint.close()

    assert users.errors == [] and gateway.lost_calls == 0, users.errors[:5]
    assert differences(store, users) == []  # every episode a user was answered for, stored once: none lost
    assert latest == sorted(latest) and latest[-1] > 0, latest  # the step only grows
    assert [r["step"] for r in run.history()] == list(range(1, latest[-1] + 1))  # each step recorded once
    trained = [json.loads(line)["metadata"]["task_id"] for p in (run.path / "trajectories" / "train").iterdir()
               for line in p.read_text().splitlines()]  # fmt: skip
    try:
        with store.session() as s:
            assert audit.verify(s).ok
            gate = [e for e in audit.events(s, actions=GATE_ACTIONS) if e.subject.startswith(f"{MODEL}@")]
            decided = Counter(int(e.subject.rpartition("@")[2]) for e in gate)
            assert all(n == 1 for n in decided.values()), decided  # none decided twice
            raised = audit.events(s, subject=MODEL, actions=(alarms.RAISED,))
            # production's weights again after a rollback (a rewind's checkpoint) are no candidate
            rewound = {e.details["step"] for e in audit.events(s, subject=MODEL, actions=(REWIND,))}
            due = set(range(2, latest[-1] + 1, 2)) - rewound
            assert {r["step"] for r in run.history() if r.get("split") == "rewind"} == rewound
            if raised:  # it held every candidate after it (nothing cleared it), across the restarts
                assert len(raised) == 1 and all(e.id < raised[0].id for e in gate)
                assert set(decided) <= due and "promotions stopped" in (tmp_path / "final.log").read_text()
            else:  # every due checkpoint was decided: those a kill left undecided, after the restart
                assert set(decided) == due, (decided, latest)
            steps = set(run.steps())
            for deployment in deployments.list_deployments(s, MODEL):
                assert deployment.step in steps, deployment
            stages = _whole_switches(s)
            left = [t.id for t in tasks.list_tasks(s, status=TaskStatus.open, limit=1000) if MODEL in t.id]
            assert left == []
            cancelled = [t for e in audit.events(s, subject=MODEL, actions=("loop.cancel",))
                         for t in e.details["tasks"]]  # fmt: skip
            assert all(tasks.get_task(s, t)[0].status != TaskStatus.open for t in cancelled)
            assert not set(cancelled) & set(trained)  # what a killed run's runners did later trained nothing
            shadows = len(episodes.list_episodes(s, split="shadow", limit=100_000))
    finally:
        store.close()
    places = Counter(where for where, _ in kills)
    print(json.dumps({"seed": seed, "kills": kills, "where": places, "latest": latest, "decided": sorted(decided),
                      "alarm": bool(raised), "cancelled": len(cancelled), "episodes": len(users.sent),
                      "calls": sum(e.calls for e in users.sent.values()), "shadow_episodes": shadows,
                      "checkpoints_served": len(served.engines), **stages, "seconds": round(seconds)}))  # fmt: skip


def _whole_switches(s) -> dict[str, int]:
    """Each stage's decision and the switch it made are one unit of work, so a kill leaves all of it or none: a
    shadow sent to canary has its canary deployed and its alias removed, one stopped its alias removed, a canary
    promoted has production at its step and its alias removed, one rolled back its alias removed; a passing
    candidate is deployed (to shadow, or production for the first), a shadow it replaces with its
    ``shadow.replace`` event; a rollback or stop is rewound from at most once (``loop.rewind``). Returns the
    decisions, counted."""
    every = audit.events(s)

    def by_reason(action: str, subject: str, event_id: int) -> list[audit.AuditEventRecord]:
        """The events of ``action`` on ``subject`` whose reason names event ``event_id`` (what made them)."""
        said = f"(audit event {event_id})"
        return [e for e in every if (e.action, e.subject) == (action, subject) and said in (e.reason or "")]

    counts: Counter[str] = Counter()
    for event in every:
        if event.action in ("shadow.pass", "shadow.stop"):
            counts[event.action] += 1
            assert len(by_reason("remove", f"{MODEL}@shadow", event.id)) == 1, event
            canaries = [e for e in every if e.action == "deploy" and e.details.get("shadow_event") == event.id]
            assert len(canaries) == (event.action == "shadow.pass"), event
        elif event.action in ("canary.promote", "canary.rollback"):
            counts[event.action] += 1
            assert len(by_reason("remove", f"{MODEL}@canary", event.id)) == 1, event
            promoted = by_reason("promote", f"{MODEL}@production", event.id)
            assert len(promoted) == (event.action == "canary.promote"), event
        elif event.action == "gate.pass" and event.subject.startswith(f"{MODEL}@"):
            counts[event.action] += 1
            (deployed,) = [e for e in every if e.action == "deploy" and e.details.get("gate_event") == event.id]
            assert deployed.subject in (f"{MODEL}@shadow", f"{MODEL}@production"), deployed
            replaced = [e for e in every if e.action == "shadow.replace" and e.details["gate_event"] == event.id]
            assert [e.id for e in replaced] == ([deployed.details["replaced_event"]] if replaced else []), event
            assert bool(replaced) == bool(deployed.details["previous_step"]), event  # only a shadow that pairs
        elif event.action in ("shadow.replace", REWIND):  # each whole: checked with its gate.pass, and below
            counts[event.action] += 1
    rewound = Counter(i for e in every if e.action == REWIND for i in e.details["rollback_events"])
    judged = {e.id for e in every if e.action in ROLLBACKS}
    assert set(rewound) <= judged and all(n == 1 for n in rewound.values()), rewound  # none rewound twice
    return dict(counts)
