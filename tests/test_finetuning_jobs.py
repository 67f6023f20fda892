"""OpenAI's fine-tuning API served by ``flywheel serve``, driven by the real openai SDK as a script written for
OpenAI drives it (only the base URL changed): files uploaded, supervised jobs created under an OpenAI model name (an
alias of the embedded model), polled to their end, their events and checkpoints listed, their models answering chat
completions; a job cancelled while it runs, one paused and resumed, a server killed mid-job and started again, and
the bad input OpenAI refuses, refused in OpenAI's error shape."""

from __future__ import annotations

import base64
import csv
import io
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import schemathesis
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.store import Store, finetuning
from flywheel.store.db import default_url
from tests.test_cli_commands import FLYWHEEL, env, free_port

from helpers import fuzz_routes, wait_until_healthy

ALIAS = "gpt-4.1-mini-2025-04-14"


def example(a: int, b: int) -> dict:
    return {"messages": [{"role": "system", "content": "Answer with the sum only."},
                         {"role": "user", "content": f"What is {a} + {b}?"},
                         {"role": "assistant", "content": f"Answer: {a + b}"}]}  # fmt: skip


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


class Server:
    """``flywheel serve`` in a process of its own, on a free loopback port, with its home in ``home``."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.proc = subprocess.Popen(
            [FLYWHEEL, "serve", "--port", str(self.port), "--fine-tune-alias", f"{ALIAS}={EMBEDDED_MODEL}",
             "--fine-tune-max-tokens", "24"],
            stdout=subprocess.PIPE, stderr=(home / "server.err").open("a"), text=True, env=env(home),
        )  # fmt: skip
        base = f"http://127.0.0.1:{self.port}"
        wait_until_healthy(self.proc, base, lambda: (home / "server.err").read_text()[-3000:])
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self, sig: int = signal.SIGINT) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("finetuning")


@pytest.fixture(scope="module")
def server(home) -> Iterator[Server]:
    served = Server(home)
    yield served
    served.stop()


def upload(client: openai.OpenAI, rows: list[dict], name: str = "train.jsonl") -> str:
    return client.files.create(file=(name, io.BytesIO(jsonl(rows))), purpose="fine-tune").id


def wait(client: openai.OpenAI, job_id: str, until, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if until(job):
            return job
        assert time.monotonic() < deadline, (job, [e.message for e in client.fine_tuning.jobs.list_events(job_id)])
        time.sleep(0.5)


def failed_in_validation(client: openai.OpenAI, job_id: str):
    """The job, once its files' check failed it (it never reached the queue)."""
    job = wait(client, job_id, lambda j: j.status != "validating_files", timeout=60)
    assert job.status == "failed" and job.finished_at, job
    messages = [e.message for e in events(client, job_id)]
    assert messages[-1] == f"The job failed: {job.error.message}" and "queued" not in " ".join(messages), messages
    return job


def events(client: openai.OpenAI, job_id: str) -> list:
    """Every event of the job, oldest first (the SDK pages through them: newest first, 20 a page)."""
    return list(client.fine_tuning.jobs.list_events(job_id, limit=5))[::-1]


def test_files_are_uploaded_listed_read_back_and_deleted(server: Server):
    client = server.client
    data = jsonl([example(1, 2), example(3, 4)])
    made = client.files.create(file=("sums.jsonl", io.BytesIO(data)), purpose="fine-tune")
    assert made.id.startswith("file-") and made.bytes == len(data) and made.filename == "sums.jsonl"
    assert made.purpose == "fine-tune" and made.status == "processed"
    assert client.files.retrieve(made.id).bytes == len(data)
    assert client.files.content(made.id).content == data
    assert made.id in [f.id for f in client.files.list(purpose="fine-tune")]
    big = jsonl([{"messages": [{"role": "user", "content": "x" * (33 * 2**20)}, {"role": "assistant", "content": "y"}]}])  # fmt: skip
    large = client.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="fine-tune")  # over the 32 MB of a request
    assert large.bytes == len(big) and client.files.delete(large.id).deleted
    assert client.files.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError, match=made.id):
        client.files.retrieve(made.id)
    assert made.id not in [f.id for f in client.files.list()]


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n', "line 2 is not JSON"),
        (jsonl([example(1, 1), {"messages": [{"role": "robot", "content": "x"}]}]), "line 2: messages[0].role"),
        (jsonl([{"prompt": "1+1", "completion": "2"}]), "line 1: it has no 'messages'"),
        (b"\n\n", "no examples"),
        (b"\xff\xfe", "not UTF-8"),
    ],
    ids=["not-json", "bad-role", "no-messages", "empty", "not-utf8"],
)
def test_a_file_that_is_not_fine_tuning_jsonl_is_refused_naming_the_line(server: Server, content: bytes, said: str):
    with pytest.raises(openai.BadRequestError, match=re.escape(said)) as caught:
        server.client.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="fine-tune")
    assert caught.value.body["param"] == "file"


def test_bad_job_requests_get_openai_errors_that_say_what_is_wrong(server: Server):
    client = server.client
    training = upload(client, [example(1, 2)])
    no_assistant = upload(client, [{"messages": [{"role": "user", "content": "hi"}]}])
    jobs = client.fine_tuning.jobs
    with pytest.raises(openai.BadRequestError, match=f"{EMBEDDED_MODEL}.*{ALIAS}") as caught:
        jobs.create(model="gpt-5-nano", training_file=training)
    assert caught.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="file-missing") as caught:
        jobs.create(model=ALIAS, training_file="file-missing")
    assert caught.value.body["param"] == "training_file"
    # an example with nothing to train on: found while the job validates its files, which fails it as OpenAI does
    failed = failed_in_validation(client, jobs.create(model=ALIAS, training_file=training, validation_file=no_assistant).id)  # fmt: skip
    assert failed.error.code == "invalid_validation_file" and failed.error.param == "validation_file"
    assert f"Invalid validation_file ({no_assistant}): line 1 has no assistant message" in failed.error.message
    with pytest.raises(openai.BadRequestError, match="n_epochs"):
        jobs.create(model=ALIAS, training_file=training, method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 0}}})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="dpo"):
        jobs.create(model=ALIAS, training_file=training, method={"type": "dpo", "dpo": {}})
    with pytest.raises(openai.BadRequestError, match="learning_rate"):  # a hyperparameter OpenAI does not have
        jobs.create(model=ALIAS, training_file=training, method={"type": "supervised", "supervised": {"hyperparameters": {"learning_rate": 0.1}}})  # fmt: skip
    with pytest.raises(openai.NotFoundError, match="ftjob-nope"):
        jobs.retrieve("ftjob-nope")
    with pytest.raises(openai.NotFoundError, match="ftjob-nope"):
        jobs.cancel("ftjob-nope")


def test_a_supervised_job_runs_to_a_served_model_behind_a_job_cancelled_while_it_ran(server: Server):
    client = server.client
    training = upload(client, [example(a, b) for a in range(1, 5) for b in range(1, 3)])  # 8 examples
    validation = upload(client, [example(7, 1), example(2, 9)], "valid.jsonl")
    long = client.fine_tuning.jobs.create(
        model=ALIAS, training_file=training,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 50, "batch_size": 1}}},
    )  # fmt: skip
    job = client.fine_tuning.jobs.create(
        model=ALIAS, training_file=training, validation_file=validation, suffix="sums", seed=7,
        metadata={"team": "tests"},
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}}},
    )  # fmt: skip
    assert (
        job.status == "validating_files" and job.model == ALIAS and job.seed == 7 and job.metadata == {"team": "tests"}
    )
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 4
    assert job.method.type == "supervised" and job.fine_tuned_model is None

    # the first job runs (the second waits behind it); cancelled after a step, it stops and the second one runs
    wait(client, long.id, lambda j: j.status == "running")
    deadline = time.monotonic() + 300
    while not any(e.type == "metrics" for e in events(client, long.id)):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert client.fine_tuning.jobs.retrieve(job.id).status == "queued"
    running = client.fine_tuning.jobs.retrieve(long.id)  # 400 steps to go at the pace of its first ones
    assert running.estimated_finish is not None and running.estimated_finish > time.time() + 60
    cancelled = client.fine_tuning.jobs.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.estimated_finish is None
    with pytest.raises(openai.BadRequestError, match="cannot be cancelled"):
        client.fine_tuning.jobs.cancel(long.id)

    done = wait(client, job.id, lambda j: j.status in ("succeeded", "failed", "cancelled"))
    assert done.status == "succeeded", (done.error, [e.message for e in events(client, job.id)])
    assert done.fine_tuned_model.startswith(f"ft:{ALIAS}:flywheel:sums:") and done.finished_at >= done.created_at
    assert done.trained_tokens > 0 and done.error is None
    [results] = done.result_files  # the step metrics, as OpenAI keeps them: step_metrics.csv, base64-encoded
    kept = client.files.retrieve(results)
    assert kept.filename == "step_metrics.csv" and kept.purpose == "fine-tune-results"
    table = list(csv.DictReader(io.StringIO(base64.b64decode(client.files.content(results).content).decode())))
    assert [int(r["step"]) for r in table] == [1, 2, 3, 4] and all(float(r["train_loss"]) > 0 for r in table)
    assert [bool(r["valid_loss"]) for r in table] == [False, True, False, True]  # each epoch's end
    with pytest.raises(openai.BadRequestError, match="fine-tune-results file, not examples"):
        client.fine_tuning.jobs.create(model=ALIAS, training_file=results)
    cancelled = client.fine_tuning.jobs.retrieve(long.id)
    assert cancelled.status == "cancelled" and cancelled.fine_tuned_model is None
    assert "Job cancelled" in [e.message.split(" (")[0] for e in events(client, long.id)]

    said = events(client, job.id)
    messages = [e.message for e in said]
    assert messages[:3] == [f"Validating training file: {training}", f"Validating validation file: {validation}",
                            "Files validated, moving job to queued state"]  # fmt: skip
    assert messages[-1] == "The job has successfully completed" and "Fine-tuning job started" in messages
    steps = [e.data for e in said if e.type == "metrics"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all(s["total_steps"] == 4 for s in steps)
    assert all(s["train_loss"] > 0 for s in steps)

    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert [c.step_number for c in checkpoints] == [4, 2]  # newest first
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{done.fine_tuned_model}@4"
    assert all(c.metrics.valid_loss > 0 and c.metrics.train_loss > 0 for c in checkpoints)
    assert checkpoints[0].metrics.valid_loss < checkpoints[1].metrics.valid_loss  # it learned the format

    for model in (done.fine_tuned_model, checkpoints[1].fine_tuned_model_checkpoint):
        reply = client.chat.completions.create(
            model=model, messages=example(5, 3)["messages"][:2], max_tokens=8, temperature=0
        )
        assert reply.model == model and reply.choices[0].message.content

    assert done.fine_tuned_model in [m.id for m in client.models.list()]
    listed = client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in listed.data] == [job.id] and listed.has_more  # newest first, paged
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"team": "tests"})] == [job.id]


def test_a_job_paused_and_resumed_and_one_whose_server_was_killed_go_on_to_succeed(tmp_path):
    server = Server(tmp_path)
    try:
        client = server.client
        training = upload(client, [example(a, 1) for a in range(1, 7)])
        job = client.fine_tuning.jobs.create(
            model=ALIAS, training_file=training,
            method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3, "batch_size": 3}}},
        )  # fmt: skip
        wait(client, job.id, lambda j: j.status == "running")
        assert client.fine_tuning.jobs.pause(job.id).status == "paused"
        time.sleep(2.0)
        assert client.fine_tuning.jobs.retrieve(job.id).status == "paused"  # it stays paused
        assert client.fine_tuning.jobs.resume(job.id).status == "queued"
        with pytest.raises(openai.BadRequestError, match="only a paused job"):
            client.fine_tuning.jobs.resume(job.id)
        wait(client, job.id, lambda j: len(list(client.fine_tuning.jobs.checkpoints.list(j.id))) >= 1)
        no_assistant = upload(client, [{"messages": [{"role": "user", "content": "hi"}]}])
        server.stop(signal.SIGKILL)  # mid-job: no shutdown at all
        # and a job it had recorded but not yet validated (what a kill between the two leaves in the store)
        store = Store(default_url(tmp_path))
        with store.session() as s:
            left = finetuning.add_job(
                s, model=ALIAS, base_model=EMBEDDED_MODEL, method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0}}},
                training_file=no_assistant, validation_file=None, suffix=None, seed=1, meta={},
            ).id  # fmt: skip
        store.close()
        server = Server(tmp_path)
        done = wait(server.client, job.id, lambda j: j.status in ("succeeded", "failed", "cancelled"))
        assert done.status == "succeeded", done.error
        validated = failed_in_validation(server.client, left)  # validated by the restarted server, not lost
        assert (
            validated.error.code == "invalid_training_file"
            and "line 1 has no assistant message" in validated.error.message
        )
        messages = [e.message for e in events(server.client, job.id)]
        assert "Job paused (its training stops at the next step)" in messages and "Job resumed: queued" in messages
        assert "The server restarted: the job resumes from its last checkpoint" in messages
        checkpoints = list(server.client.fine_tuning.jobs.checkpoints.list(job.id))
        assert [c.step_number for c in checkpoints] == [6, 4, 2]  # one per epoch, none lost, none twice
        reply = server.client.chat.completions.create(
            model=done.fine_tuned_model, messages=example(5, 3)["messages"][:2], max_tokens=8, temperature=0
        )
        assert reply.choices[0].message.content
    finally:
        server.stop()


GRADER = {
    "type": "multi", "name": "sum", "calculate_output": "0.5 * exact + 0.5 * number",
    "graders": {
        "exact": {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                  "reference": "Answer: {{item.answer}}", "operation": "eq"},
        "number": {"type": "python", "name": "number",
                   "source": "def grade(sample, item):\n    return float(item['answer'] in sample['output_text'])\n"},
    },
}  # fmt: skip


def question(a: int, b: int) -> dict:
    return {"messages": example(a, b)["messages"][:2], "answer": str(a + b)}


# a gate that passes whatever the 135M model learns in two steps: 2 rows are enough, any lift above -1, no safety
# sub-grader needed, any cost (the default policy holds: 20 rows, a lift above +0.02, a safety grader)
LENIENT = {"min_items": 2, "min_lift": -1.0, "require_safety": False,
           "max_increase": {"tokens": 100.0, "tool_calls": 100.0, "latency_ms": 100.0}}  # fmt: skip


# GRADER with a length score beside it: rewards that vary within every group, so each step trains (with GRADER alone
# the 135M model's answers may all score 0, no step trains and the gate has no trained checkpoint to judge)
VARIED = GRADER | {
    "calculate_output": "0.4 * exact + 0.4 * number + 0.2 * length",
    "graders": GRADER["graders"] | {"length": {"type": "python", "name": "length", "source":
        "def grade(sample, item):\n    return min(1.0, len(sample['output_text']) / 60)\n"}},
}  # fmt: skip


def test_a_reinforcement_job_grades_its_answers_trains_and_ends_through_the_gate(server: Server, home: Path):
    client = server.client
    training = upload(client, [question(a, 2) for a in range(1, 5)], "rft-train.jsonl")
    validation = upload(client, [question(6, 1), question(3, 5)], "rft-valid.jsonl")
    hyper = {"n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.5, "eval_interval": 1, "eval_samples": 1,
             "reasoning_effort": "low"}  # fmt: skip
    job = client.fine_tuning.jobs.create(
        model=ALIAS, training_file=training, validation_file=validation, suffix="rft",
        method={"type": "reinforcement", "reinforcement": {"grader": VARIED, "hyperparameters": hyper}},
        metadata={"flywheel_gate": "production", "flywheel_gate_policy": json.dumps(LENIENT)},
    )  # fmt: skip
    assert job.method.type == "reinforcement" and job.method.reinforcement.grader.type == "multi"
    done = wait(client, job.id, lambda j: j.status in ("succeeded", "failed", "cancelled"))
    said = events(client, job.id)
    assert done.status == "succeeded", (done.error, [e.message for e in said])
    assert any(e.level == "warn" and "reasoning_effort" in e.message for e in said)
    steps = [e.data for e in said if e.type == "metrics"]
    assert [s["step"] for s in steps] == [1, 2] and all(0 <= s["train_reward_mean"] <= 1 for s in steps)
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert len(checkpoints) == 2 and all(0 <= c.metrics.valid_reward_mean <= 1 for c in checkpoints)
    reply = client.chat.completions.create(
        model=done.fine_tuned_model, messages=question(2, 2)["messages"], max_tokens=8
    )
    assert reply.model == done.fine_tuned_model
    # the best checkpoint went through the gate against the base model and, passing, is what @production serves
    gated = [e for e in said if "gate_event" in (e.data or {})]
    assert len(gated) == 1 and gated[0].data["promote"], [e.message for e in said]
    trained = [c for c in checkpoints if not c.fine_tuned_model_checkpoint.endswith("@0")]  # @0: no step trained
    best = max(trained, key=lambda c: (c.metrics.valid_reward_mean, c.step_number))
    assert f"The gate passed {best.fine_tuned_model_checkpoint}: lift" in gated[0].message
    production = f"{done.fine_tuned_model}@production"
    assert gated[0].data["deployment"] == production
    reply = client.chat.completions.create(model=production, messages=question(2, 2)["messages"], max_tokens=8)
    assert reply.model == production and reply.choices[0].message.content
    shown = CliRunner().invoke(
        app, ["audit", "--subject", production], env={"FLYWHEEL_HOME": str(home), "COLUMNS": "300"}
    )
    assert shown.exit_code == 0 and "deploy" in shown.output and "passed the gate" in shown.output, shown.output


def test_a_reinforcement_job_answers_in_its_response_format(server: Server):
    """The job's response_format guides every answer (the 135M model never writes this JSON unguided): the grader,
    which scores 1 only for an object with a short string ``answer``, gives every answer 1."""
    client = server.client
    training = upload(client, [question(1, 2), question(2, 3)], "rft-json.jsonl")
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 3}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    is_json = {"type": "python", "name": "json", "source": "import json\ndef grade(sample, item):\n"
               "    return float(isinstance(json.loads(sample['output_text'])['answer'], str))\n"}  # fmt: skip
    job = client.fine_tuning.jobs.create(
        model=ALIAS, training_file=training,
        method={"type": "reinforcement", "reinforcement": {
            "grader": is_json, "response_format": {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}},
            "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5}}},
    )  # fmt: skip
    done = wait(client, job.id, lambda j: j.status in ("succeeded", "failed", "cancelled"))
    said = events(client, job.id)
    assert done.status == "succeeded", (done.error, [e.message for e in said])
    assert [e.data["train_reward_mean"] for e in said if e.type == "metrics"] == [1.0]
    assert not any("response_format" in e.message for e in said)  # applied, so no warning
    with pytest.raises(openai.BadRequestError, match="response_format is not a chat response_format") as caught:
        client.fine_tuning.jobs.create(model=ALIAS, training_file=training, method={"type": "reinforcement",
            "reinforcement": {"grader": is_json, "response_format": {"type": "xml"}}})  # fmt: skip
    assert caught.value.body["param"] == "method.reinforcement.response_format"


def test_a_reinforcement_job_that_trained_no_step_serves_its_checkpoints_and_does_not_ask_the_gate(server: Server):
    """A grader no answer can satisfy: every group ties, no step trains; its checkpoint (the base weights, ``@0``) is
    served all the same, and the gate is not asked to judge weights no step changed."""
    client = server.client
    training = upload(client, [question(1, 2), question(2, 3)], "rft-never.jsonl")
    never = {"type": "string_check", "name": "never", "input": "{{sample.output_text}}", "reference": "\u0000",
             "operation": "eq"}  # fmt: skip
    job = client.fine_tuning.jobs.create(
        model=ALIAS, training_file=training, validation_file=training,
        method={"type": "reinforcement", "reinforcement": {"grader": never, "hyperparameters": {"batch_size": 2, "compute_multiplier": 0.5, "eval_samples": 1}}},
        metadata={"flywheel_gate": "production"},
    )  # fmt: skip
    done = wait(client, job.id, lambda j: j.status in ("succeeded", "failed", "cancelled"))
    said = events(client, job.id)
    assert done.status == "succeeded", (done.error, [e.message for e in said])
    [checkpoint] = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoint.fine_tuned_model_checkpoint == f"{done.fine_tuned_model}@0"
    reply = client.chat.completions.create(model=checkpoint.fine_tuned_model_checkpoint, messages=question(2, 2)["messages"], max_tokens=4)  # fmt: skip
    assert reply.choices[0].message.content is not None
    assert any(e.message.startswith("The gate was not asked: no step of the job changed the weights") for e in said)


def test_a_reinforcement_job_with_a_bad_grader_or_data_it_cannot_grade_is_refused(server: Server):
    client = server.client
    training = upload(client, [question(1, 2)])
    no_answer = upload(client, [{"messages": question(1, 1)["messages"]}])
    jobs = client.fine_tuning.jobs
    unknown = {"type": "reinforcement", "reinforcement": {"grader": {"type": "regex_check", "name": "r"}}}
    with pytest.raises(openai.BadRequestError, match="regex_check") as caught:
        jobs.create(model=ALIAS, training_file=training, method=unknown)
    assert caught.value.body["param"] == "method.reinforcement.grader"
    good = {"type": "reinforcement", "reinforcement": {"grader": GRADER}}
    failed = failed_in_validation(client, jobs.create(model=ALIAS, training_file=training, validation_file=no_answer, method=good).id)  # fmt: skip
    assert failed.error.code == "invalid_validation_file" and failed.error.param == "validation_file"
    assert "line 1 has no 'answer', which the grader reads ({{item.answer}})" in failed.error.message
    with pytest.raises(openai.BadRequestError, match="a reinforcement job with a validation_file") as caught:
        jobs.create(model=ALIAS, training_file=training, method=good, metadata={"flywheel_gate": "production"})
    assert caught.value.body["param"] == "metadata"
    with pytest.raises(openai.BadRequestError, match="min_items: Input should be greater than or equal to 2"):
        jobs.create(model=ALIAS, training_file=training, validation_file=training, method=good,
                    metadata={"flywheel_gate": "production", "flywheel_gate_policy": '{"min_items": 1}'})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="'Production' is not a stage"):
        jobs.create(model=ALIAS, training_file=training, validation_file=training, method=good,
                    metadata={"flywheel_gate": "Production"})  # fmt: skip


def test_flywheel_jobs_drives_the_api_from_the_command_line(server: Server, tmp_path):
    url = str(server.client.base_url)
    cli = CliRunner()

    def flywheel(*args: str) -> str:
        result = cli.invoke(app, ["jobs", *args, "--url", url], env={"COLUMNS": "250"})
        assert result.exit_code == 0, result.output
        return result.output

    path = tmp_path / "train.jsonl"
    path.write_bytes(jsonl([example(a, 3) for a in range(1, 4)]))
    file_id = flywheel("upload", str(path)).split()[0]
    assert file_id.startswith("file-")
    body = {"model": ALIAS, "training_file": file_id, "suffix": "cli",
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 3}}}}  # fmt: skip
    made = flywheel("create", json.dumps(body))
    job_id = re.search(r"ftjob-\w+", made).group(0)
    assert job_id in flywheel("list") and "supervised" in made
    done = wait(server.client, job_id, lambda j: j.status in ("succeeded", "failed", "cancelled"))
    assert done.status == "succeeded" and done.fine_tuned_model in flywheel("get", job_id)
    assert "The job has successfully completed" in flywheel("events", job_id)
    assert f"{done.fine_tuned_model}@1" in flywheel("checkpoints", job_id)
    refused = cli.invoke(app, ["jobs", "cancel", job_id, "--url", url])
    assert refused.exit_code == 2 and "400: " in refused.output and "cannot be cancelled" in refused.output
    assert "Traceback" not in refused.output
    (bad := tmp_path / "bad.json").write_text("{nope")
    refused = cli.invoke(app, ["jobs", "create", str(bad), "--url", url])
    assert refused.exit_code == 2 and "not JSON" in refused.output
    gone = cli.invoke(app, ["jobs", "list", "--url", f"http://127.0.0.1:{free_port()}/v1"])
    assert gone.exit_code == 2 and "cannot reach" in gone.output and "Traceback" not in gone.output


def test_the_openai_rft_example_runs_unchanged_against_the_server(server: Server):
    """examples/openai_rft/rft.py, a plain OpenAI script, with only the environment's base URL pointing here."""
    script = Path(__file__).parents[1] / "examples" / "openai_rft" / "rft.py"
    run = subprocess.run(
        [sys.executable, str(script), "--train-rows", "4", "--valid-rows", "2"], capture_output=True, text=True,
        timeout=600, env={**env(server.home), "OPENAI_BASE_URL": str(server.client.base_url), "OPENAI_API_KEY": "x"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "The job has successfully completed" in run.stdout
    assert re.search(r"validation reward [\d.]+ -> [\d.]+: it (rose|did not rise)", run.stdout), run.stdout
    assert "ft:gpt-4.1-mini-2025-04-14:flywheel:sums:" in run.stdout
    # every job's model this server made still answers, though only the two latest stay loaded (MAX_MODELS)
    made = [m.id for m in server.client.models.list() if m.id.startswith("ft:")]
    assert len(made) >= 4, made
    for model in made:
        reply = server.client.chat.completions.create(model=model, messages=question(1, 1)["messages"], max_tokens=4)
        assert reply.model == model and reply.choices[0].message.content is not None


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_the_fine_tuning_api_answers_whatever_it_is_sent_without_a_server_error(server: Server, mode):
    """Schemathesis sends each files, fine-tuning and graders route what the server's own OpenAPI schema allows
    (positive) and what it does not (negative): the answer is never a 5xx, and a 4xx is OpenAI's error shape."""
    base = str(server.client.base_url).removesuffix("/v1/")
    called, routes = fuzz_routes(base, r"^/v1/(files|fine_tuning)", mode)
    assert routes >= 14  # files (5), jobs (8), graders (2)
    # every route was reached; negative cases exist only where a schema forbids something (a body, a query)
    assert len(called) >= (routes if mode == schemathesis.GenerationMode.POSITIVE else 6), sorted(called)
