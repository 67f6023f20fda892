"""VLLMBackend (``flywheel.vllm_backend``): a LoRA model trained here and sampled on a vLLM server, the stand-in
(``flywheel.testing.vllm_shim``, the real embedded model under vLLM's HTTP API, which loads each adapter directory
it is given over a fresh copy of the base model, as vLLM's ``/v1/load_lora_adapter`` does). Every request the tests
make goes through the backend's server to the stand-in, so the trainer's ``sampler_logprob_gap`` (vLLM's log-probs
against the trainer's, fp32 on both sides) says whether the served adapter is the trained one."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch
import yaml
from typer.testing import CliRunner

from flywheel.checkpoints.layout import model_path, published_path
from flywheel.checkpoints.run import RunStore
from flywheel.cli import app
from flywheel.gateway.client import EpisodeClient
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.vllm_engine import VLLMAdapterError, VLLMEngine
from flywheel.local.gap_alarm import GapAlarm
from flywheel.model import TrainableModel
from flywheel.pipeline import RolloutPipeline
from flywheel.server.background import BackgroundServer
from flywheel.store import deployments
from flywheel.testing.vllm_shim import ShimFaults, create_shim
from flywheel.train.config import TrainConfig, TrainedWeights
from flywheel.types import Trajectory, TrajectoryGroup
from flywheel.vllm_backend import UnservableModelError, VLLMBackend

PROMPT = [{"role": "user", "content": "Name a fruit."}]
GAP = 1e-3  # nats per token: fp32 on both sides; a stale adapter sits far above it after an update at lr 1e-2


class Shim:
    def __init__(self) -> None:
        model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=torch.float32)
        self.engine = InferenceEngine(model, tokenizer, prefix_cache_entries=0)
        self.faults = ShimFaults()
        self.server = BackgroundServer(create_shim(self.engine, "smol", self.faults)).start()
        self.url = self.server.base_url.removesuffix("/v1")

    def adapters(self) -> dict[str, str]:
        cards = httpx.get(f"{self.url}/v1/models", timeout=60).json()["data"]
        return {m["id"]: m["root"] for m in cards if m["id"] != "smol"}

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture(scope="module")
def shim():
    s = Shim()
    yield s
    s.close()


async def _group(model: TrainableModel) -> TrajectoryGroup:
    """Two answers sampled from ``model``'s name (through vLLM), rewards 0 and 1."""
    client = model.openai_client()
    trajectories = []
    for reward in (0.0, 1.0):
        r = await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=6, temperature=1.0, logprobs=True
        )
        trajectories.append(Trajectory(messages_and_choices=[*PROMPT, r.choices[0]], reward=reward))
    return TrajectoryGroup(trajectories)


async def _step(
    backend: VLLMBackend, model: TrainableModel, save: bool, learning_rate: float = 1e-2
) -> dict[str, float]:
    """One RL step on ``_group``'s two answers."""
    result = await backend.train(model, [await _group(model)], learning_rate=learning_rate, save_checkpoint=save)
    assert result.metrics["skipped"] == 0
    return result.metrics


async def _answered_by(backend: VLLMBackend, model: str) -> tuple[int, list[float]]:
    """The step the gateway recorded for a call to ``model`` and the call's log-probs (seeded)."""
    root = backend.base_url.removesuffix("/v1")
    async with EpisodeClient(root) as episodes:
        episode = await episodes.create("which-version")
        agent = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
        r = await agent.chat.completions.create(
            model=model, messages=PROMPT, max_tokens=6, temperature=1.0, seed=3, logprobs=True
        )
        (call,) = await episodes.calls(episode.id)
    return call["step"], [t.logprob for t in r.choices[0].logprobs.content]


async def test_each_step_is_served_by_vllm_as_a_new_adapter_and_versions_past_the_staleness_bound_are_unloaded(
    shim, tmp_path
):
    backend = VLLMBackend([shim.url], path=tmp_path / "home", dtype=torch.float32, max_staleness_steps=2)
    model = TrainableModel(name="calc", project="p", base_model=EMBEDDED_MODEL)
    try:
        await model.register(backend)
        assert shim.adapters().keys() == {"calc@0"}  # the live weights from the start: no checkpoint, a written adapter
        gaps = []
        for step, save in zip(range(1, 6), (True, False, True, False, True)):
            gaps.append((await _step(backend, model, save))["sampler_logprob_gap"])
            assert backend.registry.get("calc").current_step() == step
            if step == 1:
                with backend.gateway.store.session() as s:
                    deployments.deploy(s, "calc@production", 1, actor="test")
        # each step sampled the version trained the step before (a stale adapter sits near 1 after lr 1e-2)
        assert max(gaps) < GAP, gaps
        held = shim.adapters()
        assert held.keys() == {"calc@1", "calc@3", "calc@4", "calc@5"}  # deployed; the live step and the 2 before
        run = backend.run(model)
        assert held["calc@5"] == str(run.checkpoint_dir(5).resolve())  # a checkpoint's directory, as it is
        written = published_path(backend.path, "p", "calc")
        assert held["calc@4"].startswith(str(written.resolve()))  # step 4 had no checkpoint: an adapter written
        assert [p.name.split("-")[1] for p in written.iterdir()] == ["4"]  # step 0's and 2's removed with them
        step, live = await _answered_by(backend, "calc")
        assert step == 5
        assert (await _answered_by(backend, "calc@5"))[1] == live
        step, deployed = await _answered_by(backend, "calc@production")
        assert step == 1 and deployed != live
        with pytest.raises(openai.NotFoundError, match="calc@2"):  # no checkpoint of step 2: it was not saved
            await model.openai_client().chat.completions.create(model="calc@2", messages=PROMPT, max_tokens=2)

        # back to checkpoint 3, then on: 4 and 5 are another branch, and the new step 4 is served, not the old
        await backend.restore(model, 3)
        assert (await _answered_by(backend, "calc"))[0] == 3
        assert shim.adapters().keys() == {"calc@1", "calc@3"}  # 4 and 5 above it; the deployed step stays
        step, old = await _answered_by(backend, "calc@5")  # still a checkpoint until training goes on: loaded again
        assert step == 5 and old == live and "calc@5" in shim.adapters()
        metrics = await _step(backend, model, save=True)
        assert backend.registry.get("calc").current_step() == 4 and metrics["sampler_logprob_gap"] < GAP
        assert "calc@5" not in shim.adapters()  # abandoned: unloaded before the step
        assert (await _step(backend, model, save=True))["sampler_logprob_gap"] < GAP  # sampled the new step 4
    finally:
        await backend.close()
    assert shim.adapters() == {}  # closed: its versions unloaded, the base model still served
    assert not any(written.iterdir())


async def test_a_restarted_backend_keeps_the_checkpoints_left_on_the_server_and_unloads_the_rest(shim, tmp_path):
    """What a kill -9 mid-run would leave on the vLLM server (the versions of the dead process, one of them an
    adapter written for a step that has no checkpoint: loaded here by hand) is sorted at registration: the checkpoints' stay, the others go, and
    the model's name is served by its latest checkpoint."""
    home = tmp_path / "home"
    model = TrainableModel(name="calc", project="p", base_model=EMBEDDED_MODEL)
    first = VLLMBackend([shim.url], path=home, dtype=torch.float32)
    await model.register(first)
    for save in (True, True):
        await _step(first, model, save)
    checkpoint_1, checkpoint_2 = (first.run(model).checkpoint_dir(s).resolve() for s in (1, 2))
    await first.close()
    orphan = tmp_path / "orphan"  # a dead process's adapter of a step 3 it never checkpointed
    shutil.copytree(checkpoint_2, orphan)
    for name, directory in (("calc@1", checkpoint_1), ("calc@2", checkpoint_2), ("calc@3", orphan)):
        await first.pool.load_adapter(name, directory)
    await first.pool.aclose()

    second = VLLMBackend([shim.url], path=home, dtype=torch.float32, max_staleness_steps=0)
    try:
        await model.register(second)
        assert shim.adapters() == {"calc@2": str(checkpoint_2)}  # 3 unloaded; 1 adopted, then past the bound
        assert (await _answered_by(second, "calc"))[0] == 2
        assert (await _step(second, model, save=False))["sampler_logprob_gap"] < GAP
        assert shim.adapters().keys() == {"calc@3"}
    finally:
        await second.close()


@pytest.mark.timeout(600)
async def test_a_trainer_killed_while_publishing_a_step_restarts_serving_that_step(shim, tmp_path):
    """A training process (tests/vllm_publish_run.py) is killed with SIGKILL while the server loads its step 3 (the
    checkpoint written, the load in flight: held by the stand-in); the load then finishes without it. Started
    again, the backend resumes at checkpoint 3, serves it as the live name, and its next step samples the trained
    weights (the gap of served and trained log-probs as on any step)."""
    home = tmp_path / "home"
    log = (tmp_path / "run.log").open("w")
    script = Path(__file__).parent / "vllm_publish_run.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), shim.url, str(home), "3"], stdout=subprocess.PIPE, stderr=log, text=True
    )
    faults = shim.faults
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # steps 1 and 2 published as usual
            if line.strip() == "trained step=2":
                break
        else:
            pytest.fail(f"the run ended before step 2: {(tmp_path / 'run.log').read_text()[-2000:]}")
        faults.load_requests.clear()
        faults.hold_loads = threading.Event()  # step 3's load waits: the kill lands while it is in flight
        for _ in range(1200):
            if "calc@3" in faults.load_requests:
                break
            await asyncio.sleep(0.1)
        assert "calc@3" in faults.load_requests, faults.load_requests
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        held, faults.hold_loads = faults.hold_loads, None
        if held is not None:
            held.set()  # the dead process's load goes on without it
        if proc.poll() is None:
            proc.kill()
        log.close()
    for _ in range(600):  # the late load: an adapter left on the server by a process that is gone
        if "calc@3" in shim.adapters():
            break
        await asyncio.sleep(0.1)
    assert shim.adapters().keys() >= {"calc@2", "calc@3"}, shim.adapters()

    backend = VLLMBackend([shim.url], path=home, dtype=torch.float32)
    model = TrainableModel(name="calc", project="p", base_model=EMBEDDED_MODEL)
    try:
        await model.register(backend)
        assert await model.get_step() == 3 and backend.registry.get("calc").current_step() == 3
        assert (await _answered_by(backend, "calc"))[0] == 3
        assert (await _step(backend, model, save=True))["sampler_logprob_gap"] < GAP  # served = trained
        assert "calc@4" in shim.adapters()
    finally:
        await backend.close()
    assert shim.adapters() == {}


async def test_a_server_answering_with_other_weights_under_the_live_name_raises_the_gap_alarm(shim, tmp_path):
    """An operator (or a bug) reloads the live version's name from another directory on the vLLM server: the next
    step samples checkpoint 1's weights where the trainer is at step 2. The gap jumps and the step's row says so."""
    backend = VLLMBackend([shim.url], path=tmp_path / "home", dtype=torch.float32)
    model = TrainableModel(name="calc", project="p", base_model=EMBEDDED_MODEL)
    try:
        await model.register(backend)
        for _ in range(2):
            assert (await _step(backend, model, save=True))["sampler_gap_alarm"] == 0.0
        swapped = {"lora_name": "calc@2", "lora_path": str(backend.run(model).checkpoint_dir(1).resolve())}
        httpx.post(f"{shim.url}/v1/unload_lora_adapter", json={"lora_name": "calc@2"}, timeout=120).raise_for_status()
        httpx.post(
            f"{shim.url}/v1/load_lora_adapter", json=swapped, timeout=120
        ).raise_for_status()  # a model copy: seconds
        with pytest.warns(UserWarning, match=r"Model 'calc' step 3: the sampler's log-probs sit .* nats per token"):
            metrics = await _step(backend, model, save=True)
        assert metrics["sampler_gap_alarm"] == 1.0 and metrics["sampler_logprob_gap"] > 0.3
        (row,) = [r for r in backend.history(model) if r["step"] == 3 and r["split"] == "train"]
        assert row["sampler_gap_alarm"] == 1.0
    finally:
        await backend.close()


async def test_a_pipelined_run_samples_the_next_step_on_vllm_while_one_trains_within_the_bound(shim, tmp_path):
    """The asynchronous pipeline on vLLM, one step ahead: the next iteration's rollouts are answered by the version
    before the one training (its adapter kept loaded: max_staleness_steps 1), every group trains within the bound,
    and the stale rollouts, corrected by the importance ratio, stay out of the gap alarm."""
    backend = VLLMBackend([shim.url], path=tmp_path / "home", dtype=torch.float32, max_staleness_steps=1)
    model = TrainableModel(name="piped", project="p", base_model=EMBEDDED_MODEL)

    async def rollouts(i: int) -> list[TrajectoryGroup]:
        return [await _group(model)]

    try:
        await model.register(backend)
        rows = []
        async with RolloutPipeline(rollouts, async_steps=1, stop=4) as pipe:
            async for _, groups in pipe:
                config = TrainConfig(learning_rate=1e-2, max_staleness_steps=1)
                rows.append((await backend.train(model, groups, config, save_checkpoint=False)).metrics)
        assert [r["skipped"] for r in rows] == [0.0] * 4 and all(r["stale_groups"] == 0 for r in rows)
        assert max(r["staleness_max"] for r in rows) == 1  # sampled while the step before trained
        assert not any(r.get("sampler_gap_alarm") for r in rows)  # stale by design: not an alarm
        assert all(r.get("sampler_logprob_gap", 0.0) < GAP for r in rows)  # the live version's rollouts: exact
        assert backend.registry.get("piped").current_step() == 4
    finally:
        await backend.close()


def test_the_gap_alarm_rings_on_a_jump_not_on_a_steady_gap():
    alarm, key = GapAlarm(), ("p", "calc")
    assert not any(alarm.check(key, step, gap) for step, gap in enumerate([0.02, 0.03, 0.02, 0.025, 0.04]))
    with pytest.warns(UserWarning, match="median of the last 5 steps: 0.025"):
        assert alarm.check(key, 6, 0.11)  # above 4x the median and the floor
    assert not alarm.check(key, 7, 0.03)  # the alarm's gap did not raise the norm
    quiet = GapAlarm()
    assert not any(quiet.check(key, step, 0.001) for step in range(5))
    assert not quiet.check(key, 6, 0.03)  # 30x a tiny median, but under the floor: rounding
    with pytest.warns(UserWarning, match="no history"):
        assert GapAlarm().check(key, 1, 0.8)  # a stale adapter from the first step on


def test_flywheel_loop_trains_on_vllm_from_the_command_line(shim, tmp_path):
    """``flywheel loop --vllm``: runners sample the model on vLLM, each step's adapter is loaded into it, the
    candidate meets the base model (served by vLLM too) at the gate; closed, the loop leaves no adapter behind. A
    server that cannot be reached is an error that names it, not a traceback."""
    from test_loop import write_config

    path = write_config(tmp_path)
    config = yaml.safe_load(path.read_text()) | {"steps": 1, "candidate_every": 1, "tasks": "tasks.jsonl"}
    path.write_text(yaml.safe_dump(config))
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1", "question": "Name a colour.", "fail": false}\n')
    home = tmp_path / "home"
    cli = ["loop", str(path), "--home", str(home), "--actor", "ci", "--vllm"]
    result = CliRunner().invoke(app, [*cli, shim.url], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "1 iterations, step 1" in result.output and "loop-agent@production" in result.output
    (row,) = [r for r in RunStore(model_path(home, "tests", "loop-agent")).history() if r["split"] == "train"]
    assert row["sampler_logprob_gap"] < 0.1 and row["sampler_gap_alarm"] == 0.0  # bf16 trainer, fp32 server
    assert shim.adapters() == {}

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = CliRunner().invoke(app, [*cli, closed], env={"COLUMNS": "200"})
    assert result.exit_code == 1 and f"The vLLM server at {closed} did not answer /v1/models" in result.output
    assert "Traceback" not in result.output


async def test_a_full_fine_tuning_model_has_its_weights_reloaded_into_vllm_after_every_step(tmp_path):
    """Full fine-tuning on vLLM: the servers' weights are the model's own after each step (reloaded in place), so
    each step samples the weights the step before trained (the gap at fp32 rounding); its earlier checkpoints and
    the base model are served by embedded engines; a LoRA model cannot share the servers; closed, the servers have
    the base model's weights back. A server without the reload routes is refused, saying which flag it needs."""
    own = Shim()  # its weights change: a stand-in of the test's own
    backend = VLLMBackend([own.url], path=tmp_path / "home", dtype=torch.float32)
    model = TrainableModel(
        name="full", project="p", base_model=EMBEDDED_MODEL, trained_weights=TrainedWeights(mode="full")
    )
    base = {k: v.clone() for k, v in own.engine.model.state_dict().items()}
    try:
        await model.register(backend)
        gaps = []
        for step, save in zip(range(1, 4), (True, False, True)):
            gaps.append((await _step(backend, model, save, learning_rate=1e-4))["sampler_logprob_gap"])
            assert backend.registry.get("full").current_step() == step
        assert max(gaps) < GAP, gaps
        live = backend.registry.get("full@3").engine
        assert isinstance(live, VLLMEngine) and live is backend.registry.get("full").engine
        weight = "model.layers.0.mlp.down_proj.weight"
        trained = backend.trainer(model).engine.model.state_dict()[weight]
        assert torch.equal(own.engine.model.state_dict()[weight], trained)  # the server holds the trained weights
        assert not torch.equal(trained, base[weight])
        step, old = await _answered_by(backend, "full@1")  # an embedded engine of checkpoint 1
        assert step == 1 and old != (await _answered_by(backend, "full"))[1]
        assert isinstance(backend.registry.get("full@1").engine, InferenceEngine)
        assert isinstance(await backend.load(EMBEDDED_MODEL), InferenceEngine)  # the servers are the model's
        lora = TrainableModel(name="adapter", project="p", base_model=EMBEDDED_MODEL)
        with pytest.raises(UnservableModelError, match="hold the fully fine-tuned weights of model 'full'"):
            await backend.register(lora)
    finally:
        await backend.close()
    try:
        assert torch.equal(own.engine.model.state_dict()[weight], base[weight])  # given back
        own.faults.dev_routes = False
        again = VLLMBackend([own.url], path=tmp_path / "other", dtype=torch.float32)
        try:
            with pytest.raises(VLLMAdapterError, match="VLLM_SERVER_DEV_MODE=1"):
                await model.register(again)
        finally:
            await again.close()
    finally:
        own.close()


def test_the_jobs_on_a_vllm_server_that_cannot_be_reached_stop_with_one_message(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    for task in ("calculator", "support"):
        result = CliRunner().invoke(
            app, ["train", "--task", task, "--vllm", closed, "--name", "unreachable"],
            env={"FLYWHEEL_HOME": str(tmp_path), "COLUMNS": "200"},
        )  # fmt: skip
        assert result.exit_code == 1 and f"The vLLM server at {closed} did not answer /v1/models" in result.output
        assert "Traceback" not in result.output


async def test_full_fine_tuning_and_another_base_model_are_refused_with_what_to_do(shim, tmp_path):
    backend = VLLMBackend([shim.url], path=tmp_path / "home", dtype=torch.float32)
    try:
        await backend.load(EMBEDDED_MODEL)  # the base model, answered by vLLM
        client = openai.AsyncOpenAI(base_url=backend.base_url, api_key="unused", max_retries=0)
        r = await client.chat.completions.create(model=EMBEDDED_MODEL, messages=PROMPT, max_tokens=3, logprobs=True)
        assert r.choices[0].logprobs.content and backend.engine(EMBEDDED_MODEL) is backend.pool.engine()
        full = TrainableModel(name="full", project="p", base_model=EMBEDDED_MODEL)
        with pytest.raises(UnservableModelError, match="needs the servers to itself, and this backend already serves"):
            await backend.register(full, TrainedWeights(mode="full"))  # the base model is served on them
        other = tmp_path / "other-base"
        other.mkdir()
        (other / "config.json").write_text("{}")
        stranger = TrainableModel(name="stranger", project="p", base_model=str(other))
        with pytest.raises(ValueError, match=f"'{other}' is {other}, and the vLLM servers of this backend serve"):
            await backend.register(stranger)
    finally:
        await backend.close()
    with pytest.raises(ValueError, match="at least one vLLM server"):
        VLLMBackend("")
