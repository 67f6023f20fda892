"""The agent loop: a real episode on the embedded model over HTTP, then the tool-execution paths and caching.

The 135M base model rarely writes a valid tool call on its own, so the tool paths are driven by ``ScriptedModel``,
which stands in for the model's replies (hand-built assistant turns) and records each request the loop sent; the
tools, the loop, the cache and its SQLite file are all real.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)

from flywheel.agents import AIRConfig, ToolCache, ToolError, final_answer, run_agent, tool
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.train.batch import trajectory_sequences
from flywheel.train.credit import turn_rewards
from flywheel.types import Trajectory


def call(name: str, arguments: str, id: str) -> ChatCompletionMessageFunctionToolCall:
    return ChatCompletionMessageFunctionToolCall(
        id=id, type="function", function=Function(name=name, arguments=arguments)
    )


def calls(*tool_calls: ChatCompletionMessageFunctionToolCall) -> ChatCompletionMessage:
    return ChatCompletionMessage(role="assistant", content=None, tool_calls=list(tool_calls))


def answer(text: str) -> ChatCompletionMessage:
    return ChatCompletionMessage(role="assistant", content=text)


class ScriptedModel:
    """An OpenAI-client stand-in: ``chat.completions.create`` returns the next scripted assistant turn."""

    def __init__(self, *turns: ChatCompletionMessage) -> None:
        self.turns = list(turns)
        self.requests: list[dict] = []
        self.chat = self.completions = self

    async def create(self, **request) -> ChatCompletion:
        self.requests.append(request)
        message = self.turns.pop(0)
        finish = "tool_calls" if message.tool_calls else "stop"
        choice = Choice(index=0, finish_reason=finish, message=message)
        return ChatCompletion(
            id="scripted", created=0, model=request["model"], object="chat.completion", choices=[choice]
        )


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TASK = [{"role": "user", "content": "What is 2 + 3?"}]


async def test_a_real_episode_keeps_the_sampled_choices(backend, tokenizer):
    client = openai.AsyncOpenAI(base_url=backend.base_url, api_key="unused", max_retries=0)
    prompt = [
        {"role": "system", "content": "You copy text exactly."},
        {
            "role": "user",
            "content": 'Copy exactly:\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        },
    ]
    traj = await run_agent(client, EMBEDDED_MODEL, prompt, [add], max_turns=2, temperature=0, max_tokens=24)
    choices = [item for item in traj.messages_and_choices if isinstance(item, Choice)]
    assert traj.metrics["turns"] == len(choices) >= 1
    assert traj.tools == [add.schema]
    for choice in choices:  # exact sampled ids and their log-probs, for training
        assert choice.token_ids and len(choice.logprobs.content) == len(choice.token_ids)
        statuses = getattr(choice, "tool_statuses", [])
        assert len(statuses) == len(choice.message.tool_calls or [])
    # every call is answered by a tool message with its id, whatever the model wrote
    answered = [m["tool_call_id"] for m in traj.messages() if m["role"] == "tool"]
    assert answered == [c.id for ch in choices for c in ch.message.tool_calls or []]
    assert traj.metrics["max_turns_reached"] == bool(choices[-1].message.tool_calls)
    trained = [t for s in trajectory_sequences(traj, tokenizer, 1.0) for t, m in zip(s.tokens, s.trained) if m]
    assert trained == [t for ch in choices for t in ch.token_ids]
    assert Trajectory.model_validate_json(traj.model_dump_json()).messages() == traj.messages()


async def test_tool_calls_are_executed_answered_and_sent_back():
    model = ScriptedModel(
        calls(call("add", '{"a": 2, "b": 3}', "c1"), call("add", '{"a": 4, "b": 5}', "c2")), answer("Answer: 5")
    )
    traj = await run_agent(model, "m", TASK, [add], temperature=0.5, max_tokens=64, seed=7)
    assert traj.messages()[1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 4, "b": 5}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "9"},
        {"role": "assistant", "content": "Answer: 5"},
    ]
    assert final_answer(traj) == "Answer: 5"
    first, second = model.requests
    assert first["tools"] == [add.schema] and first["logprobs"] is True and first["seed"] == 7
    assert first["temperature"] == 0.5 and first["max_tokens"] == 64
    assert second["messages"] == traj.messages()[:-1]  # the results went back to the model
    assert traj.messages_and_choices[1].tool_statuses == ["ok", "ok"]
    assert traj.metrics["turns"] == 2 and traj.metrics["tool_calls"] == 2
    assert traj.metrics["max_turns_reached"] is False and traj.metrics["tool_errors"] == 0


async def test_every_tool_failure_becomes_a_message_and_a_metric():
    @tool
    def broken(x: int) -> int:
        """Always fails."""
        raise ValueError(f"cannot handle {x}")

    @tool
    def refuses(x: int) -> int:
        """Reports a failure meant for the model."""
        raise ToolError("x must be even")

    @tool
    async def slow() -> str:
        """Never answers in time."""
        await asyncio.sleep(60)
        return "late"

    model = ScriptedModel(
        calls(
            call("subtract", '{"a": 1}', "u"),
            call("add", '{"a": 1}', "b"),
            call("add", "{not json", "j"),
            call("broken", '{"x": 3}', "e"),
            call("refuses", '{"x": 3}', "r"),
            call("slow", "{}", "s"),
        ),
        answer("I could not do it."),
    )
    traj = await run_agent(model, "m", TASK, [add, broken, refuses, slow], tool_timeout=0.2)
    replies = {m["tool_call_id"]: m["content"] for m in traj.messages() if m["role"] == "tool"}
    assert replies == {
        "u": "Error: unknown tool 'subtract'. Available tools: add, broken, refuses, slow.",
        "b": "Error: invalid arguments for add: b: Field required",
        "j": "Error: invalid arguments for add: the arguments are not valid JSON (Expecting property name enclosed in "
        "double quotes at position 1)",
        "e": "Error: broken failed: ValueError: cannot handle 3",
        "r": "Error: x must be even",
        "s": "Error: slow did not answer within 0.2 s.",
    }
    assert traj.messages_and_choices[1].tool_statuses == [
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
        "error",
        "error",
        "timeout",
    ]
    m = traj.metrics
    assert (m["unknown_tool"], m["bad_arguments"], m["tool_errors"], m["tool_timeouts"]) == (1, 2, 2, 1)
    assert m["turns"] == 2 and final_answer(traj) == "I could not do it."  # the episode went on


async def test_parallel_calls_run_concurrently():
    """Each tool waits for the other to have started: run one after the other, the first would time out."""
    started = {"ping": asyncio.Event(), "pong": asyncio.Event()}

    async def meet(me: str, other: str) -> str:
        started[me].set()
        await started[other].wait()
        return me

    @tool
    async def ping() -> str:
        """Ping."""
        return await meet("ping", "pong")

    @tool
    async def pong() -> str:
        """Pong."""
        return await meet("pong", "ping")

    model = ScriptedModel(calls(call("ping", "{}", "1"), call("pong", "{}", "2")), answer("done"))
    traj = await run_agent(model, "m", TASK, [ping, pong], tool_timeout=10)
    assert traj.messages_and_choices[1].tool_statuses == ["ok", "ok"]


async def test_max_turns_ends_a_looping_agent_and_repeats_are_counted():
    model = ScriptedModel(*(calls(call("add", '{"a": 1, "b": 1}', f"c{i}")) for i in range(3)))
    traj = await run_agent(model, "m", TASK, [add], max_turns=3, air=AIRConfig())
    assert traj.metrics["turns"] == 3 and traj.metrics["max_turns_reached"] is True
    assert traj.metrics["repeated_calls"] == 2
    assert final_answer(traj) == "" and traj.messages()[-1]["role"] == "tool"
    # AIR: first call well-formed and executed (+0.1); the repeats lose their penalty back (+0.1 - 0.05 each)
    assert turn_rewards(traj) == pytest.approx([0.1, 0.05, 0.05])
    assert traj.metrics["air_reward"] == pytest.approx(0.2)


async def test_bad_loop_input_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="at least one message"):
        await run_agent(ScriptedModel(), "m", [], [add])
    with pytest.raises(ValueError, match=r"messages\[1\] must be an OpenAI message dict"):
        await run_agent(ScriptedModel(), "m", [TASK[0], "hello"], [add])
    with pytest.raises(ValueError, match="max_turns must be at least 1"):
        await run_agent(ScriptedModel(), "m", TASK, [add], max_turns=0)
    with pytest.raises(ValueError, match="pass an OpenAI client"):
        await run_agent(None, "m", TASK, [add])


async def test_cache_memoises_by_tool_and_canonical_arguments(tmp_path):
    runs: list[dict] = []

    @tool
    def lookup(city: str, year: int) -> str:
        """Population of a city in a year."""
        runs.append({"city": city, "year": year})
        return f"{city}:{year}"

    @tool(cacheable=False)
    def clock() -> str:
        """The time (changes: never cached)."""
        runs.append({"clock": True})
        return "noon"

    cache = ToolCache(tmp_path / "tools.sqlite")

    async def episode(*tool_calls):
        return await run_agent(ScriptedModel(calls(*tool_calls), answer("ok")), "m", TASK, [lookup, clock], cache=cache)

    first = await episode(call("lookup", '{"city": "Oslo", "year": 2020}', "a"), call("clock", "{}", "t"))
    # same call, keys in another order and the year as a string: the validated arguments are the same
    second = await episode(call("lookup", '{"year": "2020", "city": "Oslo"}', "b"), call("clock", "{}", "t"))
    assert runs == [{"city": "Oslo", "year": 2020}, {"clock": True}, {"clock": True}]
    assert (first.metrics["cache_hits"], first.metrics["cache_misses"]) == (0, 1)
    assert (second.metrics["cache_hits"], second.metrics["cache_misses"]) == (1, 0)
    assert second.messages()[2]["content"] == "Oslo:2020"
    assert cache.stats() == {"cache_hits": 1, "cache_misses": 1, "cache_hit_rate": 0.5}
    cache.close()

    replay = ToolCache(tmp_path / "tools.sqlite")  # a later run replays what the first one saw
    traj = await run_agent(
        ScriptedModel(calls(call("lookup", '{"city": "Oslo", "year": 2020}', "c")), answer("ok")),
        "m",
        TASK,
        [lookup],
        cache=replay,
    )
    assert len(runs) == 3 and traj.metrics["cache_hits"] == 1 and len(replay) == 1
    replay.close()


async def test_cache_stores_successes_only_and_runs_identical_parallel_calls_once():
    attempts: list[int] = []

    @tool
    async def flaky(n: int) -> int:
        """Fails the first time."""
        attempts.append(n)
        await asyncio.sleep(0)
        if len(attempts) == 1:
            raise ToolError("try again")
        return n

    cache = ToolCache()
    failed = await run_agent(
        ScriptedModel(calls(call("flaky", '{"n": 1}', "a")), answer("x")), "m", TASK, [flaky], cache=cache
    )
    assert failed.messages()[2]["content"] == "Error: try again" and len(cache) == 0
    same_turn = calls(call("flaky", '{"n": 1}', "b"), call("flaky", '{"n": 1}', "c"))
    traj = await run_agent(ScriptedModel(same_turn, answer("x")), "m", TASK, [flaky], cache=cache)
    assert attempts == [1, 1]  # the error was not cached; the two identical calls ran once
    assert [m["content"] for m in traj.messages()[2:4]] == ["1", "1"]
    assert (traj.metrics["cache_hits"], traj.metrics["cache_misses"]) == (1, 1)
