"""The rollout queue: tasks enqueued by the training side, attempts claimed by runners (in this process, in a
``flywheel runner`` process killed mid-episode, and the shell example with curl), on the real model behind the real
loopback server, its SQLite store, httpx and the openai SDK.

Every test leaves the session's queue without open tasks: a claim takes the oldest queued attempt, whoever queued it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from flywheel.gateway.client import (
    Attempt,
    EpisodeClient,
    GatewayError,
    QueueClient,
    QueueTimeoutError,
    TaskFailedError,
    TaskSpec,
)
from flywheel.gateway.queue import InProcessQueue
from flywheel.gateway.runner import Runner, RunnerStats, current_lease
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend

TESTS = Path(__file__).resolve().parent
FLYWHEEL = str(Path(sys.executable).parent / "flywheel")  # the console script installed beside this Python
RUNNER_SH = TESTS.parent / "examples" / "gateway" / "runner.sh"
QUESTION = "What is 2 + 2? Answer with a number."


def root(backend: LocalBackend) -> str:
    return backend.base_url.removesuffix("/v1")


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def chat_agent(task: dict, base_url: str) -> float:
    """One chat completion through the attempt's episode (the model the task names); 1 if it has the answer."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(
        model=current_lease().model, messages=[{"role": "user", "content": task["question"]}], max_tokens=4
    )
    return 1.0 if task["answer"] in (reply.choices[0].message.content or "") else 0.0


@pytest.fixture
async def queue(backend: LocalBackend):
    async with QueueClient(root(backend)) as client:
        yield client
        assert await client.tasks(status="open") == [], "a test left attempts queued or leased"


async def until(check, seconds: float, what: str):
    """``await check()`` until it returns something (bounded)."""
    deadline = time.monotonic() + seconds
    while (found := await check()) is None:
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        await asyncio.sleep(0.2)
    return found


async def test_runners_complete_a_group_of_g_episodes(backend, queue):
    task_id = unique("group")
    spec = TaskSpec(task_id=task_id, payload={"question": QUESTION, "answer": "4"}, group_size=3, model=EMBEDDED_MODEL)
    runner = Runner(root(backend), chat_agent, concurrency=3, lease_seconds=30, poll_interval=0.2)
    groups, stats = await asyncio.wait_for(
        asyncio.gather(queue.gather_groups([spec], max_wait=120, poll_interval=0.2), runner.run(max_attempts=3)), 180
    )
    assert stats == RunnerStats(claimed=3, completed=3)
    (group,) = groups
    assert len(group.trajectories) == 3 and all(t.reward in (0.0, 1.0) for t in group.trajectories)
    assert {t.metadata["task_id"] for t in group.trajectories} == {task_id}

    task = await queue.task(task_id)
    assert task.complete and task.status == "complete"
    assert task.counts == {"queued": 0, "leased": 0, "finished": 3, "failed": 0}
    episodes = await queue.list(task_id=task_id)
    assert len(episodes) == 3 and all(e.status == "finished" and e.model == EMBEDDED_MODEL for e in episodes)
    assert sorted(e.meta["attempt_id"] for e in episodes) == sorted(a.id for a in task.attempts)
    assert {a.episode_id for a in task.attempts} == {e.id for e in episodes}
    assert all(a.tries == 0 and a.runner == runner.runner_id for a in task.attempts)
    for episode in episodes:
        (call,) = await queue.calls(episode.id)
        assert call["request"]["max_tokens"] == 4

    # the same task again is accepted and changes nothing; its id with other settings is refused
    assert (await queue.enqueue(task_id, spec.payload, group_size=3, model=EMBEDDED_MODEL)).counts["finished"] == 3
    with pytest.raises(GatewayError) as taken:
        await queue.enqueue(task_id, spec.payload, group_size=4, model=EMBEDDED_MODEL)
    assert taken.value.status == 409 and "group_size" in str(taken.value)
    assert await queue.claim("idle") is None  # nothing queued: 204
    assert (await queue.task(task_id)).counts["finished"] == 3


def attempt_of(task_attempts: list[Attempt], attempt_id: str) -> Attempt:
    return next(a for a in task_attempts if a.id == attempt_id)


async def test_a_runner_killed_mid_episode_loses_its_lease_and_the_group_completes_once(backend, queue, tmp_path):
    task_id = unique("fault")
    await queue.enqueue(task_id, {"question": QUESTION, "answer": "4"}, group_size=2, model=EMBEDDED_MODEL)
    runner = subprocess.Popen(
        [FLYWHEEL, "runner", "--url", root(backend), "--agent", "queue_agents:one_call_then_hang"]
        + ["--lease-seconds", "3", "--runner-id", "doomed", "--max-attempts", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TESTS), "FLYWHEEL_HOME": str(tmp_path)},
        cwd=tmp_path,
    )
    try:

        async def leased_with_a_call():
            assert runner.poll() is None, runner.communicate()[0]
            held = [a for a in (await queue.task(task_id)).attempts if a.status == "leased"]
            return held[0] if held and await queue.calls(held[0].episode_id) else None

        held = await until(leased_with_a_call, 120, "the runner process claims an attempt and makes its call")
        assert held.runner == "doomed" and held.index == 0  # the oldest attempt
        await asyncio.sleep(4)  # longer than its 3 s lease: only its heartbeats keep it
        assert attempt_of((await queue.task(task_id)).attempts, held.id).episode_id == held.episode_id
        runner.send_signal(signal.SIGKILL)  # mid-episode: no result, no failure, no goodbye
        runner.wait(10)
    finally:
        if runner.poll() is None:
            runner.kill()

    async def requeued():
        attempt = attempt_of((await queue.task(task_id)).attempts, held.id)
        return attempt if attempt.status == "queued" else None

    again = await until(requeued, 10, "the expired lease's attempt goes back to the queue")
    assert again.tries == 1 and again.error == "lease expired" and again.runner is None
    killed = await queue.get(held.episode_id)
    assert killed.status == "abandoned" and killed.meta["abandoned_because"] == "lease expired"

    # the killed runner's late result (or heartbeat) is refused and changes nothing
    for late in (queue.complete(held.id, held.episode_id, 1.0), queue.heartbeat(held.id, held.episode_id)):
        with pytest.raises(GatewayError) as refused:
            await late
        assert refused.value.status == 409 and "holds no lease" in str(refused.value)
    assert (await queue.get(held.episode_id)).status == "abandoned"
    assert attempt_of((await queue.task(task_id)).attempts, held.id).status == "queued"

    # another runner takes over: both attempts finish, the requeued one in a new episode
    stats = await asyncio.wait_for(
        Runner(root(backend), chat_agent, lease_seconds=30, poll_interval=0.2).run(max_attempts=2), 120
    )
    assert stats == RunnerStats(claimed=2, completed=2)
    task = await queue.task(task_id)
    assert task.complete and task.counts == {"queued": 0, "leased": 0, "finished": 2, "failed": 0}
    redone = attempt_of(task.attempts, held.id)
    assert redone.tries == 1 and redone.episode_id != held.episode_id and redone.runner != "doomed"
    episodes = await queue.list(task_id=task_id)
    assert sorted(e.status for e in episodes) == ["abandoned", "finished", "finished"]  # no duplicate
    assert (await queue.get(redone.episode_id)).meta == {"task_id": task_id, "attempt_id": held.id, "try": 2}
    assert len((await queue.group(task_id)).trajectories) == 2

    # late again, now that the attempt finished in another episode: still refused
    with pytest.raises(GatewayError) as refused:
        await queue.complete(held.id, held.episode_id, 0.0)
    assert refused.value.status == 409 and redone.episode_id not in str(refused.value)  # no other capability told
    # the winner's own result again is accepted and changes nothing; another outcome for it is refused
    reward = (await queue.get(redone.episode_id)).reward
    same = await queue.complete(redone.id, redone.episode_id, reward)
    assert same.status == "finished" and same.finished_at == redone.finished_at
    with pytest.raises(GatewayError) as other:
        await queue.complete(redone.id, redone.episode_id, 1.0 - reward)
    assert other.value.status == 409
    assert len((await queue.group(task_id)).trajectories) == 2
    assert (await queue.get(redone.episode_id)).reward == reward


async def test_flywheel_runner_stopped_by_sigterm_gives_its_attempt_back_at_once(backend, queue, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TESTS), "FLYWHEEL_HOME": str(tmp_path)}
    missing = subprocess.run(
        [FLYWHEEL, "runner", "--url", root(backend), "--agent", "queue_agents:nope"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert missing.returncode == 2 and "has no function 'nope'" in missing.stdout, (missing.stdout, missing.stderr)
    assert "Traceback" not in missing.stdout + missing.stderr

    task_id = unique("stopped")
    await queue.enqueue(task_id, {"question": QUESTION, "answer": "4"}, group_size=1, model=EMBEDDED_MODEL)
    runner = subprocess.Popen(
        [FLYWHEEL, "runner", "--url", root(backend), "--agent", "queue_agents:one_call_then_hang"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:

        async def leased_with_a_call():
            assert runner.poll() is None, runner.communicate()[0]
            (attempt,) = (await queue.task(task_id)).attempts
            return attempt if attempt.status == "leased" and await queue.calls(attempt.episode_id) else None

        held = await until(leased_with_a_call, 120, "the runner process claims the attempt and makes its call")
        assert held.lease_seconds == 60
        runner.send_signal(signal.SIGTERM)
        output, _ = runner.communicate(timeout=30)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert runner.returncode == 0 and "Stopped." in output and "failed 1" in output, output
    (attempt,) = (await queue.task(task_id)).attempts  # back in the queue now, not when its 60 s lease ends
    assert attempt.status == "queued" and attempt.tries == 1 and attempt.error == "the runner stopped"
    assert (await queue.get(held.episode_id)).status == "abandoned"
    stats = await asyncio.wait_for(Runner(root(backend), chat_agent, poll_interval=0.2).run(max_attempts=1), 120)
    assert stats == RunnerStats(claimed=1, completed=1) and (await queue.task(task_id)).complete


async def test_an_attempt_that_fails_every_try_fails_its_task(backend, queue):
    task_id = unique("failing")
    await queue.enqueue(task_id, {"question": QUESTION}, group_size=1, max_tries=2, model=EMBEDDED_MODEL)

    async def broken(task: dict, base_url: str) -> float:
        raise RuntimeError("the tool crashed")

    stats = await asyncio.wait_for(Runner(root(backend), broken, poll_interval=0.2).run(max_attempts=2), 60)
    assert stats == RunnerStats(claimed=2, failed=2)
    task = await queue.task(task_id)
    assert task.status == "failed" and not task.complete
    assert task.counts == {"queued": 0, "leased": 0, "finished": 0, "failed": 1}
    (attempt,) = task.attempts
    assert attempt.tries == 2 and attempt.error == "RuntimeError: the tool crashed"
    episodes = await queue.list(task_id=task_id)
    assert [e.status for e in episodes] == ["abandoned", "abandoned"]
    assert {e.meta["abandoned_because"] for e in episodes} == {"RuntimeError: the tool crashed"}
    assert await queue.claim("idle") is None  # a failed attempt is never claimed again
    with pytest.raises(TaskFailedError, match="the tool crashed"):
        await queue.wait_groups([task_id], max_wait=5)
    (group,) = await queue.wait_groups([task_id], max_wait=5, allow_failed=True)
    assert group.trajectories == []
    assert [t.id for t in await queue.tasks(status="failed") if t.id == task_id] == [task_id]


async def test_waiting_for_groups_is_bounded_and_says_what_is_missing(backend, queue):
    task_id = unique("waiting")
    await queue.enqueue(task_id, {"question": QUESTION}, group_size=2)
    with pytest.raises(QueueTimeoutError, match=rf"{task_id} \(2 queued of 2\).*Are runners claiming"):
        await queue.wait_groups([task_id], max_wait=0.5, poll_interval=0.1)
    # run by hand, as a runner in any language would: claim, heartbeat, complete (no calls: nothing to train on)
    for _ in range(2):
        lease = await queue.claim("by-hand", lease_seconds=30)
        assert lease is not None and lease.task_id == task_id and lease.payload == {"question": QUESTION}
        assert lease.base_url.endswith(f"/episodes/{lease.episode_id}/v1") and lease.model is None
        assert (await queue.heartbeat(lease.id, lease.episode_id, lease_seconds=60)).lease_seconds == 60
        assert (await queue.complete(lease.id, lease.episode_id, 0.5)).status == "finished"
    (group,) = await queue.wait_groups([task_id], max_wait=5)
    assert group.trajectories == []  # finished episodes without calls are left out of the group
    assert (await queue.task(task_id)).complete


async def test_the_servers_own_process_reads_the_queue_in_process_as_runners_see_it_over_http(backend, queue):
    """``InProcessQueue`` (the loop's way in, beside its backend's server): tasks enqueued and groups read in the
    store, not over HTTP; what it returns is what ``QueueClient`` reads for the same tasks."""
    local = InProcessQueue(backend.gateway, root(backend))
    task_id = unique("in-process")
    spec = TaskSpec(task_id=task_id, payload={"question": QUESTION, "answer": "4"}, group_size=2, model=EMBEDDED_MODEL)
    await local.submit(spec)
    with pytest.raises(QueueTimeoutError, match=rf"{task_id} \(2 queued of 2\).*claiming from {root(backend)}"):
        await local.wait_groups([task_id], max_wait=0.3, poll_interval=0.1)
    runner = Runner(root(backend), chat_agent, concurrency=2, lease_seconds=30, poll_interval=0.2)
    (group,), _ = await asyncio.wait_for(
        asyncio.gather(local.gather_groups([spec], max_wait=120, poll_interval=0.2), runner.run(max_attempts=2)), 180
    )
    assert len(group.trajectories) == 2
    over_http = await queue.group(task_id)
    assert [t.model_dump() for t in group.trajectories] == [t.model_dump() for t in over_http.trajectories]
    assert (await local.task(task_id)).model_dump() == (await queue.task(task_id)).model_dump()


async def test_bad_queue_requests_get_clear_errors_never_a_500(backend, queue):
    used = unique("used")
    async with EpisodeClient(root(backend)) as episodes:
        await episodes.create(used)  # a task id that episodes already carry cannot be a queued group
    fresh = unique("never")
    task_id = unique("bad")
    await queue.enqueue(task_id, {"question": QUESTION}, group_size=1)
    lease = await queue.claim("bad-runner", lease_seconds=30)
    assert lease is not None and lease.task_id == task_id
    at, ep = f"/attempts/{lease.id}", lease.episode_id
    cases = [
        ("POST", "/attempts/at_nope/heartbeat", {"episode_id": ep}, 404),
        ("POST", "/attempts/at_nope/complete", {"episode_id": ep, "reward": 1}, 404),
        ("POST", "/attempts/at_nope/fail", {"episode_id": ep, "reason": "x"}, 404),
        ("GET", f"/tasks/{fresh}", None, 404),
        ("POST", "/tasks", {"task_id": fresh, "payload": {}, "group_size": 0}, 400),
        ("POST", "/tasks", {"task_id": fresh, "payload": {}, "group_size": 1025}, 400),
        ("POST", "/tasks", {"task_id": fresh, "payload": {}, "group_size": 2, "max_tries": 0}, 400),
        ("POST", "/tasks", {"task_id": fresh, "payload": [1], "group_size": 2}, 400),  # not an object
        ("POST", "/tasks", {"task_id": fresh, "group_size": 2}, 400),  # no payload
        ("POST", "/tasks", {"task_id": f"{fresh}/x", "payload": {}, "group_size": 2}, 400),
        ("POST", "/tasks", {"task_id": fresh, "payload": {}, "group_size": 2, "colour": "red"}, 400),
        ("POST", "/tasks", {"task_id": used, "payload": {}, "group_size": 2}, 409),
        ("GET", "/tasks?status=done", None, 400),
        ("POST", "/tasks/claim", {}, 400),  # no runner
        ("POST", "/tasks/claim", {"runner": "r", "lease_seconds": 0}, 400),
        ("POST", f"{at}/heartbeat", {}, 400),  # no episode id
        ("POST", f"{at}/heartbeat", {"episode_id": ep, "lease_seconds": -1}, 400),
        ("POST", f"{at}/complete", {"episode_id": ep}, 400),  # no reward
        ("POST", f"{at}/complete", {"episode_id": ep, "reward": "high"}, 400),
        ("POST", f"{at}/complete", {"episode_id": ep, "reward": 1, "call_rewards": {"12345678": 1.0}}, 400),
        ("POST", f"{at}/fail", {"episode_id": ep}, 400),  # no reason
        ("POST", f"{at}/heartbeat", {"episode_id": "ep_other"}, 409),  # not this attempt's lease
        ("POST", f"{at}/complete", {"episode_id": "ep_other", "reward": 1}, 409),
    ]
    async with httpx.AsyncClient(base_url=root(backend)) as http:
        for method, path, body, status in cases:
            response = await http.request(method, path, json=body)
            assert response.status_code == status, (method, path, body, response.text)
            assert response.json()["error"]["message"], (path, response.text)
        codes = {
            (await http.get(f"/tasks/{fresh}")).json()["error"]["code"],
            (await http.post(f"{at}/fail", json={"episode_id": "ep_other", "reason": "x"})).json()["error"]["code"],
        }
        assert codes == {"task_not_found", "lease_lost"}
        for path, content in (("/tasks", b"{not json"), (f"{at}/complete", b'{"episode_id": "x", "reward": NaN}')):
            response = await http.post(path, content=content, headers={"content-type": "application/json"})
            assert response.status_code == 400 and response.json()["error"]["message"], response.text
    # nothing changed: no task was queued, the lease and its episode are as they were
    assert [t.id for t in await queue.tasks() if t.id in (fresh, used)] == []
    attempt = attempt_of((await queue.task(task_id)).attempts, lease.id)
    assert attempt.status == "leased" and attempt.episode_id == ep and attempt.tries == 0
    assert (await queue.get(ep)).status == "open"
    assert (await queue.fail(lease.id, ep, "done testing")).status == "queued"
    lease = await queue.claim("bad-runner")
    assert lease is not None and (await queue.complete(lease.id, lease.episode_id, 0.0)).status == "finished"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed: examples/gateway/runner.sh not run")
async def test_the_shell_runner_completes_attempts_with_curl(backend, queue):
    task_id = unique("shell")
    await queue.enqueue(task_id, {"prompt": QUESTION, "expected": "4"}, group_size=2, model=EMBEDDED_MODEL)
    tools = ["jq" if shutil.which("jq") else "python3", "python3"]  # jq when there is one, and without it
    for tool in tools:
        done = subprocess.run(
            ["bash", str(RUNNER_SH), root(backend)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "JSON_TOOL": tool},
        )
        assert done.returncode == 0, (tool, done.stdout, done.stderr)
        assert "reward" in done.stdout, done.stdout
    task = await queue.task(task_id)
    assert task.complete and all(a.runner.startswith("shell-") for a in task.attempts)
    episodes = await queue.list(task_id=task_id)
    assert len(episodes) == 2 and {e.reward for e in episodes} <= {0.0, 1.0}
    for episode in episodes:
        (call,) = await queue.calls(episode.id)
        assert call["request"]["messages"] == [{"role": "user", "content": QUESTION}]
    assert len((await queue.group(task_id)).trajectories) == 2
    idle = subprocess.run(["bash", str(RUNNER_SH), root(backend)], capture_output=True, text=True, timeout=60)
    assert idle.returncode == 0 and idle.stdout.strip() == "nothing queued", (idle.stdout, idle.stderr)
