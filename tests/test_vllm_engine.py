"""The vLLM engine (``flywheel.inference.vllm_engine``) on the stand-in vLLM server (``flywheel.testing.vllm_shim``):
the shim runs the real embedded model (fp32) in a real HTTP server on 127.0.0.1, and is the fault injector (5xx,
timeouts, dropped streams, a server with T=1 log-probs or another tokenizer: faults a real vLLM will not produce on
demand). Flywheel's server serves the same weights twice: "vllm" through the engine over the shim, "local" directly,
so every answer can be compared with the embedded engine's (same seed: same ids). tests/test_vllm_contract.py checks
the same behaviour against the real vLLM."""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest
import torch

import flywheel as art
from flywheel.gateway.client import EpisodeClient
from flywheel.gateway.recorder import Gateway
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model, resolve_model
from flywheel.inference.protocol import SamplerUnavailableError
from flywheel.inference.registry import ModelRegistry
from flywheel.inference.sampling import SamplingParams
from flywheel.inference.vllm_engine import COMPLETIONS, GENERATE, VLLMEngine, VLLMPool, VLLMRefusedError
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store
from flywheel.testing.vllm_shim import ShimFaults, create_shim
from flywheel.train.batch import trajectory_sequences
from flywheel.train.config import TrainConfig
from flywheel.train.trainer import Trainer
from flywheel.types import sampled_tokens

from helpers import refused_both_ways

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is 12 * 7? Use the calculator."}]


class Setup:
    """The fp32 engine, the shim over it, a pool on the shim and Flywheel's server (with a gateway) over both."""

    def __init__(self, tmp) -> None:
        model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=torch.float32)
        # no prefix cache: a hit's cache rows differ from a fresh prefill's in the last bits, and which engine's
        # episode ran first would decide where a T=1 draw lands; uncached, both routes compute alike
        self.engine = InferenceEngine(model, tokenizer, prefix_cache_entries=0)
        self.faults = ShimFaults()
        self.shim = BackgroundServer(create_shim(self.engine, "smol", self.faults)).start()
        self.shim_url = self.shim.base_url.removesuffix("/v1")
        self.pool = self.new_pool()
        asyncio.run(self.pool.start())
        self.registry = ModelRegistry()
        self.registry.add("vllm", VLLMEngine(self.pool))
        self.registry.add("local", self.engine)
        self.server = BackgroundServer(create_app(self.registry, Gateway(Store(f"sqlite:///{tmp / 'fw.db'}")))).start()
        self.root = self.server.base_url.removesuffix("/v1")
        self.client = openai.AsyncOpenAI(base_url=self.server.base_url, api_key="unused", max_retries=0)

    def new_pool(self, timeout: float = 60.0) -> VLLMPool:
        return VLLMPool([self.shim_url], resolve_model(EMBEDDED_MODEL).path, timeout=timeout)

    def close(self) -> None:
        self.server.stop()
        self.shim.stop()
        self.engine.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    s = Setup(tmp_path_factory.mktemp("vllm"))
    yield s
    s.close()


@pytest.fixture
def faults(setup):
    yield setup.faults
    for name, value in vars(ShimFaults()).items():  # every fault off again, whatever the test left
        setattr(setup.faults, name, value)


async def test_ids_and_logprobs_round_trip_n8_on_both_routes(setup, faults):
    prompt = setup.engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    params = SamplingParams(n=8, seed=3, temperature=1.0, max_tokens=8, top_logprobs=2, logprobs=True, stop=["."])
    local = await setup.engine.generate(prompt, params)
    assert setup.pool.servers[0].route == GENERATE  # the shim has the token-in route, as vLLM with --enable-scale-out
    for route in (GENERATE, COMPLETIONS):
        setup.pool.servers[0].route = route
        remote = await VLLMEngine(setup.pool).generate(prompt, params)
        assert [c.token_ids for c in remote] == [c.token_ids for c in local]
        assert len({tuple(c.token_ids) for c in remote}) > 1  # 8 different samples, not one repeated
        assert [c.text for c in remote] == [c.text for c in local]
        assert [c.finish_reason for c in remote] == [c.finish_reason for c in local]
        for r, c in zip(remote, local):
            assert r.logprobs == pytest.approx(c.logprobs, abs=1e-6)
            assert [[t for t, _ in top] for top in r.top_logprobs] == [[t for t, _ in top] for top in c.top_logprobs]
    setup.pool.servers[0].route = GENERATE


async def test_without_the_token_in_route_the_pool_falls_back_to_completions(setup, faults):
    faults.generate_route = False  # vLLM without --enable-scale-out answers 403
    pool = await setup.new_pool().start()
    assert pool.servers[0].route == COMPLETIONS and pool.context_length == setup.engine.context_length


async def test_streaming_through_the_server_with_the_openai_sdk(setup, faults):
    kwargs = dict(messages=QUESTION, max_tokens=12, temperature=0.8, seed=7, n=2)
    expected = await setup.client.chat.completions.create(model="local", **kwargs)
    stream = await setup.client.chat.completions.create(model="vllm", stream=True, logprobs=True, **kwargs)
    texts, logprobs, finish = ["", ""], [0, 0], [None, None]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            logprobs[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [c.message.content for c in expected.choices]
    assert finish == [c.finish_reason for c in expected.choices]
    assert logprobs == [len(sampled_tokens(c).completion_ids) for c in expected.choices]


async def test_guided_choice_and_a_forced_tool_call(setup, faults):
    picked = await setup.client.chat.completions.create(
        model="vllm", messages=QUESTION, max_tokens=6, temperature=1.0, seed=2, n=4,
        extra_body={"guided_choice": ["84", "forty-two"]},
    )  # fmt: skip
    assert {c.message.content for c in picked.choices} <= {"84", "forty-two"}
    kwargs = dict(messages=QUESTION, tools=[CALC], tool_choice="required", max_tokens=24, temperature=0.7, seed=1)
    forced = await setup.client.chat.completions.create(model="vllm", **kwargs)
    local = await setup.client.chat.completions.create(model="local", **kwargs)
    # the grammar held (a call of calc, maybe cut by max_tokens), and the ids are the embedded engine's
    assert forced.choices[0].message.tool_calls[0].function.name == "calc"
    assert sampled_tokens(forced.choices[0]).completion_ids == sampled_tokens(local.choices[0]).completion_ids


async def _tool_episode(setup: Setup, model: str, seed: int, reward: float) -> tuple[art.Trajectory, list[int]]:
    """Three calls in one episode: a forced calc call, the reply to its result, the answer to a follow-up; the
    trajectory and each call's count of re-tokenized turns (a call cut by max_tokens is re-sent re-tokenized)."""
    async with EpisodeClient(setup.root) as episodes:
        episode = await episodes.create(f"task-{model}-{seed}")
        agent = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
        first = await agent.chat.completions.create(
            model=model, messages=QUESTION, tools=[CALC], tool_choice="required", max_tokens=24, temperature=1.0,
            seed=seed,
        )  # fmt: skip
        message = first.choices[0].message
        call = message.tool_calls[0]
        history = [
            *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "84"},
        ]
        second = await agent.chat.completions.create(
            model=model, messages=history, tools=[CALC], max_tokens=12, temperature=1.0, seed=seed + 1
        )
        history += [
            {"role": "assistant", "content": second.choices[0].message.content or ""},
            {"role": "user", "content": "And 84 + 1?"},
        ]
        await agent.chat.completions.create(
            model=model, messages=history, tools=[CALC], max_tokens=12, temperature=1.0, seed=seed + 2
        )
        calls = await episodes.calls(episode.id)
        assert len(calls) == 3
        await episodes.finish(episode.id, reward)
        return await episodes.trajectory(episode.id), [c["retokenized_turns"] for c in calls]


async def test_a_tool_episode_through_the_gateway_records_the_local_engines_ids_and_trains(setup, faults):
    tokenizer = setup.engine.tokenizer
    remote_runs = [await _tool_episode(setup, "vllm", seed, float(seed % 2)) for seed in (10, 11)]
    local_runs = [await _tool_episode(setup, "local", seed, float(seed % 2)) for seed in (10, 11)]
    assert [turns for _, turns in remote_runs] == [turns for _, turns in local_runs]
    remote, local = [t for t, _ in remote_runs], [t for t, _ in local_runs]
    for r, loc in zip(remote, local):
        rs, ls = trajectory_sequences(r, tokenizer), trajectory_sequences(loc, tokenizer)
        assert [s.tokens for s in rs] == [s.tokens for s in ls] and [s.trained for s in rs] == [s.trained for s in ls]
        for a, b in zip(rs, ls):
            assert [x for x in a.sampler_logprobs if not math.isnan(x)] == pytest.approx(
                [x for x in b.sampler_logprobs if not math.isnan(x)], abs=1e-6
            )
    trainer = Trainer(setup.engine)  # trains the weights both sides sample: last in this module
    config = TrainConfig(learning_rate=1e-5, importance_sampling_cap=2.0)
    metrics = trainer.rl_step([art.TrajectoryGroup(remote)], config)
    assert metrics["skipped"] == 0.0 and metrics["tokens_trained"] > 0
    assert metrics["sampler_logprob_gap"] < 1e-3 and metrics["is_ratio_mean"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(
    ("fault", "status", "words"),
    [
        ({"status": 503}, 502, "HTTP 503"),
        ({"status": 500}, 502, "HTTP 500"),
        ({"drop_after_chunks": 1}, 502, "failed"),
        ({"status": 400}, 400, "vLLM refused the request"),
    ],
)
async def test_faults_of_the_vllm_server_are_a_502_naming_it_and_its_refusals_a_400(
    setup, faults, fault, status, words
):
    for name, value in fault.items():
        setattr(faults, name, value)
    with pytest.raises(openai.APIStatusError) as caught:
        await setup.client.chat.completions.create(model="vllm", messages=QUESTION, max_tokens=8, seed=1)
    assert caught.value.status_code == status and words in caught.value.message
    if status == 502:
        assert setup.shim_url in caught.value.message


@pytest.mark.parametrize(("fault", "status"), [({"status": 503}, 502), ({"status": 400}, 400)])
async def test_a_streamed_call_that_fails_before_its_first_token_is_refused_as_an_unstreamed_one(
    setup, faults, fault, status
):
    for name, value in fault.items():
        setattr(faults, name, value)
    plain, streamed = await refused_both_ways(setup.client, model="vllm", messages=QUESTION, max_tokens=8, seed=1)
    assert plain.status_code == streamed.status_code == status and plain.body == streamed.body


async def test_a_stopped_vllm_server_is_a_502_streamed_or_not(setup, faults):
    shim = BackgroundServer(create_shim(setup.engine, "smol")).start()
    url = shim.base_url.removesuffix("/v1")
    setup.registry.add("vllm-gone", VLLMEngine(await VLLMPool([url], resolve_model(EMBEDDED_MODEL).path).start()))
    shim.stop()  # nothing listens on its port now
    plain, streamed = await refused_both_ways(setup.client, model="vllm-gone", messages=QUESTION, max_tokens=8)
    assert plain.status_code == streamed.status_code == 502 and plain.body == streamed.body
    assert streamed.code == "sampler_unavailable" and url in streamed.message


async def test_a_stream_the_vllm_server_drops_after_its_first_token_ends_with_an_error_event(setup, faults):
    faults.drop_after_chunks = 1  # one token sent, then the connection is cut
    stream = await setup.client.chat.completions.create(
        model="vllm", messages=QUESTION, max_tokens=8, seed=1, stream=True, logprobs=True
    )  # the status line is sent once the first token is drawn: a 200, so the fault comes in the stream
    tokens = 0
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            tokens += sum(len(c.logprobs.content) for c in chunk.choices if c.logprobs)
    assert tokens == 1 and not isinstance(caught.value, openai.APIStatusError)
    assert setup.shim_url in caught.value.message


async def test_the_engine_refuses_a_top_p_below_1_saying_why(setup, faults):
    kwargs = dict(messages=QUESTION, max_tokens=4, seed=1, top_p=0.9)
    plain, streamed = await refused_both_ways(setup.client, model="vllm", **kwargs)
    assert plain.status_code == streamed.status_code == 400 and plain.body == streamed.body
    assert "top_p=0.9" in plain.message and "nucleus" in plain.message and "importance ratio" in plain.message
    assert (await setup.client.chat.completions.create(model="local", **kwargs)).choices  # the embedded engine takes it


async def test_the_shim_refuses_a_model_it_does_not_serve_as_vllm_does(setup, faults):
    ids = setup.engine.tokenizer.encode("Hi", add_special_tokens=False)
    requests = {
        "/tokenize": {"model": "calc-7b", "prompt": "Hi"},
        GENERATE: {"model": "calc-7b", "token_ids": ids, "sampling_params": {"max_tokens": 1}},
        COMPLETIONS: {"model": "calc-7b", "prompt": ids, "max_tokens": 1},
    }
    async with httpx.AsyncClient(base_url=setup.shim_url) as http:
        for path, body in requests.items():
            refused = await http.post(path, json=body)
            assert refused.status_code == 404 and refused.json() == {
                "error": {"message": "The model `calc-7b` does not exist. Valid aliases: smol.",
                          "type": "NotFoundError", "param": "model", "code": 404}
            }, path  # fmt: skip
            assert (await http.post(path, json=body | {"model": "smol"})).status_code == 200, path
    # so an engine that sent another name than the one it was started with would fail: a 502 naming the answer
    pool = await setup.new_pool().start()
    pool.model = "calc-7b"
    with pytest.raises(SamplerUnavailableError, match="HTTP 404: The model `calc-7b` does not exist"):
        await VLLMEngine(pool).generate(ids, SamplingParams(max_tokens=1))


async def test_a_vllm_server_that_does_not_answer_in_time_is_a_502(setup, faults):
    slow = await setup.new_pool(timeout=2.0).start()
    faults.delay_s = 4.0
    setup.registry.add("vllm-slow", VLLMEngine(slow))
    with pytest.raises(openai.APIStatusError) as caught:
        await setup.client.chat.completions.create(model="vllm-slow", messages=QUESTION, max_tokens=8)
    assert (
        caught.value.status_code == 502 and "Timeout" in caught.value.message and setup.shim_url in caught.value.message
    )


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ({"raw_logprobs": True}, "--logprobs-mode processed_logprobs"),
        ({"tokenize_shift": 1}, "tokenizes differently"),
    ],
)
async def test_the_probes_refuse_a_server_that_would_record_wrong_data(setup, faults, fault, words):
    for name, value in fault.items():
        setattr(faults, name, value)
    with pytest.raises(VLLMRefusedError) as caught:
        await setup.new_pool().start()
    assert words in str(caught.value) and setup.shim_url in str(caught.value)


async def test_the_probes_refuse_a_server_without_the_model(setup, faults):
    pool = VLLMPool([setup.shim_url], resolve_model(EMBEDDED_MODEL).path, model="calc-7b")
    with pytest.raises(VLLMRefusedError, match="does not serve the model 'calc-7b'.*serves: smol"):
        await pool.start()
