"""The engine's lifecycle: weight updates while sequences decode, closing with work in flight (directly, over HTTP,
by eviction from the backend's checkpoint engines), and a script that exits without closing its backend."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from flywheel.inference.chat import render_prompt
from flywheel.inference.engine import EngineClosedError, InferenceEngine
from flywheel.inference.kv_attention import SlotKVCache
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.prefix_cache import PrefixCache
from flywheel.inference.registry import ModelRegistry
from flywheel.inference.sampling import SamplingParams
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in full sentences. " * 4}
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
HANG = 60  # seconds after which a request that should have ended counts as hung


@pytest.fixture(scope="module")
def loaded():
    """A float32 model of our own: tests here change its weights and close engines over it, one at a time."""
    model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    return model, tokenizer


@pytest.fixture
def own_engine(loaded) -> Iterator[InferenceEngine]:
    engine = InferenceEngine(*loaded)
    yield engine
    engine.close()


def prompt(tokenizer, question: str = "Tell me a long story about the sea.") -> list[int]:
    return render_prompt(tokenizer, [SYSTEM, {"role": "user", "content": question}])


async def until_decoding(engine: InferenceEngine, rows: int = 1, tokens: int = 2) -> None:
    """Wait until ``rows`` sequences decode, each with at least ``tokens`` sampled."""
    async with asyncio.timeout(HANG):
        while len(engine._running) < rows or any(len(s.output) < tokens for s in engine._running):
            await asyncio.sleep(0.01)


# ---- weight updates ------------------------------------------------------------------------------------------


def test_the_prefix_cache_refuses_kv_of_another_weights_generation():
    like = SlotKVCache(2, 1, 4, dtype=torch.float32, device="cpu")
    like.reserve(1, 64)
    cache = PrefixCache(like, max_entries=2)
    tokens = list(range(40))
    cache.clear(generation=1)
    cache.insert(tokens, like, 0, generation=0)  # computed before the update
    assert not cache.entries and cache.lookup(tokens)[1] == 0
    cache.insert(tokens, like, 0, generation=1)
    assert cache.lookup(tokens)[1] == len(tokens) - 1


async def test_a_sequence_decoding_across_a_weight_update_leaves_no_stale_kv_in_the_prefix_cache(own_engine, loaded):
    """A training step while a sequence decodes: that sequence finishes (with KV from both weights), but none of
    its KV may be reused. A new request with its prompt gets the logits of a cold start with the new weights."""
    engine, (model, tokenizer) = own_engine, loaded
    p = prompt(tokenizer)
    weight = model.model.layers[0].self_attn.v_proj.weight
    # 400 tokens, not fewer: the worker may take the model lock back for many steps before exclusive() gets it
    # (a lock is not fair), and the sequence must still be decoding then (48 once finished first, in a CI run)
    decoding = asyncio.ensure_future(engine.generate(p, LONG))
    await until_decoding(engine)
    try:
        with engine.exclusive(), torch.no_grad():  # as a training step does
            assert engine._running and len(engine._running[0].output) < LONG.max_tokens
            weight.mul_(2.0)
        assert len((await decoding)[0].token_ids) == LONG.max_tokens
        assert not engine.prefix_cache.entries, "KV computed with the old weights went back into the prefix cache"
        probe = SamplingParams(temperature=0.0, max_tokens=1, logprobs=True, top_logprobs=5)
        after = (await engine.generate(p, probe))[0]
        with engine.exclusive():
            pass  # empties the prefix cache: the next prefill starts cold, as a fresh engine's would
        cold = (await engine.generate(p, probe))[0]
        assert after.top_logprobs == cold.top_logprobs and after.logprobs == cold.logprobs
    finally:
        with engine.exclusive(), torch.no_grad():
            weight.mul_(0.5)  # exact in float32: the module's model is as loaded again


# ---- closing -------------------------------------------------------------------------------------------------


async def test_closing_ends_waiting_and_decoding_requests_and_refuses_new_ones(loaded):
    engine = InferenceEngine(*loaded, max_batch=1)  # the second request waits for the first one's row
    p = prompt(loaded[1])
    decoding = asyncio.ensure_future(engine.generate(p, LONG))
    await until_decoding(engine)
    waiting = asyncio.ensure_future(engine.generate(p, LONG))
    streaming = engine.stream(p, LONG)
    streamed = asyncio.ensure_future(anext(streaming))
    await asyncio.sleep(0.1)
    assert len(engine._waiting) == 2
    await asyncio.to_thread(engine.close)
    for request in (decoding, waiting, streamed):
        with pytest.raises(EngineClosedError, match="closed before this request finished"):
            await asyncio.wait_for(request, HANG)
    await streaming.aclose()
    assert not engine._thread.is_alive()
    with pytest.raises(EngineClosedError, match="accepts no new requests"):
        await asyncio.wait_for(engine.generate(p, LONG), HANG)
    with pytest.raises(EngineClosedError, match="runs no more calls"):
        await asyncio.wait_for(engine.call(lambda: None), HANG)
    engine.close()  # twice: nothing more happens


async def test_a_draining_engine_finishes_what_it_was_given_then_stops(loaded):
    engine = InferenceEngine(*loaded, max_batch=1)
    p = prompt(loaded[1])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    decoding = asyncio.ensure_future(engine.generate(p, params))
    await until_decoding(engine)
    waiting = asyncio.ensure_future(engine.generate(p, params))
    await asyncio.sleep(0.1)
    engine.close(drain=True)
    with pytest.raises(EngineClosedError, match="accepts no new requests"):
        await engine.generate(p, params)
    first, second = await asyncio.wait_for(asyncio.gather(decoding, waiting), HANG)
    assert len(first[0].token_ids) == len(second[0].token_ids) == 24
    await asyncio.to_thread(engine._thread.join, HANG)
    assert not engine._thread.is_alive()


async def test_a_closed_engine_answers_http_503_not_500(loaded):
    engine = InferenceEngine(*loaded)
    registry = ModelRegistry()
    registry.add("m", engine)
    server = BackgroundServer(create_app(registry)).start()
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    try:
        kwargs = dict(model="m", messages=[{"role": "user", "content": "Tell me a story."}], temperature=0)
        long = client.chat.completions.create(**kwargs, max_tokens=400, extra_body={"ignore_eos": True})
        in_flight = asyncio.ensure_future(long)
        await until_decoding(engine)
        await asyncio.to_thread(engine.close)
        for request in (in_flight, client.chat.completions.create(**kwargs, max_tokens=4)):  # during, after
            with pytest.raises(openai.InternalServerError) as error:
                await asyncio.wait_for(request, HANG)
            assert error.value.status_code == 503 and "The inference engine" in str(error.value)
    finally:
        server.stop()
        engine.close()


async def test_a_checkpoint_engine_evicted_while_it_decodes_finishes_its_requests(tmp_path: Path):
    """The backend keeps two earlier-step engines; asking for a third closes the oldest, which may be decoding."""
    backend = LocalBackend(path=tmp_path)
    model = TrainableModel(name="evicted", project="lifecycle", base_model=EMBEDDED_MODEL)
    try:
        await model.register(backend)
        trainer, run = backend.trainer(model), backend.run(model)
        checkpoint = await trainer.engine.call(trainer.checkpoint)
        for step in (1, 2, 3):  # as the backend writes them after a step (the weights need not change here)
            state = checkpoint.state.model_copy(update={"step": step})
            await asyncio.to_thread(run.write, dataclasses.replace(checkpoint, state=state))
        client = openai.AsyncOpenAI(base_url=backend.base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Tell me a story."}]
        long = dict(max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
        first = asyncio.ensure_future(client.chat.completions.create(model="evicted@1", messages=messages, **long))
        async with asyncio.timeout(HANG):
            while "evicted@1" not in backend._checkpoint_engines:
                await asyncio.sleep(0.05)
        evicted = backend._checkpoint_engines["evicted@1"]
        await until_decoding(evicted)
        for later in ("evicted@2", "evicted@3"):  # the third one evicts evicted@1
            await client.chat.completions.create(model=later, messages=messages, max_tokens=2)
        assert "evicted@1" not in backend._checkpoint_engines
        done = await asyncio.wait_for(first, HANG)
        assert done.choices[0].finish_reason == "length" and len(done.choices[0].token_ids) == 200
        await asyncio.to_thread(evicted._thread.join, HANG)
        assert not evicted._thread.is_alive()  # and it stopped once drained
    finally:
        await backend.close()


# ---- interpreter exit ----------------------------------------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    import flywheel as art

    async def main():
        backend = art.LocalBackend(path=sys.argv[1])
        model = art.TrainableModel(name="agent-001", project="exit", base_model="smollm2-135m-instruct")
        await model.register(backend)
        client = model.openai_client()
        messages = [{"role": "user", "content": "What is 12 + 7?"}]
        r = await client.chat.completions.create(model=model.get_inference_name(), messages=messages, max_tokens=8)
        print("answered:", r.choices[0].message.content is not None)
        # a rollout still running when the script ends: the engine is inside a forward at interpreter exit
        asyncio.ensure_future(client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=2000, extra_body={"ignore_eos": True}
        ))
        await asyncio.sleep(0.5)
        if sys.argv[2] == "raise":
            raise RuntimeError("the script's own error")

    asyncio.run(main())  # and no backend.close(), as in ART's examples
    """
)


@pytest.mark.slow
def test_a_script_that_never_closes_its_backend_exits_cleanly(tmp_path: Path):
    """Before the atexit hooks, ~every run aborted: "terminate called without an active exception", status 134."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    for i, mode in enumerate(["return", "raise"]):  # ~every run aborted before: two runs show it
        run = subprocess.run(
            [sys.executable, str(script), str(tmp_path / f"home{i}"), mode], capture_output=True, text=True, timeout=300
        )
        assert "terminate called" not in run.stderr, f"run {i} ({mode}):\n{run.stderr[-3000:]}"
        assert "answered: True" in run.stdout, f"run {i} ({mode}):\n{run.stderr[-3000:]}"
        if mode == "return":
            assert run.returncode == 0 and "Traceback" not in run.stderr, f"run {i}:\n{run.stderr[-3000:]}"
        else:
            assert run.returncode == 1, f"run {i}:\n{run.stderr[-3000:]}"
            assert run.stderr.count("Traceback") == 1, run.stderr[-3000:]  # the script's own, and nothing else
            assert run.stderr.rstrip().endswith("RuntimeError: the script's own error")
