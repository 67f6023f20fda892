"""RULER: the judge prompt, a real local judge (the project's own server with constrained decoding), a local HTTP
judge that misbehaves on purpose, and the disk cache."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import litellm
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

import flywheel as art
import flywheel.rewards.cache
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.rewards import JudgeCache, JudgeError, JudgeUsage, RetryPolicy, ruler, ruler_score_group
from flywheel.rewards.ruler import _Candidate, build_request
from flywheel.server.background import BackgroundServer

SYSTEM = {
    "role": "system",
    "content": "You are a RAG-based support agent. Use the retrieved context to answer accurately.",
}
USER = {
    "role": "user",
    "content": "What is our refund policy?\n\n[Retrieved context]: Refunds are available within 30 days of purchase. "
    "Digital products are non-refundable after download. Contact support@example.com to initiate.",
}
ANSWERS = [
    "Refunds within 30 days of purchase; digital products are non-refundable after download. Email support@example.com.",
    "Refunds within 30 days. You can also get store credit for 90 days, call 1-800-REFUND.",
    "I'm not sure, please check the website.",
]
MESSAGE_LISTS = [[SYSTEM, USER, {"role": "assistant", "content": a}] for a in ANSWERS]
FAST_RETRY = RetryPolicy(attempts=3, initial_delay=0.01, max_delay=0.05)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]


def _answer(scores: list[tuple[str, float]]) -> str:
    return json.dumps({"scores": [{"trajectory_id": i, "explanation": f"reason {i}", "score": s} for i, s in scores]})


GOOD = _answer([("1", 0.9), ("2", 0.4), ("3", 0.1)])


# ---- the judge prompt ----------------------------------------------------------------------------------------


def test_shared_prefix_is_sent_once_and_each_trajectory_keeps_only_its_own_messages():
    request = build_request([_Candidate(messages=m) for m in MESSAGE_LISTS])
    system, user = request.messages
    assert "<rubric>" in system["content"] and '"1", "2", "3"' in system["content"]
    prompt = user["content"]
    assert prompt.count("Digital products are non-refundable after download") == 1
    context, rest = prompt.split("</context>")
    assert SYSTEM["content"] in context and "[user]" in context
    for i, answer in enumerate(ANSWERS, 1):
        block = rest.split(f'<trajectory id="{i}">')[1].split("</trajectory>")[0]
        assert block.strip() == f"[assistant]\n{answer}"
    schema = request.response_format["json_schema"]["schema"]["properties"]["scores"]
    assert schema["minItems"] == schema["maxItems"] == 3
    assert schema["items"]["properties"]["trajectory_id"]["enum"] == ["1", "2", "3"]


def test_without_prefix_dedup_every_trajectory_repeats_the_shared_messages():
    request = build_request([_Candidate(messages=m) for m in MESSAGE_LISTS], dedupe_prefix=False)
    prompt = request.messages[1]["content"]
    assert "<context>" not in prompt and prompt.count(SYSTEM["content"]) == 3


def test_identical_trajectories_are_judged_once_and_tools_and_histories_are_readable():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    with_tool = [
        SYSTEM,
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
        {"role": "assistant", "content": "It is 18C."},
    ]
    side = art.History(
        messages_and_choices=[{"role": "user", "content": "sub-agent task"}, {"role": "assistant", "content": "done"}]
    )
    candidates = [
        _Candidate(messages=with_tool, tools=TOOLS),
        _Candidate(messages=MESSAGE_LISTS[0], tools=TOOLS),
        _Candidate(messages=with_tool, tools=TOOLS),
        _Candidate(messages=MESSAGE_LISTS[0], tools=TOOLS, histories=[side]),
    ]
    request = build_request(candidates)
    assert request.ids == ["1", "2", "3"] and request.assignment == [0, 1, 0, 2]
    prompt = request.messages[1]["content"]
    context = prompt.split("</context>")[0]
    assert 'get_weather(city: string, unit?: "c"|"f"): Current weather in a city.' in context
    assert '-> tool call call_1: get_weather({"city": "Paris"})' in prompt
    assert "[tool result for call_1]\n18C, sunny" in prompt
    assert '<history n="1">\n[user]\nsub-agent task\n\n[assistant]\ndone\n</history>' in prompt


# ---- a real local judge: the project's own server, with constrained decoding --------------------------------


@pytest.fixture
def local_judge(backend: LocalBackend) -> dict[str, Any]:
    return {"api_base": backend.base_url, "api_key": "unused", "temperature": 0}


async def test_real_local_judge_scores_and_a_rerun_is_served_from_the_cache(local_judge, tmp_path):
    usage = JudgeUsage()
    kwargs = dict(cache=tmp_path, usage=usage, max_explanation_chars=60)
    scores = await ruler(MESSAGE_LISTS, f"openai/{EMBEDDED_MODEL}", local_judge, **kwargs)
    assert [s.trajectory_id for s in scores] == ["1", "2", "3"]
    assert all(0.0 <= s.score <= 1.0 and len(s.explanation) <= 60 for s in scores)
    assert usage.calls == 1 and usage.repairs == 0 and usage.prompt_tokens > 300 and usage.completion_tokens > 0
    again = await ruler(MESSAGE_LISTS, f"openai/{EMBEDDED_MODEL}", local_judge, **kwargs)
    assert again == scores
    assert usage.calls == 1 and usage.cache_hits == 1


async def test_real_local_judge_scores_a_group_with_tools_histories_and_duplicates(local_judge, tmp_path):
    def traj(answer: str, reward: float, histories: tuple[art.History, ...] = ()) -> art.Trajectory:
        choice = Choice(finish_reason="stop", index=0, message=ChatCompletionMessage(role="assistant", content=answer))
        return art.Trajectory(
            messages_and_choices=[SYSTEM, USER, choice], tools=TOOLS, reward=reward, additional_histories=list(histories),
            metrics={"steps": 1}, logs=["rollout log"],
        )  # fmt: skip

    side = art.History(
        messages_and_choices=[{"role": "user", "content": "look it up"}, {"role": "assistant", "content": "30 days"}]
    )
    group = art.TrajectoryGroup([traj(ANSWERS[0], 1.0), traj(ANSWERS[2], 0.0, [side]), traj(ANSWERS[0], 1.0)])
    usage = JudgeUsage()
    judged = await ruler_score_group(
        group, f"hosted_vllm/{EMBEDDED_MODEL}", local_judge, cache=tmp_path, usage=usage, max_explanation_chars=40
    )
    assert judged is not group and [t.reward for t in group] == [1.0, 0.0, 1.0]  # the input is left as it was
    first, second, duplicate = judged.trajectories
    assert first.reward == duplicate.reward == first.metrics["ruler_score"]
    for t, before in zip(judged, [1.0, 0.0, 1.0]):
        assert t.metrics["independent_reward"] == before and t.metrics["steps"] == 1
        assert 0.0 <= t.reward <= 1.0 and t.logs[0] == "rollout log" and t.logs[1].startswith("RULER")
    assert sum(t.metrics["judge_prompt_tokens"] for t in judged) == pytest.approx(usage.prompt_tokens)


# ---- a judge that misbehaves on purpose ----------------------------------------------------------------------


class ScriptedJudge:
    """An OpenAI-compatible judge that plays back a script, one step per request: ("ok", content),
    ("status", code) or ("sleep", seconds, content); it repeats the last step once the script runs out."""

    def __init__(self) -> None:
        self.script: deque[tuple] = deque()
        self.requests: list[dict] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            self.requests.append(body)
            step = self.script.popleft() if len(self.script) > 1 else self.script[0]
            if step[0] == "status":
                return JSONResponse({"error": {"message": f"scripted {step[1]}", "type": "server_error"}}, step[1])
            if step[0] == "sleep":
                await asyncio.sleep(step[1])
            content = step[-1]
            return {
                "id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
            }  # fmt: skip

        self.server = BackgroundServer(app).start()

    def play(self, *steps: tuple) -> None:
        self.script = deque(steps)
        self.requests = []


@pytest.fixture(scope="module")
def scripted():
    judge = ScriptedJudge()
    yield judge
    judge.server.stop()


def _params(judge: ScriptedJudge, **extra: Any) -> dict[str, Any]:
    return {"api_base": judge.server.base_url, "api_key": "unused", **extra}


async def _rule(judge: ScriptedJudge, usage: JudgeUsage | None = None, **kwargs: Any):
    kwargs.setdefault("cache", False)
    return await ruler(MESSAGE_LISTS, "openai/scripted-judge", _params(judge), retry=FAST_RETRY, usage=usage, **kwargs)


async def test_malformed_json_gets_one_repair_request(scripted):
    scripted.play(("ok", '{"scores": [{"trajectory_id": "1", '), ("ok", GOOD))
    usage = JudgeUsage()
    scores = await _rule(scripted, usage)
    assert [s.score for s in scores] == [0.9, 0.4, 0.1]
    assert usage.calls == 2 and usage.repairs == 1 and usage.prompt_tokens == 200
    repair = scripted.requests[1]["messages"]
    assert repair[-2] == {"role": "assistant", "content": '{"scores": [{"trajectory_id": "1", '}
    assert "not valid JSON" in repair[-1]["content"]
    assert scripted.requests[0]["response_format"]["type"] == "json_schema"  # passed through LiteLLM


async def test_wrong_number_of_scores_twice_is_an_error_naming_it(scripted):
    scripted.play(("ok", _answer([("1", 0.9), ("2", 0.4)])))
    with pytest.raises(
        JudgeError,
        match=r"after one repair request: its trajectory ids \['1', '2'\] do not match the trajectories \['1', '2', '3'\] \(missing ids \['3'\]\)",
    ):
        await _rule(scripted)
    assert len(scripted.requests) == 2
    scripted.play(("ok", _answer([("1", 0.9), ("1", 0.4), ("3", 0.1)])), ("ok", GOOD))
    assert len(await _rule(scripted)) == 3
    assert "repeated ids ['1']" in scripted.requests[1]["messages"][-1]["content"]


async def test_out_of_range_scores_are_clamped_and_counted(scripted):
    scripted.play(("ok", _answer([("1", 1.7), ("2", 0.5), ("3", -0.2)])))
    usage = JudgeUsage()
    scores = await _rule(scripted, usage)
    assert [s.score for s in scores] == [1.0, 0.5, 0.0]
    assert usage.clamped == 2 and usage.repairs == 0


async def test_timeouts_and_server_errors_are_retried_with_backoff(scripted):
    scripted.play(("sleep", 3.0, GOOD), ("status", 500), ("status", 429), ("ok", GOOD))
    usage = JudgeUsage()
    scores = await ruler(
        MESSAGE_LISTS, "openai/scripted-judge", _params(scripted, timeout=0.5),
        retry=RetryPolicy(attempts=4, initial_delay=0.01, max_delay=0.05), usage=usage, cache=False,
    )  # fmt: skip
    assert [s.score for s in scores] == [0.9, 0.4, 0.1]
    assert usage.retries == 3 and usage.calls == 4


async def test_a_failed_judge_call_prints_no_litellm_banner(scripted, capsys):
    """LiteLLM prints "Give Feedback / Get Help" and a debugging hint on every failed call unless told not to; the
    failure is ours to report (raised, or logged where a group is dropped)."""
    scripted.play(("status", 400))
    with pytest.raises(litellm.BadRequestError):
        await _rule(scripted)
    out, err = capsys.readouterr()
    assert "Give Feedback" not in out + err and "LiteLLM.Info" not in out + err


async def test_a_judge_that_keeps_failing_raises_or_drops_the_group(scripted):
    scripted.play(("status", 503))
    with pytest.raises(litellm.ServiceUnavailableError):
        await _rule(scripted)
    assert len(scripted.requests) == FAST_RETRY.attempts
    scripted.play(("status", 400))
    with pytest.raises(litellm.BadRequestError):  # not transient: no retry
        await _rule(scripted)
    assert len(scripted.requests) == 1
    scripted.play(("ok", "not json at all"))
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=m) for m in MESSAGE_LISTS])
    usage = JudgeUsage()
    dropped = await ruler_score_group(
        group,
        "openai/scripted-judge",
        _params(scripted),
        swallow_exceptions=True,
        cache=False,
        retry=FAST_RETRY,
        usage=usage,
    )
    assert dropped is None and usage.calls == 2 and usage.repairs == 1


# ---- the cache -----------------------------------------------------------------------------------------------


async def test_cache_hits_only_for_the_same_model_request_and_rubric(scripted, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_JUDGE_CACHE", str(tmp_path / "from-env"))
    scripted.play(("ok", GOOD))
    usage = JudgeUsage()
    first = await _rule(scripted, usage, cache=None)  # None: the default location, here from the environment
    assert (tmp_path / "from-env").is_dir() and len(JudgeCache(tmp_path / "from-env")) == 1
    assert await _rule(scripted, usage, cache=None) == first
    assert usage.calls == 1 and usage.cache_hits == 1 and len(scripted.requests) == 1
    await _rule(scripted, usage, cache=None, rubric="Prefer short answers.")
    await ruler(MESSAGE_LISTS, "openai/other-judge", _params(scripted), retry=FAST_RETRY, usage=usage)
    await ruler(
        MESSAGE_LISTS, "openai/scripted-judge", _params(scripted, temperature=0.5), retry=FAST_RETRY, usage=usage
    )
    assert usage.calls == 4 and usage.cache_hits == 1


async def test_unusable_answers_are_not_cached(scripted, tmp_path):
    scripted.play(("ok", "{}"))
    with pytest.raises(JudgeError):
        await _rule(scripted, cache=tmp_path)
    assert len(JudgeCache(tmp_path)) == 0


async def test_a_broken_cache_file_costs_a_warning_not_the_answer(scripted, tmp_path, caplog):
    (tmp_path / "judge-responses.sqlite3").write_text("this is not a database")
    scripted.play(("ok", GOOD), ("ok", GOOD))
    usage = JudgeUsage()
    first = await _rule(scripted, usage, cache=tmp_path)
    assert await _rule(scripted, usage, cache=tmp_path) == first  # judged again: nothing could be stored
    assert usage.calls == 2 and usage.cache_hits == 0
    assert "judge cache" in caplog.text and "not a database" in caplog.text


def test_caches_opened_at_once_on_a_new_file_all_work(tmp_path):
    # several caches on one new file, set up at the same moment (as concurrent ruler calls do): SQLite refuses
    # racing set-ups with "database is locked" at once, without waiting, unless the process shares a connection
    for trial in range(10):
        directory = tmp_path / str(trial)
        start = threading.Barrier(8)

        def put_then_get(i: int) -> str | None:
            cache = JudgeCache(directory)
            start.wait()
            cache.put_sync(f"k{i}", f"v{i}", model="m")
            return cache.get_sync(f"k{i}")

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(put_then_get, range(8))) == [f"v{i}" for i in range(8)]


# cache.py needs only the standard library: loading it alone keeps the processes' start-up short
_WRITER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("judge_cache", sys.argv[3])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
cache = module.JudgeCache(sys.argv[1])
for i in range(60):
    cache.put_sync(f"key-{i % 40}", f"{sys.argv[2]}-{i}", model="m")
    cache.get_sync(f"key-{(i * 7) % 40}")
"""


def test_cache_is_safe_under_concurrent_writers_in_processes_and_threads(tmp_path):
    source = Path(flywheel.rewards.cache.__file__)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), f"p{k}", str(source)]) for k in range(4)]
    cache = JudgeCache(tmp_path)
    errors: list[BaseException] = []

    def write(tag: str) -> None:
        try:
            for i in range(60):
                cache.put_sync(f"thread-{tag}-{i}", "x" * 1000, model="m")
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(str(k),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    assert not errors
    assert len(cache) == 40 + 4 * 60
    assert cache.get_sync("key-39").split("-")[0] in {"p0", "p1", "p2", "p3"}
    assert cache.get_sync("thread-3-59") == "x" * 1000
