"""Held-out evaluation through the gateway's runners (flywheel/loop/evaluate.py): a real Runner with a small agent
on the session's model, each item scored by a grader stack, grades recorded, results paired by the gate."""

from __future__ import annotations

import asyncio

import openai

from flywheel.backend import LocalBackend
from flywheel.gateway.client import QueueClient
from flywheel.gateway.runner import Runner, current_lease
from flywheel.graders.stack import parse_stack
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.loop.evaluate import evaluate
from flywheel.loop.gate import GatePolicy, HeldOutSet, decide
from flywheel.store import grades as gdb

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
        temperature=0,
    )
    return 0.0  # the agent's own reward is not what the gate looks at: the stack grades the episode


async def test_held_out_items_run_by_runners_are_scored_recorded_and_paired(backend: LocalBackend):
    root = backend.base_url.removesuffix("/v1")
    runner = asyncio.create_task(Runner(root, agent, concurrency=4, poll_interval=0.1).run())
    try:
        async with QueueClient(root) as queue:
            first = await evaluate(queue, HELDOUT, EMBEDDED_MODEL, STACK, samples=2, max_wait=300, store=backend.gateway.store)  # fmt: skip
            again = await evaluate(queue, HELDOUT, EMBEDDED_MODEL, STACK, samples=2, max_wait=300)
    finally:
        runner.cancel()
    assert [r.item for r in first.results] == ["q0", "q1", "q2", "q3"] and first.failed_items == ["q3"]
    assert len(first.episodes) == 6 and first.stack == STACK.version and first.heldout.startswith("colours@")
    answered = first.results[:3]
    assert all(r.tokens > 0 and r.latency_ms > 0 and r.safe and r.tool_calls == 0 for r in answered)
    assert first.results[3].score == 0.0  # every attempt failed: the item counts as not done
    with backend.gateway.store.session() as s:
        grades = [g for e in first.episodes for g in gdb.grades_of(s, e)]
    assert len(grades) == 12 and {g.version for g in grades} == {STACK.version}  # reward + safety per episode
    assert {g.component for g in grades} == {"reward", "safety"}
    # greedy decoding: the same model twice gives the same scores, and the gate sees no lift
    assert [r.score for r in again.results] == [r.score for r in first.results]
    decision = decide(again.results, first.results, GatePolicy(min_items=2))
    assert not decision.promote and decision.lift.mean == 0.0
