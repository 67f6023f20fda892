"""LoRA checkpoints served by vLLM (``flywheel.inference.vllm_adapters``), on the stand-in vLLM server
(``flywheel.testing.vllm_shim``, which loads a peft adapter directory over the real embedded model as vLLM's
``/v1/load_lora_adapter`` does). The checkpoint is a real one: a LocalBackend LoRA model whose B matrices are drawn
off zero, trained one RL step. Flywheel's server, its registry's loader being ``serve --vllm``'s
(``CheckpointAdapters``), serves ``calc@1`` through the shim; the LocalBackend serves the same checkpoint on the
embedded engine, so every answer is compared with the embedded engine's (same seed: same ids).
tests/test_vllm_contract.py loads the same kind of checkpoint into the real vLLM."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from flywheel.gateway.client import EpisodeClient
from flywheel.gateway.recorder import Gateway
from flywheel.inference.engine import EngineClosedError, InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model, resolve_model
from flywheel.inference.registry import ModelRegistry
from flywheel.inference.sampling import SamplingParams
from flywheel.inference.vllm_adapters import AdapterVersions, CheckpointAdapters
from flywheel.inference.vllm_engine import VLLMAdapterError, VLLMPool
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store
from flywheel.testing.vllm_shim import ShimFaults, create_shim
from flywheel.types import sampled_tokens

from helpers import lora_checkpoint, wait_until_healthy

FLYWHEEL = str(Path(sys.executable).parent / "flywheel")  # the console script installed beside this Python

QUESTION = [{"role": "user", "content": "What is 12 * 7?"}]


class Setup:
    """A LoRA checkpoint trained on a LocalBackend (which serves it embedded), the shim over the fp32 base model, a
    pool on the shim and Flywheel's server whose loader loads ``NAME@k`` into the shim."""

    async def start(self, tmp) -> Setup:
        self.home = tmp / "home"
        self.backend = LocalBackend(path=self.home, dtype=torch.float32)
        self.model = TrainableModel(name="calc", project="p", base_model=EMBEDDED_MODEL)
        self.checkpoint = await lora_checkpoint(self.backend, self.model)
        model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=torch.float32)
        self.engine = InferenceEngine(model, tokenizer, prefix_cache_entries=0)
        self.faults = ShimFaults()
        self.shim = BackgroundServer(create_shim(self.engine, "smol", self.faults)).start()
        self.shim_url = self.shim.base_url.removesuffix("/v1")
        self.pool = await VLLMPool([self.shim_url], resolve_model(EMBEDDED_MODEL).path).start()
        self.registry = ModelRegistry(loader=lambda name: self.loader(name))
        self.loader = CheckpointAdapters(self.pool, self.registry, self.home)
        self.registry.add("smol", self.pool.engine())
        app = create_app(self.registry, Gateway(Store(f"sqlite:///{tmp / 'fw.db'}")))
        self.server = BackgroundServer(app).start()
        self.root = self.server.base_url.removesuffix("/v1")
        self.client = openai.AsyncOpenAI(base_url=self.server.base_url, api_key="unused", max_retries=0)
        self.local = openai.AsyncOpenAI(base_url=self.backend.base_url, api_key="unused", max_retries=0)
        return self

    async def close(self) -> None:
        self.server.stop()
        self.shim.stop()
        self.engine.close()
        await self.pool.aclose()
        await self.backend.close()


@pytest.fixture(scope="module")
async def setup(tmp_path_factory):
    s = await Setup().start(tmp_path_factory.mktemp("vllm-adapters"))
    yield s
    await s.close()


def _answer(response) -> tuple[list[int], list[float]]:
    choice = response.choices[0]
    return sampled_tokens(choice).completion_ids, [t.logprob for t in choice.logprobs.content]


async def test_a_lora_checkpoint_on_vllm_answers_as_the_embedded_engine_and_its_calls_name_the_step(setup):
    kwargs = dict(messages=QUESTION, max_tokens=16, temperature=1.0, seed=5, logprobs=True)
    async with EpisodeClient(setup.root) as episodes:
        episode = await episodes.create("task-adapter")
        agent = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
        remote = await agent.chat.completions.create(model="calc@1", **kwargs)  # loads the checkpoint into the shim
        calls = await episodes.calls(episode.id)
    assert [(c["model"], c["step"]) for c in calls] == [("calc@1", 1)]
    embedded = await setup.local.chat.completions.create(model="calc@1", **kwargs)
    ids, logprobs = _answer(remote)
    assert ids == _answer(embedded)[0]
    assert logprobs == pytest.approx(_answer(embedded)[1], abs=1e-3)
    print(
        f"vLLM stand-in vs embedded, calc@1: max log-prob gap {max(abs(a - b) for a, b in zip(logprobs, _answer(embedded)[1])):.2e}"
    )
    base_ids, base_logprobs = _answer(await setup.client.chat.completions.create(model="smol", **kwargs))
    assert base_ids != ids or max(abs(a - b) for a, b in zip(base_logprobs, logprobs)) > 1e-2  # the adapter acts
    # vLLM serves it as the adapter calc@1 (loaded once: a second request is answered by the same view)
    served = httpx.get(f"{setup.shim_url}/v1/models").json()["data"]
    assert [m["id"] for m in served] == ["smol", "calc@1"]
    again = await setup.client.chat.completions.create(model="calc@1", **kwargs)
    assert _answer(again)[0] == ids and setup.registry.get("calc@1").engine is setup.pool.view("calc@1")


async def test_names_that_are_not_lora_checkpoints_here_are_refused_clearly(setup, tmp_path):
    with pytest.raises(openai.NotFoundError, match="calc@9"):  # no checkpoint 9
        await setup.client.chat.completions.create(model="calc@9", messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="nobody@1"):
        await setup.client.chat.completions.create(model="nobody@1", messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.NotFoundError):  # a path is not a model name: nothing outside <home>/*/models/ loads
        await setup.client.chat.completions.create(model="../p/models/calc@1", messages=QUESTION, max_tokens=2)
    other = setup.home / "p" / "models" / "other" / "checkpoints" / "0001"  # a copy of checkpoint 1, then changed
    shutil.copytree(setup.checkpoint, other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "/elsewhere"}))
    with pytest.raises(openai.BadRequestError, match="'other@1' is an adapter of /elsewhere"):
        await setup.client.chat.completions.create(model="other@1", messages=QUESTION, max_tokens=2)
    (other / "adapter_config.json").unlink()  # as a full fine-tuning checkpoint has none
    with pytest.raises(openai.BadRequestError, match="'other@1' is not a LoRA checkpoint"):
        await setup.client.chat.completions.create(model="other@1", messages=QUESTION, max_tokens=2)
    with pytest.raises(VLLMAdapterError, match=rf"{setup.shim_url}.*No adapter found for {tmp_path}"):
        await setup.pool.load_adapter("empty@1", tmp_path)  # vLLM's own refusal, with the server named
    await setup.pool.load_adapter("twice@1", setup.checkpoint)
    await setup.pool.load_adapter("twice@1", setup.checkpoint)  # held from that directory already: kept as it is
    with pytest.raises(VLLMAdapterError, match=f"serves the adapter 'twice@1' from {setup.checkpoint} already"):
        await setup.pool.load_adapter("twice@1", tmp_path)  # never another directory under the same version name
    await setup.pool.unload_adapter("twice@1")
    served = [m["id"] for m in httpx.get(f"{setup.shim_url}/v1/models").json()["data"]]
    assert "twice@1" not in served


async def test_retire_unloads_a_version_only_once_its_request_in_flight_has_finished(setup):
    versions = AdapterVersions(setup.pool)
    old = await versions.publish("v", 1, setup.checkpoint)
    await versions.publish("v", 2, setup.checkpoint)  # the same weights under a new version name
    assert versions.loaded("v") == [1, 2] and old.lora_name == "v@1" and old.step == 1
    prompt = setup.engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, logprobs=True)
    setup.faults.delay_s = 1.0  # the shim answers a second late: the request is in flight meanwhile
    try:
        request = asyncio.create_task(old.generate(prompt, params))
        await asyncio.sleep(0.3)
        assert old.in_flight == 1
        started = time.monotonic()
        assert await versions.retire("v", keep={2}) == [1]
        waited = time.monotonic() - started
    finally:
        setup.faults.delay_s = 0.0
    assert request.done() and request.result()[0].token_ids  # answered by v@1, not refused as unloaded
    assert waited > 0.4 and versions.loaded("v") == [2]
    served = [m["id"] for m in httpx.get(f"{setup.shim_url}/v1/models").json()["data"]]
    assert "v@1" not in served and "v@2" in served
    with pytest.raises(EngineClosedError, match="'v@1' is closed"):
        await old.generate(prompt, params)
    assert (await setup.pool.view("v@2", 2).generate(prompt, params))[0].token_ids
    assert await versions.retire("v", keep=set()) == [2] and versions.loaded("v") == []


async def test_flywheel_serve_vllm_serves_a_run_directorys_lora_checkpoint(setup, tmp_path):
    """The CLI: ``flywheel serve --vllm`` with the LocalBackend's home as its home answers ``calc@1`` through the
    shim (the adapter calc@1 is held there from the same directory already: a restarted server keeps it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        FLYWHEEL, "serve", "--model", "smol", "--port", str(port), "--vllm", setup.shim_url,
        "--vllm-model-dir", str(resolve_model(EMBEDDED_MODEL).path), "--no-fine-tuning",
        "--db", f"sqlite:///{tmp_path / 'serve.db'}",
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "FLYWHEEL_HOME": str(setup.home)}
        )
    try:
        base = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_until_healthy, proc, base, lambda: log.read_text()[-3000:])
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        kwargs = dict(messages=QUESTION, max_tokens=12, temperature=1.0, seed=9, logprobs=True)
        served = await client.chat.completions.create(model="calc@1", **kwargs)
        embedded = await setup.local.chat.completions.create(model="calc@1", **kwargs)
        assert _answer(served)[0] == _answer(embedded)[0]
        assert _answer(served)[1] == pytest.approx(_answer(embedded)[1], abs=1e-3)
        with pytest.raises(openai.NotFoundError, match="calc@4"):
            await client.chat.completions.create(model="calc@4", **kwargs)
    finally:
        proc.terminate()
        proc.wait(30)


async def test_past_max_loaded_the_adapter_loaded_longest_ago_is_unloaded_and_a_request_loads_it_again(setup):
    """``serve --vllm``'s loader keeps its last ``max_loaded`` adapters: loading a third retires the first (no longer
    served, then unloaded from vLLM), and a request for it loads it again (retiring the next oldest)."""
    checkpoints = setup.home / "p" / "models" / "lru" / "checkpoints"
    for step in (1, 2, 3):  # three versions of the same weights
        shutil.copytree(setup.checkpoint, checkpoints / f"{step:04d}")
    registry = ModelRegistry(loader=lambda name: loader(name))
    loader = CheckpointAdapters(setup.pool, registry, setup.home, max_loaded=2)

    def on_vllm() -> set[str]:
        return {m["id"] for m in httpx.get(f"{setup.shim_url}/v1/models").json()["data"]} & {"lru@1", "lru@2", "lru@3"}

    async def settled(expected: set[str]) -> None:  # the unload runs in a thread of its own
        for _ in range(100):
            if on_vllm() == expected:
                return
            await asyncio.sleep(0.1)
        assert on_vllm() == expected

    for name in ("lru@1", "lru@2", "lru@3"):
        await registry.resolve(name)
    await settled({"lru@2", "lru@3"})
    assert {m.name for m in registry.all()} == {"lru@2", "lru@3"} and loader.versions.loaded("lru") == [2, 3]
    again = await registry.resolve("lru@1")  # loaded again; lru@2 is now the oldest
    await settled({"lru@3", "lru@1"})
    assert {m.name for m in registry.all()} == {"lru@3", "lru@1"}
    prompt = setup.engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert (await again.engine.generate(prompt, SamplingParams(max_tokens=4, seed=1)))[0].token_ids
    assert again.step == 1
    with pytest.raises(ValueError, match="max_loaded must be at least 1"):
        CheckpointAdapters(setup.pool, registry, setup.home, max_loaded=0)
