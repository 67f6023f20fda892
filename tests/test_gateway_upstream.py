"""The gateway in front of an upstream (issue #24 item 5), all on real loopback servers with the real model.

The upstream is a second real Flywheel server serving the session's engine as "upstream-model": like vLLM with
``return_token_ids``, it returns the prompt's and each choice's token ids. A hosted API that returns no ids cannot
be reached from here, so a small real FastAPI app in this file stands in for one: it refuses the unknown field
``return_token_ids`` with a 400, as OpenAI does, and forwards the rest to the upstream with the id fields stripped
(its 503 for one model name is the one fault it injects: a real upstream's outage cannot be caused on demand)."""

from __future__ import annotations

import asyncio
import json
import math
import socket

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner, Result

from flywheel.cli import app
from flywheel.gateway.client import EpisodeClient, GatewayError
from flywheel.gateway.recorder import Gateway
from flywheel.gateway.upstream import Upstream
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store
from flywheel.train.batch import trajectory_sequences
from flywheel.types import sampled_tokens

UPSTREAM_MODEL, LOCAL_MODEL = "upstream-model", "local-model"
QUESTION = [{"role": "user", "content": "What is 12 * 7?"}]
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
TEXT_ONLY_REASON = "its upstream returned no token ids: usable for SFT, graders and evaluation, not RL"


def root(server: BackgroundServer) -> str:
    return server.base_url.removesuffix("/v1")


def agent(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def upstream(engine):
    """The upstream: another real server, which knows nothing of episodes."""
    registry = ModelRegistry()
    registry.add(UPSTREAM_MODEL, engine)
    server = BackgroundServer(create_app(registry)).start()
    yield server
    server.stop()


def text_only_api(upstream: BackgroundServer) -> FastAPI:
    """A hosted API's stand-in: no token ids in its answers, a 400 for the field it does not know."""
    app = FastAPI()
    app.state.asked = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.asked.append(body | {"authorization": request.headers.get("authorization")})
        if "return_token_ids" in body:
            error = {
                "message": "Unrecognized request argument supplied: return_token_ids",
                "type": "invalid_request_error",
            }
            return JSONResponse({"error": error | {"param": None, "code": None}}, status_code=400)
        if body["model"] == "slow":
            await asyncio.sleep(3)
        if body["model"] in ("overloaded", "slow"):
            return JSONResponse({"error": {"message": "The server is overloaded.", "type": "server_error"}}, 503)
        if body.get("stream"):
            return StreamingResponse(stream_without_ids(body), media_type="text/event-stream")
        async with httpx.AsyncClient(base_url=upstream.base_url, timeout=120) as http:
            answer = (await http.post("/chat/completions", json=body | {"model": UPSTREAM_MODEL})).json()
        return without_ids(answer)

    def without_ids(answer: dict) -> dict:
        answer.pop("prompt_token_ids", None)
        for choice in answer["choices"]:
            for key in ("prompt_token_ids", "token_ids", "temperature"):
                choice.pop(key, None)
        return answer

    async def stream_without_ids(body: dict):
        """The upstream's stream without ids, and without the closing ``[DONE]`` (not every server sends it)."""
        async with (
            httpx.AsyncClient(base_url=upstream.base_url, timeout=120) as http,
            http.stream("POST", "/chat/completions", json=body | {"model": UPSTREAM_MODEL}) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    yield f"data: {json.dumps(without_ids(json.loads(line[6:])))}\n\n"

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "hosted-model", "object": "model", "created": 0, "owned_by": "x"}]}

    return app


def gateway_server(engine, tmp_path, name: str, upstream: Upstream) -> BackgroundServer:
    registry = ModelRegistry()
    registry.add(LOCAL_MODEL, engine)  # the local engine still serves its own names
    gateway = Gateway(Store(f"sqlite:///{tmp_path / name}.db"))
    return BackgroundServer(create_app(registry, gateway, upstream=upstream)).start()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once it is closed


@pytest.fixture(scope="module")
def servers(engine, upstream, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("upstream-gateways")
    hosted_app = text_only_api(upstream)
    hosted = BackgroundServer(hosted_app).start()
    gone = closed_port()
    built = {
        "vllm_like": gateway_server(engine, tmp, "vllm", Upstream(upstream.base_url)),
        "hosted": gateway_server(engine, tmp, "hosted", Upstream(hosted.base_url, api_key="sk-hosted-secret")),
        "gone": gateway_server(
            engine, tmp, "gone", Upstream(f"http://127.0.0.1:{gone}/v1", api_key="sk-gone-secret", timeout=5)
        ),
        "impatient": gateway_server(engine, tmp, "impatient", Upstream(hosted.base_url, timeout=1)),
        "hosted_api": hosted,
    }
    yield built | {"hosted_app": hosted_app}
    for server in built.values():
        server.stop()


async def test_an_episode_through_the_upstream_records_its_sampled_ids_and_trains(servers, upstream, tokenizer):
    gateway = servers["vllm_like"]
    async with EpisodeClient(root(gateway)) as episodes:
        episode = await episodes.create("task-upstream")
        client = agent(episode.base_url)
        first = await client.chat.completions.create(
            model=UPSTREAM_MODEL, messages=QUESTION, max_tokens=10, temperature=0.8, seed=3
        )
        assert first.choices[0].logprobs is None  # the gateway asked for them; the client did not
        history = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content}]
        history.append({"role": "user", "content": "Sure?"})
        second = await client.chat.completions.create(
            model=UPSTREAM_MODEL, messages=history, max_tokens=6, logprobs=True
        )
        a, b = sampled_tokens(first.choices[0]), sampled_tokens(second.choices[0])  # what the upstream sampled
        assert a is not None and b is not None
        assert len(second.choices[0].logprobs.content) == len(b.completion_ids)  # asked for: sent

        calls = await episodes.calls(episode.id)
        assert [c["model"] for c in calls] == [UPSTREAM_MODEL] * 2
        assert all(c["upstream"] == f"http://127.0.0.1:{upstream.port}" for c in calls)  # where, never a key
        assert all(not c["text_only"] for c in calls)
        for call, sampled in zip(calls, (a, b)):
            choice = call["response"]["choices"][0]
            assert choice["token_ids"] == sampled.completion_ids and choice["prompt_token_ids"] == sampled.prompt_ids
            assert len(choice["logprobs"]["content"]) == len(sampled.completion_ids)  # kept for training
        assert calls[0]["response"]["choices"][0]["temperature"] == 0.8
        assert "return_token_ids" not in calls[0]["request"] and "logprobs" not in calls[0]["request"]
        # nothing spliced into an upstream's prompt: its re-sent assistant turn counts as re-tokenized
        assert [c["retokenized_turns"] for c in calls] == [0, 1] and calls[1]["prefix_call"] is None

        await episodes.finish(episode.id, 1.0)
        trajectory = await episodes.trajectory(episode.id)
        assert "text_only" not in trajectory.metadata and trajectory.metrics["retokenized_turns"] == 1
        sequences = trajectory_sequences(trajectory, tokenizer)
        trained = sorted([t for t, on in zip(s.tokens, s.trained) if on] for s in sequences)
        assert trained == sorted([a.completion_ids, b.completion_ids])  # exactly what the upstream drew
        group = await episodes.group("task-upstream")
        assert [t.reward for t in group] == [1.0]


async def test_a_streamed_upstream_call_is_relayed_and_recorded(servers):
    gateway = servers["vllm_like"]
    async with EpisodeClient(root(gateway)) as episodes:
        episode = await episodes.create("task-upstream-stream")
        stream = await agent(episode.base_url).chat.completions.create(
            model=UPSTREAM_MODEL, messages=QUESTION, max_tokens=8, n=2, temperature=1.0, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert len(chunks) >= 4  # relayed chunk by chunk: each choice's role, ..., its end
        assert all(c.logprobs is None for chunk in chunks for c in chunk.choices)  # not asked for: taken out
        text = {i: "".join(c.delta.content or "" for ch in chunks for c in ch.choices if c.index == i) for i in (0, 1)}
        finals = {c.index: c for chunk in chunks for c in chunk.choices if c.finish_reason}
        calls = await episodes.calls(episode.id)
    assert len(calls) == 1 and not calls[0]["text_only"]
    recorded = {c["index"]: c for c in calls[0]["response"]["choices"]}
    for index, final in finals.items():
        sampled = sampled_tokens(final)
        assert recorded[index]["token_ids"] == sampled.completion_ids
        assert recorded[index]["prompt_token_ids"] == sampled.prompt_ids
        assert (recorded[index]["message"]["content"] or "") == text[index]
        assert len(recorded[index]["logprobs"]["content"]) == len(sampled.completion_ids)


async def test_a_text_only_upstream_is_recorded_as_such_and_refused_for_rl(servers):
    async with EpisodeClient(root(servers["hosted"])) as episodes:
        episode = await episodes.create("task-hosted")
        reply = await agent(episode.base_url).chat.completions.create(
            model="hosted-model", messages=QUESTION, max_tokens=6
        )
        assert reply.choices[0].message.content is not None and sampled_tokens(reply.choices[0]) is None
        calls = await episodes.calls(episode.id)
        assert len(calls) == 1 and calls[0]["text_only"] and calls[0]["upstream"].startswith("http://127.0.0.1:")
        await episodes.finish(episode.id, 1.0)
        for refused in (episodes.trajectory(episode.id), episodes.group("task-hosted")):
            with pytest.raises(GatewayError) as conflict:
                await refused
            assert conflict.value.status == 409 and TEXT_ONLY_REASON in str(conflict.value)
        allowed = await episodes.trajectory(episode.id, text_only="allow")
        assert allowed.metadata["text_only"] is True and allowed.reward == 1.0
        assert sampled_tokens(allowed.messages_and_choices[-1]) is None  # no sampled ids to train on
        assert len(await episodes.group("task-hosted", text_only="allow")) == 1


async def test_a_streamed_text_only_call_without_done_is_relayed_and_recorded(servers):
    async with EpisodeClient(root(servers["hosted"])) as episodes:
        episode = await episodes.create("task-hosted-stream")
        stream = await agent(episode.base_url).chat.completions.create(
            model="hosted-model", messages=QUESTION, max_tokens=6, stream=True
        )
        text = "".join(c.delta.content or "" for chunk in [c async for c in stream] for c in chunk.choices)
        calls = await episodes.calls(episode.id)
    assert len(calls) == 1 and calls[0]["text_only"]  # recorded though the stream had no [DONE]
    assert (calls[0]["response"]["choices"][0]["message"]["content"] or "") == text


async def test_the_hosted_stand_in_was_asked_for_ids_once_then_as_the_client_asked(servers):
    app = servers["hosted_app"]
    before = len(app.state.asked)
    async with EpisodeClient(root(servers["hosted"])) as episodes:
        episode = await episodes.create("task-hosted-retry")
        await agent(episode.base_url).chat.completions.create(model="hosted-model", messages=QUESTION, max_tokens=2)
    first, second = app.state.asked[before:]
    assert first["return_token_ids"] is True and first["logprobs"] is True  # what training needs
    assert "return_token_ids" not in second and "logprobs" not in second  # refused: the client's own request
    assert first["authorization"] == second["authorization"] == "Bearer sk-hosted-secret"  # its key, not the agent's


async def test_upstream_errors_pass_through_or_are_502s_never_500s(servers, upstream):
    body = {"model": UPSTREAM_MODEL, "messages": QUESTION, "max_tokens": 0}  # the upstream refuses max_tokens 0
    async with httpx.AsyncClient(timeout=60) as http:
        direct = await http.post(f"{upstream.base_url}/chat/completions", json=body)
        assert direct.status_code == 400
        via = await http.post(f"{servers['vllm_like'].base_url}/chat/completions", json=body)
        assert via.status_code == 400 and via.json() == direct.json()  # as it is
        async with EpisodeClient(root(servers["vllm_like"])) as episodes:
            episode = await episodes.create("task-upstream-400")
            in_episode = await http.post(f"{episode.base_url}/chat/completions", json=body)
            assert in_episode.status_code == 400 and in_episode.json() == direct.json()
            assert await episodes.calls(episode.id) == []

        gone = servers["gone"]
        refused = await http.post(f"{gone.base_url}/chat/completions", json=body | {"max_tokens": 4})
        assert refused.status_code == 502
        error = refused.json()["error"]
        assert "could not be reached" in error["message"] and error["code"] == "upstream_unavailable"
        assert "127.0.0.1:" in error["message"] and "sk-gone-secret" not in refused.text
        models = await http.get(f"{gone.base_url}/models")  # the local list, nothing broken
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [LOCAL_MODEL]

        overloaded = await http.post(
            f"{servers['hosted'].base_url}/chat/completions", json={"model": "overloaded", "messages": QUESTION}
        )
        assert overloaded.status_code == 502 and "overloaded" in overloaded.json()["error"]["message"]
        assert "sk-hosted-secret" not in overloaded.text
        slow = await http.post(
            f"{servers['impatient'].base_url}/chat/completions", json={"model": "slow", "messages": QUESTION}
        )
        assert slow.status_code == 502 and "did not answer within 1 s" in slow.json()["error"]["message"]

        # the episode is checked before the upstream is asked: unknown 404, closed 409, nothing recorded
        unknown = await http.post(f"{root(servers['vllm_like'])}/episodes/ep_nope/v1/chat/completions", json=body)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "episode_not_found"
        async with EpisodeClient(root(servers["vllm_like"])) as episodes:
            await episodes.finish(episode.id, 0.0)
            closed = await http.post(f"{episode.base_url}/chat/completions", json=body | {"max_tokens": 2})
            assert closed.status_code == 409 and await episodes.calls(episode.id) == []


async def test_plain_v1_calls_are_proxied_for_the_openai_sdk(servers):
    client = agent(servers["vllm_like"].base_url)
    names = [m.id async for m in client.models.list()]
    assert names[0] == LOCAL_MODEL and UPSTREAM_MODEL in names  # both, the local engine's first
    reply = await client.chat.completions.create(model=UPSTREAM_MODEL, messages=QUESTION, max_tokens=5)
    assert reply.model == UPSTREAM_MODEL and reply.choices[0].message.content is not None
    streamed = await client.chat.completions.create(model=UPSTREAM_MODEL, messages=QUESTION, max_tokens=5, stream=True)
    assert [c async for c in streamed][-1].choices[0].finish_reason in ("stop", "length")
    local = await client.chat.completions.create(model=LOCAL_MODEL, messages=QUESTION, max_tokens=2)
    assert local.model == LOCAL_MODEL  # answered by the local engine
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # neither serves it
        await client.chat.completions.create(model="nobody-serves-this", messages=QUESTION, max_tokens=2)


def test_flywheel_serve_checks_upstream_before_loading_the_model_and_never_shows_its_key(tmp_path, caplog):
    """In this process (the checks come before the model loads: a process of its own spent seconds importing torch)."""
    missing = str(tmp_path / "no-such-model")  # had serve loaded it first, it would have said so instead
    env = {"FLYWHEEL_HOME": str(tmp_path), "COLUMNS": "200", "FLYWHEEL_UPSTREAM_API_KEY": "sk-cli-secret"}

    def serve(url: str) -> Result:
        run = CliRunner().invoke(app, ["serve", "--model", missing, "--upstream", url], env=env)
        assert run.exception is None or isinstance(run.exception, SystemExit), run.exception  # no traceback
        assert "sk-cli-secret" not in run.output + caplog.text  # output (stdout and stderr) and logs
        return run

    for url, complaint in [
        ("ftp://models.example/v1", "not an http(s) URL"),
        ("http://user:hunter2@models.example/v1", "must not hold credentials"),
    ]:
        run = serve(url)
        assert run.exit_code == 2 and "Invalid --upstream" in run.output and complaint in run.output, run.output
        assert "hunter2" not in run.output + caplog.text and "no-such-model" not in run.output
    accepted = serve("http://models.example/v1")
    assert accepted.exit_code == 2 and "no-such-model" in accepted.output  # the upstream passed; the model is missing


async def test_a_local_call_never_continues_an_upstream_output_with_its_ids(servers):
    """The gateway does not know an upstream's tokenizer: a local call whose history holds an upstream's reply
    renders it from text (counted), rather than splicing in ids that may be another tokenizer's."""
    async with EpisodeClient(root(servers["vllm_like"])) as episodes:
        episode = await episodes.create("task-mixed")
        client = agent(episode.base_url)
        first = await client.chat.completions.create(
            model=UPSTREAM_MODEL, messages=QUESTION, tools=[CALC], max_tokens=150, temperature=0,
            tool_choice={"type": "function", "function": {"name": "calc"}},
        )  # fmt: skip
        assert first.choices[0].finish_reason == "tool_calls"  # a forced call ends with its end-of-turn token
        call = first.choices[0].message.tool_calls[0]
        reply = {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]}
        history = [*QUESTION, reply, {"role": "tool", "tool_call_id": call.id, "content": "84"}]
        await client.chat.completions.create(model=LOCAL_MODEL, messages=history, tools=[CALC], max_tokens=2)
        calls = await episodes.calls(episode.id)
    assert [c["upstream"] is None for c in calls] == [False, True]
    assert calls[1]["prefix_call"] is None and calls[1]["retokenized_turns"] == 1


def vllm_api(upstream: BackgroundServer) -> FastAPI:
    """vLLM's stand-in, as far as log-probs go: the upstream's answers with the prompt's and choices' ids, but without
    the fields vLLM does not send (the temperature its log-probs are at, how it drew, its tokenizer)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        async with httpx.AsyncClient(base_url=upstream.base_url, timeout=120) as http:
            answer = (await http.post("/chat/completions", json=await request.json())).json()
        for choice in answer["choices"]:
            for key in ("temperature", "top_p", "guided", "logprobs_temperature", "tokenizer"):
                choice.pop(key, None)
        return answer

    return app


@pytest.fixture(scope="module")
def vllm_gateways(engine, upstream, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-gateways")
    vllm = BackgroundServer(vllm_api(upstream)).start()
    built = {
        mode: gateway_server(engine, tmp, mode, Upstream(vllm.base_url, logprobs_mode=mode))
        for mode in ("raw_logprobs", "processed_logprobs")
    }
    yield built
    for server in [*built.values(), vllm]:
        server.stop()


async def test_upstream_log_probs_at_another_temperature_than_the_call_are_never_compared_by_tis(
    vllm_gateways, tokenizer
):
    """vLLM's default raw log-probs are T = 1's whatever the request's temperature: a call at T = 0.7 is recorded
    with both, and its tokens carry no sampler log-probs for TIS (weight 1); processed log-probs are at the call's
    temperature, unless top-p truncated them. Issue #37 item 14."""
    found = {}
    for mode, asked in [("raw_logprobs", 0.7), ("raw_logprobs", 1.0), ("processed_logprobs", 0.7)] + [
        ("processed_logprobs", {"temperature": 0.7, "top_p": 0.9})
    ]:
        sampling = asked if isinstance(asked, dict) else {"temperature": asked}
        async with EpisodeClient(root(vllm_gateways[mode])) as episodes:
            episode = await episodes.create(f"task-{mode}")
            await agent(episode.base_url).chat.completions.create(
                model=UPSTREAM_MODEL, messages=QUESTION, max_tokens=6, seed=2, **sampling
            )
            await episodes.finish(episode.id, 1.0)
            (call,) = await episodes.calls(episode.id)
            (sequence,) = trajectory_sequences(await episodes.trajectory(episode.id), tokenizer)
        recorded = call["response"]["choices"][0]
        compared = [not math.isnan(x) for x, on in zip(sequence.sampler_logprobs, sequence.trained) if on]
        found[mode, str(asked)] = (recorded["temperature"], recorded["logprobs_temperature"], set(compared))
    assert found == {
        ("raw_logprobs", "0.7"): (0.7, 1.0, {False}),  # T = 1's log-probs for a T = 0.7 draw: not compared
        ("raw_logprobs", "1.0"): (1.0, 1.0, {True}),
        ("processed_logprobs", "0.7"): (0.7, 0.7, {True}),
        ("processed_logprobs", str({"temperature": 0.7, "top_p": 0.9})): (0.7, None, {False}),  # cut by top-p
    }
