"""Helpers shared by several test files (fixtures live in conftest.py)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from alembic import command
from alembic.config import Config
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)
from sqlalchemy import text

from flywheel.store import episodes
from flywheel.store.db import MIGRATIONS, _engine

if TYPE_CHECKING:
    from pathlib import Path

    from flywheel.local.backend import LocalBackend
    from flywheel.loop.evaluate import HeldOutRun
    from flywheel.model import TrainableModel
    from flywheel.store import Store
    from flywheel.train.trainer import Trainer
    from flywheel.types import Trajectory


def sampled(content: str | None, prompt: list[int], tokens: list[int], call: str | None = None) -> Choice:
    """A choice as the server returns it (prompt and sampled token ids); with ``call``, one ``calc`` tool call of
    that id whose tool ran ("ok")."""
    calls = (
        [
            ChatCompletionMessageFunctionToolCall(
                id=call, type="function", function=Function(name="calc", arguments='{"e": "2+3"}')
            )
        ]
        if call
        else None
    )
    choice = Choice(
        index=0,
        finish_reason="tool_calls" if call else "stop",
        message=ChatCompletionMessage(role="assistant", content=content, tool_calls=calls),
    )
    choice.prompt_token_ids, choice.token_ids = prompt, tokens
    if call:
        choice.tool_statuses = ["ok"]
    return choice


def lora_b_off_zero(trainer: Trainer, std: float, *, seeded: bool = False) -> None:
    """Draw the LoRA B matrices from N(0, std) (peft starts them at zero: the adapter adds nothing and A gets no
    gradient), from a generator seeded by each weight's name with ``seeded`` (else torch's global one), and give the
    fp32 masters (what an update trains from) the new values."""
    import torch

    with torch.no_grad():
        for name, p in zip(trainer.names, trainer.params):
            if "lora_B" in name:
                p.normal_(std=std, generator=torch.Generator().manual_seed(len(name)) if seeded else None)
    trainer._adopt_params()


def at_once(n: int, fn: Callable[[int], Any]) -> tuple[list[Any], list[BaseException]]:
    """``fn(i)`` in ``n`` threads released together; their results, and what they raised."""
    barrier = threading.Barrier(n)
    results: list[Any] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results.append(fn(i))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results, errors


def at_revision(url: str, revision: str, inserts: list[tuple[str, list[dict]]]) -> None:
    """A database migrated up to ``revision`` only, with rows inserted as they were stored then."""
    engine = _engine(url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
            for statement, rows in inserts:
                connection.execute(text(statement), rows)
    finally:
        engine.dispose()


async def train_a_step_and_log(backend: LocalBackend, model: TrainableModel) -> None:
    """Register ``model``, train one RL step on two sampled answers (rewards 0 and 1) and ``model.log`` them as a
    ``val`` split with ``accuracy`` 0.5: the rows a logger under test should receive (steps 1, train and val)."""
    await model.register(backend)
    trajectories = await train_a_step(backend, model)
    await model.log(trajectories, split="val", metrics={"accuracy": 0.5})


async def lora_checkpoint(backend: LocalBackend, model: TrainableModel) -> Path:
    """A real Flywheel LoRA checkpoint: ``model`` (LoRA) registered, its B matrices drawn off zero (so the adapter
    changes every answer) and one RL step trained; checkpoint 1's directory."""
    await model.register(backend)
    lora_b_off_zero(backend.trainer(model), std=0.02, seeded=True)
    await train_a_step(backend, model)
    return backend.run(model).checkpoint_dir(1)


async def train_a_step(backend: LocalBackend, model: TrainableModel) -> list[Trajectory]:
    """One RL step of a registered ``model`` on two sampled answers (rewards 0 and 1); those trajectories."""
    from flywheel.types import Trajectory, TrajectoryGroup

    client = model.openai_client()
    prompt = [{"role": "user", "content": "Name a fruit."}]
    trajectories = []
    for reward in (0.0, 1.0):
        r = await client.chat.completions.create(
            model=model.get_inference_name(), messages=prompt, max_tokens=4, logprobs=True
        )
        trajectories.append(Trajectory(messages_and_choices=[*prompt, r.choices[0]], reward=reward))
    result = await backend.train(model, [TrajectoryGroup(trajectories)], learning_rate=1e-4)
    assert result.step == 1 and result.metrics["skipped"] == 0
    return trajectories


def emulate(browser: Any, width: int, height: int, dark: bool = False) -> None:
    """Have a Chromium driver (Selenium's) lay pages out as a screen ``width`` x ``height`` (a phone's below 600
    pixels) in the light or ``dark`` colour scheme."""
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600},
    )
    scheme = [{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": scheme})


def wait_until_healthy(proc: subprocess.Popen, base: str, output: Callable[[], object]) -> None:
    """Until ``proc``'s server at ``base`` answers /health (at most 5 minutes); ``output``: what to show if it died."""
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, output()
        assert time.monotonic() < deadline, "the server did not come up in 5 minutes"
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.5)


# ---- the loop's ladder, driven without runners (tests/test_loop.py, tests/test_dashboard_loop.py) -------------------

WATCH_STACK = {
    "name": "support",
    "reward": {"type": "string_check", "name": "refund", "input": "{{sample.output_text}}", "reference": "refund", "operation": "like"},
    "safety": {"type": "multi", "name": "no-card", "calculate_output": "1 - card",
               "graders": {"card": {"type": "string_check", "name": "card", "input": "{{sample.output_text}}", "reference": "card", "operation": "like"}}},
}  # fmt: skip


def record_call(s, episode: str, alias: str, step: int, answer: str, messages: list | None = None) -> None:
    """A call of ``episode`` that ``alias`` (its checkpoint ``step``) answered with ``answer``, recorded as the gateway
    records one: the call, and the episode's arm (``flywheel.store.arms.mark_arm``)."""
    from flywheel.store.arms import mark_arm

    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}  # fmt: skip
    episodes.add_call(
        s, episode, model=alias, step=step, request={"messages": messages or []}, response=response, prompt_tokens=1,
        completion_tokens=1, latency_ms=1.0, prefix_call=None, prefix_choice=None, prefix_message=None,
        retokenized_turns=0, reward=None, deployment=alias,
    )  # fmt: skip
    mark_arm(s, episode, alias)


def answered(store: Store, alias: str, step: int, answer: str, *, finish: bool = True) -> str:
    """A finished production episode whose one call ``alias`` (its checkpoint ``step``) answered with ``answer``."""
    with store.session() as s:
        e = episodes.create_episode(s, "ticket", split="production", meta={"item": {"id": "ticket"}})
        record_call(s, e.id, alias, step, answer)
        if finish:
            episodes.set_outcome(s, e.id, reward=0.0, finish=True)
    return e.id


def heldout_run(model: str, score: float, items: int = 3, scores: list[float] | None = None) -> HeldOutRun:
    """A held-out run as ``evaluate`` returns it (``items`` items, each scored ``score`` or as ``scores`` say, safe)."""
    from flywheel.loop.evaluate import HeldOutRun
    from flywheel.loop.gate import ItemResult

    scores = scores or [score] * items
    results = [ItemResult(item=f"q{i}", score=value, safe=True, tokens=5) for i, value in enumerate(scores)]
    return HeldOutRun(id=f"run-{model}", model=model, heldout="colours@1", stack="s", results=results, episodes=[],
                      failed_items=[])  # fmt: skip


def fuzz_routes(
    base: str, path_regex: str, mode: Any, *, max_examples: int = 12, exclude: str | None = None
) -> tuple[dict[str, int], int]:
    """Schemathesis over the routes of the server at ``base`` whose path matches ``path_regex`` (not ``exclude``),
    in ``mode`` (positive: what the OpenAPI schema allows; negative: what it does not), ``max_examples`` cases a
    route: no answer is a 5xx, and every 4xx is OpenAI's error shape with a message. Returns how many cases reached
    each route ("METHOD /path"), and how many routes there were."""
    import hypothesis
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{base}/openapi.json").include(path_regex=path_regex)
    if exclude is not None:
        schema = schema.exclude(path_regex=exclude)
    called: dict[str, int] = {}

    def call(case) -> None:
        response = case.call(base_url=base, timeout=60)
        route = f"{case.method} {case.operation.path}"
        called[route] = called.get(route, 0) + 1
        assert response.status_code < 500, (route, case.formatted_path, response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert response.json()["error"]["message"], (route, case.formatted_path, response.text[:500])

    settings = hypothesis.settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(hypothesis.HealthCheck))  # fmt: skip
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        try:
            settings(hypothesis.given(case=operation.as_strategy(mode))(call))()
        except hypothesis.errors.Unsatisfiable:  # a route with nothing its schema forbids to send (no negative case)
            assert mode == schemathesis.GenerationMode.NEGATIVE, operation.label
    return called, len(operations)


async def refused_both_ways(client: openai.AsyncOpenAI, **request: Any) -> list[openai.APIStatusError]:
    """The HTTP errors a chat completion ``request`` gets unstreamed and streamed (``stream=True``), in that order: a
    streamed call that fails before its first token must be refused as the unstreamed one is, not answered 200."""
    errors = []
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(stream=stream, **request)
        errors.append(caught.value)
    return errors
