"""ART-style code run through ``import flywheel as art`` (issue #26: every item but W&B logging, item 9, which is
tests/test_wandb.py; and ``art.guided_completion``).

Each test is written the way an ART script writes it: ``art.TrainConfig``, ``from flywheel.local import
LocalBackend`` (ART: ``from art.local import LocalBackend``), ``art.utils``' helpers, ``art.dev`` settings,
``@art.retry``, ``trajectory.track_duration``, ``backend.train(model, groups, learning_rate=...)`` and
``model.log(groups, metrics=result.metrics, step=result.step)``. Only the last test loads a model of its own (and
trains it for two short steps); the others need no model or use the session's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import random
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

import flywheel as art
from flywheel.guided_completion import get_guided_completion_params
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local import LocalBackend as ARTLocalBackend
from flywheel.local.backend import LocalBackend
from flywheel.train.config import TrainedWeights
from flywheel.types import sampled_tokens
from flywheel.utils import iterate_dataset, limit_concurrency


def _warnings(make) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in caught]


def test_train_config_has_arts_fields_and_defaults_and_warns_once_per_unused_field():
    assert art.TrainConfig().learning_rate == 5e-6 and art.TrainConfig().beta == 0.0  # ART's defaults
    assert _warnings(lambda: art.TrainConfig(learning_rate=1e-5, beta=0.01, kl_penalty_coef=0.0)) == []
    first = _warnings(lambda: art.TrainConfig(kl_penalty_coef=0.2, art_compat_unknown=1))
    assert len(first) == 2
    assert any("kl_penalty_coef=0.2" in m and "beta" in m for m in first)
    assert any("art_compat_unknown" in m and "not a Flywheel training setting" in m for m in first)
    assert _warnings(lambda: art.TrainConfig(kl_penalty_coef=0.3, art_compat_unknown=2)) == []  # once per process
    assert "art_compat_unknown" not in art.TrainConfig(art_compat_unknown=3).model_dump()  # dropped, not kept

    from flywheel.examples.calculator.train import JobConfig

    job = JobConfig()  # the main job sets its own rates: ART's default does not change it
    assert [rl.learning_rate for rl in (job.rl, job.with_lora().rl)] == [1e-5, 1e-4]
    assert all("learning_rate" in rl.model_fields_set for rl in (job.rl, job.with_lora().rl))


def test_dev_settings_map_what_means_something_here_and_name_the_rest():
    internal = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=8192, model_name="ignored-as-base_model"),
        engine_args=art.dev.EngineArgs(gpu_memory_utilization=0.7),
        peft_args={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    )
    notices = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights = art.dev.trained_weights(internal, TrainedWeights())
        config = art.dev.train_config(
            art.TrainConfig(learning_rate=1e-5),
            art.dev.TrainConfig(epsilon=0.3, truncated_importance_sampling=3.0, importance_sampling_level="sequence"),
        )
        art.dev.train_config(None, {"precalculate_logprobs": True})
        notices = [str(w.message) for w in caught]
    assert (weights.rank, weights.alpha, weights.targets, weights.mode) == (4, 8, ["q_proj", "v_proj"], "lora")
    full = art.dev.trained_weights({"init_args": {"full_finetuning": True}}, weights)
    assert full.mode == "full"
    assert (config.learning_rate, config.epsilon, config.importance_sampling_cap, config.loss) == (
        1e-5,
        0.3,
        3.0,
        "gspo",
    )
    assert len(notices) == 3 and all("has no effect on Flywheel's engine" in n for n in notices)
    assert any("max_seq_length=8192" in n for n in notices) and any("gpu_memory_utilization" in n for n in notices)
    assert any("precalculate_logprobs=True" in n for n in notices)


async def test_utils_iterate_dataset_retry_and_limit_concurrency_behave_as_arts():
    data = list(range(7))
    batches = list(iterate_dataset(data, groups_per_step=3, num_epochs=2, use_tqdm=False))
    assert [b.step for b in batches] == list(range(6)) and [b.epoch for b in batches] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):  # ART's order: each epoch shuffled after random.seed(epoch)
        order = list(range(7))
        random.seed(epoch)
        random.shuffle(order)
        assert [i for b in batches if b.epoch == epoch for i in b.items] == order
    items, epoch, step, epoch_step = batches[4]  # ART's earlier tuple form
    assert (epoch, step, epoch_step) == (1, 4, 1) and items == batches[4].items
    resumed = list(iterate_dataset(data, groups_per_step=3, num_epochs=2, initial_step=4, use_tqdm=False))
    assert resumed == batches[4:]

    calls, retried = [], []

    @art.retry(max_attempts=3, delay=0.001, exceptions=(ConnectionError,), on_retry=lambda e, n: retried.append(n))
    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("transient")
        return "ok"

    assert await flaky() == "ok" and retried == [1, 2]

    @art.retry(max_attempts=2, delay=0.001)
    def always_fails() -> None:
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken"):
        always_fails()

    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    @limit_concurrency(2, derive_key=lambda key: key)
    async def work(key: str) -> None:
        running[key] = running.get(key, 0) + 1
        peak[key] = max(peak.get(key, 0), running[key])
        await asyncio.sleep(0.01)
        running[key] -= 1

    await asyncio.gather(*(work(k) for k in "aaaaabb"))
    assert peak == {"a": 2, "b": 2}


async def test_trajectories_groups_and_gather_take_arts_arguments(capsys: pytest.CaptureFixture[str]):
    async def rollout(i: int) -> art.Trajectory:
        trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": f"#{i}"}], reward=i)
        async with trajectory.track_duration("env"):
            await asyncio.sleep(0.001)
        trajectory.log(f"rollout {i}")
        return trajectory.finish()

    async def pair(i: int) -> list[art.Trajectory]:  # e.g. both players of a game
        return [await rollout(i), await rollout(i + 1)]

    async def fails() -> art.Trajectory:
        raise ConnectionError("judge unreachable")

    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([pair(0), rollout(5)], metadata={"scenario": "s1"}, metrics={"n": 2}, logs=["g"])],
        pbar_desc="art",
        max_metrics=1,
        pbar_total_completion_tokens=True,
    )
    (group,) = groups
    assert [t.reward for t in group] == [0, 1, 5]
    assert (group.metadata, group.metrics, group.logs) == ({"scenario": "s1"}, {"n": 2}, ["g"])
    assert all(t.metrics["env_duration"] > 0 and "duration" in t.metrics for t in group)
    bar = capsys.readouterr().err.split("\r")[-1]
    assert "completion_tokens=0" in bar and "env_duration=" in bar and bar.count("duration=") == 1  # max_metrics=1
    # the start time finish() measures from is not part of a trajectory's value: a JSON round trip is equal
    assert art.Trajectory.model_validate_json(group.trajectories[0].model_dump_json()) == group.trajectories[0]
    logged = group.trajectories[2].for_logging()
    assert logged["logs"] == ["rollout 5"] and logged["messages"] == [
        {"role": "user", "content": "#5", "trainable": False}
    ]

    results = await art.gather_trajectories([rollout(1), fails(), pair(2)], pbar_desc=None, max_exceptions=1)
    assert isinstance(results[0], art.Trajectory) and isinstance(results[1], ConnectionError)
    assert [t.reward for t in results[2]] == [2, 3]  # type: ignore[union-attr]
    with pytest.raises(ConnectionError):
        await art.gather_trajectories([fails()], pbar_desc=None)


async def test_a_hosted_model_out_of_reach_fails_in_place_naming_the_service(caplog: pytest.LogCaptureFixture):
    """ART's scripts benchmark hosted models (OpenAI, OpenRouter) next to the trained one, with max_exceptions: with
    no network each rollout fails in place, and the warning says which service was called, not just "Connection
    error."; past max_exceptions, the error raised says it (here a closed port on 127.0.0.1 stands for a host that
    cannot be reached)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    hosted = art.Model(
        name="gpt-4.1", project="art-compat", inference_base_url=f"http://127.0.0.1:{port}/v1", inference_api_key="k"
    )

    async def rollout(model: art.Model) -> art.Trajectory:
        messages: art.Messages = [{"role": "user", "content": "What is 1 + 2?"}]
        client = model.openai_client().with_options(max_retries=0)
        response = await client.chat.completions.create(model=model.get_inference_name(), messages=messages)
        turns: art.MessagesAndChoices = [*messages, response.choices[0]]
        return art.Trajectory(messages_and_choices=turns, reward=1.0)

    with caplog.at_level(logging.WARNING, logger="flywheel.gather"):
        (failed,) = await art.gather_trajectories([rollout(hosted)], pbar_desc=None, max_exceptions=1)
    assert isinstance(failed, openai.APIConnectionError)
    assert f"calling POST http://127.0.0.1:{port}/v1/chat/completions" in caplog.text
    # over the budget (ART's default, max_exceptions=0), the error ends the gather and its traceback names the service
    with pytest.raises(openai.APIConnectionError) as ended:
        await art.gather_trajectories([rollout(hosted)], pbar_desc=None)
    assert ended.value.__notes__ == [f"the rollout failed calling POST http://127.0.0.1:{port}/v1/chat/completions"]
    with pytest.raises(openai.APIConnectionError) as ended, art.gather.set_gather_context(art.gather.GatherContext()):
        await art.gather.wrap_group_awaitable(rollout(hosted))  # ART's self-play: a gather of the script's own
    assert ended.value.__notes__ == [f"the rollout failed calling POST http://127.0.0.1:{port}/v1/chat/completions"]
    assert {"Messages", "MessagesAndChoices", "Tools"} <= set(dir(art))  # ART's type names, at the top level


async def test_the_models_client_retries_a_transient_server_error_as_arts_does():
    """A busy server's 503 is retried by ``model.openai_client()`` (the SDK's retries, as ART's client has them), so
    one transient error does not end a gather with ART's default ``max_exceptions=0``. The server is a real one on
    127.0.0.1 that answers 503 to the first request and a completion to the next."""
    answer = _teacher({"content": "3"}).model_dump_json().encode()
    answered: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")
        )
        await reader.readexactly(length)
        status, body = (503, b'{"error": {"message": "busy"}}') if not answered else (200, answer)
        answered.append(status)
        writer.write(
            f"HTTP/1.1 {status} -\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    hosted = art.Model(
        name="gpt-4.1", project="art-compat", inference_base_url=f"http://127.0.0.1:{port}/v1", inference_api_key="k"
    )

    async def rollout() -> art.Trajectory:
        messages: art.Messages = [{"role": "user", "content": "What is 1 + 2?"}]
        response = await hosted.openai_client().chat.completions.create(model="gpt-4.1", messages=messages)
        return art.Trajectory(messages_and_choices=[*messages, response.choices[0]], reward=1.0)

    async with server:
        (trajectory,) = await art.gather_trajectories([rollout()], pbar_desc=None)
    assert answered == [503, 200] and trajectory.messages()[-1]["content"] == "3"  # type: ignore[union-attr]


def test_a_rollout_sampling_through_litellm_keeps_its_choices_with_arts_helper(monkeypatch: pytest.MonkeyPatch):
    """ART's email agent samples with ``litellm.acompletion`` and appends
    ``art.utils.litellm.convert_litellm_choice_to_openai(response.choices[0])`` to its trajectory (here LiteLLM's
    own answer types, as acompletion returns them, without a model)."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of LiteLLM's price list
    from litellm.types.utils import ChatCompletionMessageToolCall, Choices, Function, Message

    from flywheel.utils.litellm import convert_litellm_choice_to_openai

    messages: art.Messages = [{"role": "user", "content": "Find the e-mail about the budget."}]
    call = ChatCompletionMessageToolCall(id="c1", type="function", function=Function(name="search", arguments="{}"))
    trajectory = art.Trajectory(messages_and_choices=messages, reward=1.0)
    for choice in (
        Choices(finish_reason="tool_calls", index=0, message=Message(role="assistant", tool_calls=[call])),
        Choices(finish_reason="stop", index=0, message=Message(role="assistant", content="It is from Ken.")),
    ):
        trajectory.messages_and_choices.append(convert_litellm_choice_to_openai(choice))
    tool_turn, answer = trajectory.messages()[1:]
    assert tool_turn["tool_calls"][0]["function"] == {"name": "search", "arguments": "{}"}
    assert answer == {"role": "assistant", "content": "It is from Ken."}
    with pytest.raises(ValueError, match="assistant turn"):
        convert_litellm_choice_to_openai(Choices(message=Message(role="user", content="hi")))


async def test_a_gather_of_the_scripts_own_counts_on_arts_gather_context(capsys: pytest.CaptureFixture[str]):
    """A two-player game's rollout returns both players' trajectories; the script gathers them itself and groups
    them by position, through ``flywheel.gather``'s GatherContext (ART: ``from art.gather import ...``)."""
    from tqdm import tqdm

    from flywheel.gather import GatherContext, set_gather_context, wrap_group_awaitable

    async def game(i: int) -> tuple[art.Trajectory, art.Trajectory]:
        if i == 3:
            raise ConnectionError("the opponent's service is down")
        x = art.Trajectory(messages_and_choices=[], reward=i % 2, metrics={"win": i % 2})
        return x, art.Trajectory(messages_and_choices=[], reward=1 - i % 2, metrics={"win": 1 - i % 2})

    context = GatherContext(max_exceptions=1, max_metrics=1)
    with set_gather_context(context):
        future = asyncio.gather(*(wrap_group_awaitable(game(i)) for i in range(4)))
        context.pbar = tqdm(desc="by index", total=8)  # set before awaiting, as ART's scripts do
        pairs = await future
    context.pbar.close()
    assert pairs[3] is None and context.exceptions == 1
    x_group, o_group = (art.TrajectoryGroup(p[k] for p in pairs if p is not None) for k in (0, 1))
    assert [t.reward for t in x_group] == [0, 1, 0] and [t.reward for t in o_group] == [1, 0, 1]
    bar = capsys.readouterr().err.split("\r")[-1]
    assert "6/8" in bar and "reward=0.5" in bar and "win=" not in bar and "exceptions=1" in bar
    context.max_exceptions = 0
    with set_gather_context(context), pytest.raises(ConnectionError):
        await wrap_group_awaitable(game(3))


def test_trainable_model_takes_a_config_of_the_scripts_own_and_arts_private_settings():
    class AgentConfig(BaseModel):
        max_turns: int = 3

    model = art.TrainableModel[AgentConfig](
        name="m",
        project="p",
        entity="team",
        base_model=EMBEDDED_MODEL,
        config=AgentConfig(max_turns=5),
        _internal_config=art.dev.InternalModelConfig(peft_args={"r": 16}),
    )
    assert isinstance(model, art.TrainableModel) and model.config is not None and model.config.max_turns == 5
    assert model.entity == "team" and model._internal_config == {"peft_args": {"r": 16}}
    assert model.model_dump()["config"] == {"max_turns": 5}
    with pytest.raises(ValueError, match="config must be a pydantic model"):
        art.TrainableModel(name="m", project="p", base_model=EMBEDDED_MODEL, config={"max_turns": 5})
    with pytest.raises(RuntimeError, match="not registered"):
        model.backend()


async def test_model_backend_client_and_litellm_params_as_arts(backend: LocalBackend, model: art.TrainableModel):
    assert model.backend() is backend and model.base_path == str(backend.path)
    client = model.openai_client()
    assert model.openai_client() is client  # one client, not one per call
    assert client.max_retries == 2 and client.timeout.read == 1200  # type: ignore[union-attr]
    params = model.litellm_completion_params(step=0)
    assert params["model"] == f"openai/{model.name}@0" and params["api_base"] == backend.base_url
    assert ARTLocalBackend is LocalBackend is art.LocalBackend


async def test_a_prompted_model_is_a_baseline_logged_like_a_trained_one(backend: LocalBackend):
    """ART's benchmark scripts log a prompted model (any OpenAI-compatible endpoint) next to the trained ones."""
    baseline = art.Model(
        name="prompted-baseline",
        project="art-compat",
        inference_model_name=EMBEDDED_MODEL,  # here: the base model as served; in ART scripts e.g. gpt-4.1
        inference_base_url=backend.base_url,
        inference_api_key="unused",
    )
    await baseline.register(backend)
    assert baseline.backend() is backend and await baseline.get_step() == 0
    messages = [{"role": "user", "content": "Say hi."}]
    response = await baseline.openai_client().chat.completions.create(
        model=baseline.get_inference_name(), messages=messages, max_tokens=4
    )
    trajectory = art.Trajectory(messages_and_choices=[*messages, response.choices[0]], reward=0.5)
    await baseline.log([trajectory, ConnectionError("one rollout failed")], split="val")
    (row,) = backend.run(baseline).history()
    assert (row["step"], row["split"], row["val/reward"], row["val/exceptions"]) == (0, "val", 0.5, 1)


async def test_capture_auto_trajectory_records_the_calls_a_block_made(backend: LocalBackend):
    model = art.Model(name=EMBEDDED_MODEL, project="art-compat", inference_base_url=backend.base_url)
    streamed: list[str] = []

    async def agent() -> None:  # an agent with no trajectory code: plain openai SDK calls
        client = model.openai_client()
        messages = [{"role": "user", "content": "Count to three."}]
        first = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=4)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Again."},
        ]
        stream = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=4, stream=True)
        streamed.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
        aside = [{"role": "user", "content": "Summarise: one two three."}]  # another conversation (a sub-agent)
        await client.chat.completions.create(model=model.name, messages=aside, max_tokens=3)
        art.auto_trajectory(required=True).reward = 1.0  # e.g. a verifier's verdict

    trajectory = await art.capture_auto_trajectory(agent())
    assert trajectory.reward == 1.0 and "duration" in trajectory.metrics
    assert [m["role"] for m in trajectory.messages()] == ["user", "assistant", "user", "assistant"]
    sampled = [c for c in trajectory.messages_and_choices if not isinstance(c, dict)]
    assert len(sampled) == 2 and all(sampled_tokens(c) is not None for c in sampled)  # exact ids, streamed too
    assert (trajectory.messages()[3]["content"] or "") == streamed[0]  # the SDK still read the whole stream
    (aside,) = trajectory.additional_histories
    assert aside.messages()[0]["content"].startswith("Summarise") and len(aside.messages_and_choices) == 2
    assert art.auto_trajectory() is None
    with pytest.raises(RuntimeError, match="outside capture_auto_trajectory"):
        art.auto_trajectory(required=True)


MOVE = {
    "type": "function",
    "function": {
        "name": "move",
        "parameters": {
            "type": "object",
            "properties": {
                "square": {"type": "string", "enum": ["A1", "A2", "B1", "B2"]},
                "threats": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 8}, "maxItems": 2},
            },
            "required": ["square", "threats"],
        },
    },
}
RESIGN = {"type": "function", "function": {"name": "resign", "parameters": {"type": "object"}}}


def _teacher(message: dict) -> ChatCompletion:
    """A completion as a hosted teacher (ART's example: o4-mini) returns it."""
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "stop"}
    return ChatCompletion.model_validate(
        {"id": "t", "object": "chat.completion", "created": 0, "model": "o4-mini", "choices": [choice]}
    )


async def test_guided_completion_makes_the_student_reply_as_its_teacher(model):
    """ART's self-play distillation: a teacher's completion -> get_guided_completion_params -> the student's call
    (ART: ``from art.guided_completion import get_guided_completion_params``)."""
    client, name = model.openai_client(), model.get_inference_name()
    messages = [{"role": "user", "content": "Your move in tic-tac-toe?"}]
    teacher = _teacher({"content": "B2, the centre."})
    guided_choice, tool_choice, tool_params = get_guided_completion_params(teacher)
    assert guided_choice == ["B2, the centre."] and tool_choice is None and tool_params is None
    student = await client.chat.completions.create(
        model=name, messages=messages, temperature=1.0, extra_body={"guided_choice": guided_choice}
    )
    assert student.choices[0].message.content == "B2, the centre."

    arguments = {"square": "B1", "threats": [3]}
    call = {"id": "c1", "type": "function", "function": {"name": "move", "arguments": json.dumps(arguments)}}
    teacher = _teacher({"content": None, "tool_calls": [call]})
    guided_choice, tool_choice, tool_params = art.guided_completion.get_guided_completion_params(
        teacher, base_tools=[RESIGN, MOVE]
    )
    assert guided_choice is None and tool_choice == {"type": "function", "function": {"name": "move"}}
    student = await client.chat.completions.create(
        model=name, messages=messages, tools=tool_params, tool_choice=tool_choice, temperature=1.0
    )
    (student_call,) = student.choices[0].message.tool_calls
    assert student_call.function.name == "move" and json.loads(student_call.function.arguments) == arguments
    assert MOVE["function"]["parameters"]["required"] == ["square", "threats"]  # the tool given is not changed

    with pytest.raises(ValueError, match="pass the tools it was offered"):
        get_guided_completion_params(teacher)
    with pytest.raises(ValueError, match="'move', which is not one of base_tools"):
        get_guided_completion_params(teacher, base_tools=[RESIGN])
    with pytest.raises(ValueError, match="neither text nor a tool call"):
        get_guided_completion_params(_teacher({"content": None}))


async def test_local_backend_takes_arts_arguments(tmp_path: Path):
    notices = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local = ARTLocalBackend(in_process=False, path=str(tmp_path))
        notices = [str(w.message) for w in caught]
    assert local.path == tmp_path and any("in_process=False" in n for n in notices)
    await local.close()


async def test_checkpoint_sync_says_what_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    local = ARTLocalBackend(path=tmp_path)
    never_trained = art.Model(name="nothing-yet", project="art-compat")
    monkeypatch.delenv("BACKUP_BUCKET", raising=False)
    with pytest.raises(ValueError, match="BACKUP_BUCKET"):
        await local._experimental_push_to_s3(never_trained)
    with pytest.raises(FileNotFoundError, match="nothing to push"):
        await local._experimental_push_to_s3(never_trained, s3_bucket=f"file://{tmp_path / 'bucket'}")
    # ART's scripts pull before register on every start, the first one too: an empty bucket is not an error
    monkeypatch.setenv("BACKUP_BUCKET", f"file://{tmp_path / 'bucket'}")
    await local._experimental_pull_from_s3(never_trained, verbose=True)
    assert "nothing to pull yet" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="has no checkpoint 'latest'"):  # a checkpoint asked for by name
        await local._experimental_pull_from_s3(never_trained, only_step="latest")
    if importlib.util.find_spec("s3fs") is None:  # a bucket name is S3's: without s3fs, an error that names it
        with pytest.raises(ImportError, match="s3fs"):
            await local._experimental_pull_from_s3(never_trained, s3_bucket="my-bucket")
    await local.close()


def test_arts_trajectories_module_is_ours():
    """``from art.trajectories import TrajectoryGroup`` (ART's self-play ``train_o4_mini.py``): the same classes."""
    from flywheel.trajectories import MetadataValue, PydanticException, Trajectory, TrajectoryGroup

    assert (Trajectory, TrajectoryGroup) == (art.Trajectory, art.TrajectoryGroup)
    assert art.trajectories.PydanticException is PydanticException and MetadataValue is not None


async def test_deploying_to_together_names_the_service_and_what_to_do_instead(tmp_path: Path):
    """ART's ``backend._experimental_deploy`` (to Together's hosted inference) takes ART's arguments and fails with
    an error that names the service it would need, not an AttributeError."""
    import inspect

    local = ARTLocalBackend(path=tmp_path)
    assert list(inspect.signature(local._experimental_deploy).parameters) == [
        *("deploy_to", "model", "step", "s3_bucket", "prefix", "verbose", "pull_s3", "wait_for_completion")
    ]
    model = art.TrainableModel(name="m", project="art-compat", base_model=EMBEDDED_MODEL)
    with pytest.raises(NotImplementedError, match="Together AI's hosted LoRA inference") as refused:
        await local._experimental_deploy("together", model, step=3, s3_bucket="bucket", wait_for_completion=False)
    message = str(refused.value)
    assert "https://api.together.xyz" in message and "S3 bucket" in message
    assert "model='m@3'" in message and "`flywheel deploy m@production --step 3`" in message
    await local.close()


async def test_trajectory_group_batches_yields_batches_as_groups_finish(capsys: pytest.CaptureFixture[str]):
    """``art.trajectory_group_batches`` (ART's SWE-bench notebook): groups run with at most ``batch_size *
    max_concurrent_batches`` in flight and come out in batches in the order they finish; ``skip_batches`` groups
    never run; failures count against a budget per batch; a caller that stops early stops what still runs."""
    started: list[int] = []
    running = 0
    peak = 0

    async def rollout(g: int, seconds: float = 0.001, fail: bool = False) -> art.Trajectory:
        nonlocal running, peak
        started.append(g)
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(seconds)
        finally:
            running -= 1
        if fail:
            raise ConnectionError("the sandbox is unreachable")
        return art.Trajectory(messages_and_choices=[], reward=g)

    async def made_later(g: int) -> art.TrajectoryGroup:  # an awaitable that makes its group
        return await art.TrajectoryGroup([rollout(g)])

    groups = [art.TrajectoryGroup([rollout(g, 0.3 if g == 2 else 0.001)]) for g in range(6)] + [made_later(6)]
    batches = [
        [[t.reward for t in group] for group in batch]
        async for batch in art.trajectory_group_batches(groups, batch_size=2, max_concurrent_batches=1, skip_batches=1)
    ]
    assert batches == [[[3], [4]], [[5], [6]], [[2]]]  # group 2 is slow: it ends the last batch
    assert sorted(started) == [2, 3, 4, 5, 6] and peak == 2
    assert "batches: 100%" in capsys.readouterr().err

    async def run(groups: list, **options) -> list[list[art.TrajectoryGroup]]:
        return [b async for b in art.trajectory_group_batches(groups, pbar_desc=None, **options)]

    async def broken() -> art.TrajectoryGroup:
        raise ConnectionError("the scenario service is unreachable")

    (batch,) = await run(
        [art.TrajectoryGroup([rollout(1), rollout(1, fail=True)]), art.TrajectoryGroup([rollout(2)])],
        batch_size=2,
        max_batch_exceptions=1,
    )
    by_reward = {group.trajectories[0].reward: group for group in batch}  # in the order they finished
    assert [e.message for e in by_reward[1].exceptions] == ["the sandbox is unreachable"] and len(by_reward[1]) == 1
    ((only,),) = await run([broken(), art.TrajectoryGroup([rollout(3)])], batch_size=2, max_batch_exceptions=0.5)
    assert [t.reward for t in only] == [3]  # the group that could not be made is left out
    budget_per_batch = [art.TrajectoryGroup([rollout(g), rollout(g, fail=True)]) for g in (1, 2)]
    assert len(await run(budget_per_batch, batch_size=1, max_batch_exceptions=1, max_concurrent_batches=1)) == 2
    with pytest.raises(ConnectionError, match="sandbox"):
        await run([art.TrajectoryGroup([rollout(1, fail=True)])], batch_size=1)

    started.clear()
    slow = [art.TrajectoryGroup([rollout(g, 0.001 if g == 0 else 30)]) for g in range(4)]
    async with contextlib.aclosing(art.trajectory_group_batches(slow, batch_size=1, max_concurrent_batches=2)) as it:
        first = await anext(it)
    assert [t.reward for t in first[0]] == [0] and sorted(started) == [0, 1] and running == 0  # group 1 stopped


def test_a_script_that_never_closes_its_backend_exits_without_a_traceback(tmp_path: Path):
    """ART's example scripts end without ``backend.close()``: the server is stopped at interpreter exit, when no new
    thread can start, and its shutdown (the gateway's queue written first) must not print a traceback."""
    script = (
        "import sys\n"
        "from flywheel.local import LocalBackend\n"
        "backend = LocalBackend(path=sys.argv[1])\n"
        "backend._serve()  # the HTTP server and gateway that register() starts, without loading a model\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


class GameConfig(BaseModel):
    max_turns: int = 2


async def test_an_art_style_multi_turn_game_trains_with_both_entry_points(
    backend: LocalBackend, capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    """A two-turn number game in ART's style; step 1 through ``model.train(config, _config, verbose)``, step 2
    through ``backend.train(..., learning_rate=...)`` and ``model.log(..., metrics=, step=)``; then its directory
    goes to a bucket (a ``file://`` one) and comes back on another backend, as ART's checkpoint sync does."""
    model = art.TrainableModel(
        name="art-game",
        project="art-compat",
        base_model=EMBEDDED_MODEL,
        config=GameConfig(),
        _internal_config=art.dev.InternalModelConfig(peft_args={"r": 4}),
    )
    await model.register(backend)

    @art.retry(max_attempts=2, delay=0.01)
    async def rollout(model: art.TrainableModel[GameConfig], scenario: str, index: int) -> art.Trajectory:
        client = model.openai_client()
        trajectory = art.Trajectory(
            messages_and_choices=[{"role": "system", "content": "Guess the secret number between 1 and 9."}],
            reward=0.0,
            metadata={"scenario": scenario},
        )
        assert model.config is not None
        for turn in range(model.config.max_turns):
            trajectory.messages_and_choices.append({"role": "user", "content": f"Turn {turn + 1}: your guess?"})
            async with trajectory.track_duration("llm"):
                response = await client.chat.completions.create(
                    model=model.get_inference_name(), messages=trajectory.messages(), max_tokens=6, temperature=1.0
                )
            trajectory.messages_and_choices.append(response.choices[0])
        answer = trajectory.messages()[-1]["content"] or ""
        trajectory.reward = float("7" in answer) + 0.01 * index  # the index breaks ties: every group trains
        trajectory.log(f"guessed {answer!r}")
        return trajectory.finish()

    steps = []
    for batch in iterate_dataset(["game"], groups_per_step=1, num_epochs=2, use_tqdm=False):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, s, i) for i in range(3)) for s in batch.items), pbar_desc=None
        )
        if batch.step == 0:  # with a None where RULER (swallow_exceptions=True) could not score a group: left out
            with pytest.warns(UserWarning, match="1 of the 2 groups given to train are None"):
                await model.train(
                    [*groups, None],
                    config=art.TrainConfig(learning_rate=1e-4),
                    _config=art.dev.TrainConfig(epsilon=0.2),
                    verbose=True,
                )
            steps.append(await model.get_step())
        else:
            result = await backend.train(model, groups, learning_rate=1e-4)
            assert isinstance(result, art.TrainResult) and result.metrics["skipped"] == 0
            await model.log(groups, split="train", metrics=result.metrics, step=result.step)
            steps.append(result.step)
    assert steps == [1, 2] and "art-game step 1:" in capsys.readouterr().out
    validation = await art.gather_trajectories((rollout(model, "val", i) for i in range(2)), pbar_desc=None)
    await model.log(validation)
    run = backend.run(model)
    rows = run.history()
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (2, "train"), (2, "train"), (2, "val")]
    assert rows[2]["train/loss"] == rows[1]["loss"]  # model.log's row carries backend.train's metrics
    # both steps trained (not skipped), at the rate each entry point was given; _config and _internal_config applied
    assert [(r["skipped"], r["learning_rate"]) for r in rows[:2]] == [(0, 1e-4), (0, 1e-4)]
    first = run.state(1)
    assert (first.last_config["epsilon"], first.trained_weights.rank) == (0.2, 4)
    trained = (run.path / "trajectories" / "train" / "0002.jsonl").read_text().splitlines()
    assert len(trained) == 3  # model.log did not write backend.train's trajectories a second time
    assert all(json.loads(line)["metrics"]["llm_duration"] > 0 for line in trained)
    assert await model.delete_checkpoints() == [1]  # keeps the latest and the best by val/reward

    bucket = f"file://{tmp_path / 'bucket'}"
    await backend._experimental_push_to_s3(model, s3_bucket=bucket, prefix="runs")
    pushed = tmp_path / "bucket" / "runs" / "art-compat" / "models" / "art-game"
    assert (pushed / "history.jsonl").read_text() == (run.path / "history.jsonl").read_text()
    assert (pushed / "checkpoints" / "0002").is_dir() and not (pushed / ".lock").exists()
    with pytest.raises(RuntimeError, match="before register"):
        await backend._experimental_pull_from_s3(model, s3_bucket=bucket, prefix="runs")
    elsewhere = ARTLocalBackend(path=tmp_path / "elsewhere")
    await elsewhere._experimental_pull_from_s3(model, s3_bucket=bucket, prefix="runs", only_step="latest")
    assert elsewhere.run(model).steps() == [2] and elsewhere.run(model).history() == rows
    await elsewhere.close()
