"""Checkpoints and a model's directory (flywheel/checkpoints/): pruning, recovery from what a kill leaves, branches
after a restore, RNG states and the caller's ``extra``, skipped saves, one step at a time, one owner per directory.

What a kill leaves on disk is built by hand in the recovery tests (each state named after the instant it stands
for); tests/test_crash.py kills real runs."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import flywheel as art
from flywheel.checkpoints.layout import (
    ADAPTER_WEIGHTS,
    ASIDE,
    DELETING,
    FULL_WEIGHTS,
    OPTIMIZER,
    RUN,
    STATE,
    TMP,
    model_path,
)
from flywheel.checkpoints.run import CheckpointWriteError, ModelInUseError, RunStore
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.store import Store, deployments
from flywheel.train.checkpoint import Checkpoint, CheckpointState
from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights

SYSTEM = {"role": "system", "content": "You answer with one word."}


def tiny(step: int, rows: list[dict] | None = None, **state) -> Checkpoint:
    """A checkpoint with one small tensor (the format does not care how big the weights are)."""
    return Checkpoint(
        state=CheckpointState(step=step, trained_weights=TrainedWeights(), rows=rows or [], **state),
        weights={"w": torch.full((2,), float(step))},
    )


def with_optimizer(checkpoint: Checkpoint) -> Checkpoint:
    checkpoint.optimizer = {"exp_avg": torch.zeros(4)}
    return checkpoint


def history_with(run: RunStore, values: dict[int, float]) -> None:
    run.append([{"step": s, "split": "val", "val/reward": v} for s, v in values.items()])


def test_delete_checkpoints_keeps_the_best_existing_checkpoint_and_the_latest(tmp_path):
    run = RunStore(model_path(tmp_path, "tests", "m"))
    for step in (1, 2, 3):  # step 0 (the baseline) has a row but no checkpoint
        run.write(tiny(step))
    history_with(run, {0: 0.5, 1: 0.2, 2: 0.45, 3: 0.3})
    assert run.prune("val/reward") == [1]  # the best existing is step 2 (step 0's 0.5 has no checkpoint)
    assert run.steps() == [2, 3]

    low = RunStore(model_path(tmp_path, "tests", "low"))  # lower is better (e.g. a loss)
    for step in (1, 2, 3):
        low.write(tiny(step))
    history_with(low, {0: 0.5, 1: 0.2, 2: 0.45, 3: 0.3})
    assert low.prune("val/reward", maximize=False) == [2]
    assert low.steps() == [1, 3]

    nan = RunStore(model_path(tmp_path, "tests", "nan"))
    for step in (1, 2, 3):
        nan.write(tiny(step))
    history_with(nan, {1: 0.2, 2: float("nan"), 3: 0.1})
    assert nan.prune("val/reward") == [2] and nan.steps() == [1, 3]  # NaN never wins
    assert nan.prune("val/reward", maximize=False) == [1] and nan.steps() == [3]
    assert not [p for p in nan.checkpoints.iterdir() if p.name.startswith(".")]


def test_delete_checkpoints_never_deletes_a_step_a_deployment_serves(tmp_path):
    """ART's ``delete_checkpoints`` on a model the loop deploys: production's step and its rollback step stay (as
    weights); the best by the metric and the latest stay whole."""
    run = RunStore(model_path(tmp_path, "tests", "m"))
    for step in (1, 2, 3, 4, 5):
        run.write(with_optimizer(tiny(step)))
    history_with(run, {1: 0.1, 2: 0.2, 3: 0.9, 4: 0.3, 5: 0.4})
    store = Store(run.db)
    try:
        with store.session() as s:
            deployments.deploy(s, "m@production", 1, actor="test")
            deployments.deploy(s, "m@production", 2, actor="test")  # a rollback goes back to 1
        assert run.prune("val/reward") == [4]
        assert run.steps() == [1, 2, 3, 5]
        assert [(run.checkpoint_dir(k) / OPTIMIZER).exists() for k in run.steps()] == [False, False, True, True]
    finally:
        store.close()


def test_a_checkpoint_commits_its_rows_after_it_is_durable_and_overwrites_by_a_swap(tmp_path):
    run = RunStore(model_path(tmp_path, "tests", "m"))
    row = {"time": 1.5, "step": 1, "split": "train", "loss": 0.25, "checkpoint": True}
    run.write(tiny(1, rows=[row], extra={"position": 17}))
    assert run.history() == [row] and run.state(1).extra == {"position": 17}
    run.write(tiny(1, rows=[]))  # the same step again: the old one is renamed aside, then removed
    assert run.read(1).weights["w"].tolist() == [1.0, 1.0] and run.state(1).extra == {}
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["0001"]


def test_a_state_written_before_the_trained_weights_rename_still_loads(tmp_path):
    """Checkpoints written before ``TrainedWeights`` was named so hold it as ``"lora"``, with ``"full_finetune"``
    instead of ``mode``: they still read, as the kind of weights they hold."""
    run = RunStore(model_path(tmp_path, "tests", "m"))
    for step, full in ((1, False), (2, True)):
        run.write(tiny(step))
        directory = run.checkpoint_dir(step)
        if full:  # what full fine-tuning wrote
            (directory / ADAPTER_WEIGHTS).rename(directory / FULL_WEIGHTS)
        old = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj"], "full_finetune": full}
        (directory / STATE).write_text(json.dumps({"step": step, "rl_steps": 0, "lora": old, "last_split": "train"}))
    lora, full = run.state(1), run.state(2)
    assert lora.trained_weights == TrainedWeights(mode="lora", rank=4, alpha=8, targets=["q_proj"])
    assert full.trained_weights.mode == "full" and full.last_split == "train"
    assert run.read(1, mode="lora").weights["w"].tolist() == [1.0, 1.0]
    assert run.read(2, mode="full").weights["w"].tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="has no adapter_model.safetensors: it was not written by a LoRA adapter"):
        run.read(2, mode="lora")


def test_recover_undoes_what_a_kill_leaves(tmp_path):
    run = RunStore(model_path(tmp_path, "tests", "m"))
    r1 = {"time": 1.0, "step": 1, "split": "train", "checkpoint": True}
    r2 = {"time": 2.0, "step": 2, "split": "train", "checkpoint": True}
    run.write(tiny(1, rows=[r1]))
    run.write(tiny(2, rows=[r2]))
    run.save_trajectories("train", 2, [])
    # killed after checkpoint 3 was durable, before its row was appended
    r3 = {"time": 3.0, "step": 3, "split": "train", "checkpoint": True}
    run.write(tiny(3, rows=[r3]))
    run._rewrite_history([r1, r2])
    # killed in the middle of a swap of step 2: the old one renamed aside, the new one not yet in place
    (run.checkpoint_dir(2)).rename(run.checkpoints / f"{ASIDE}0002-abc")
    # killed while writing step 4 (no row yet), while deleting step 1, and during step 5 (a skipped save's row,
    # its trajectories, then a torn row)
    (run.checkpoints / f"{TMP}0004-xyz").mkdir()
    (run.checkpoints / f"{TMP}0004-xyz" / "model.safetensors").write_bytes(b"half")
    (run.checkpoints / f"{DELETING}0001-q").mkdir()
    (run.checkpoints / ".0004.legacy").mkdir()  # the old trainer's temporary name
    run.append([{"time": 4.0, "step": 4, "split": "train", "checkpoint": False}])
    run.save_trajectories("train", 4, [])
    with (run.path / "history.jsonl").open("a") as f:
        f.write('{"time": 5.0, "step": 5, "spl')

    assert run.history()[-1]["step"] == 4  # a torn last line is not a row
    run.recover()
    assert run.steps() == [1, 2, 3]
    assert run.read(2).weights["w"].tolist() == [2.0, 2.0]
    assert run.history() == [r1, r2, r3]  # step 3's row re-appended from the checkpoint, rows above 3 dropped
    assert (run.path / "history.jsonl").read_text().endswith("\n")
    assert not [p for p in run.checkpoints.iterdir() if p.name.startswith(".")]
    assert sorted(p.name for p in (run.path / "trajectories" / "train").iterdir()) == ["0002.jsonl"]
    run.recover()  # idempotent
    assert run.history() == [r1, r2, r3]


def test_abandon_after_archives_the_later_branch(tmp_path):
    run = RunStore(model_path(tmp_path, "tests", "m"))
    rows = [{"time": float(s), "step": s, "split": "train", "checkpoint": True} for s in (1, 2, 3)]
    for s, row in zip((1, 2, 3), rows):
        run.write(tiny(s, rows=[row]))
        run.save_trajectories("train", s, [])
    val = {"time": 9.0, "step": 1, "split": "val", "val/reward": 0.5}
    run.append([val])
    archive = run.abandon_after(1)
    assert archive is not None and archive.parent == run.path / "abandoned"
    assert run.steps() == [1] and run.history() == [rows[0], val]
    assert sorted(p.name for p in (archive / "checkpoints").iterdir()) == ["0002", "0003"]
    assert [json.loads(line)["step"] for line in (archive / "history.jsonl").read_text().splitlines()] == [2, 3]
    assert sorted(p.name for p in (archive / "trajectories" / "train").iterdir()) == ["0002.jsonl", "0003.jsonl"]
    assert run.abandon_after(1) is None  # nothing above any more


def test_prune_deployed_keeps_the_latest_whole_and_what_deployments_point_or_roll_back_to_as_weights(tmp_path):
    """What ``flywheel loop`` with ``prune: true`` and the demo keep (LocalBackend.prune_checkpoints): read from the
    store's deployments and their audit history."""
    run = RunStore(model_path(tmp_path, "tests", "m"))
    for step in range(1, 9):
        run.write(with_optimizer(tiny(step)))
    store = Store(run.db)
    try:
        with store.session() as s:
            deployments.deploy(s, "m@production", 1, actor="test")
            deployments.deploy(s, "m@canary", 3, actor="test", share=0.5)
            deployments.promote(s, "m", actor="test")  # production 1 -> 3: a rollback goes back to 1
            deployments.remove(s, "m@canary", actor="test")
            deployments.deploy(s, "m@shadow", 2, actor="test", share=0.1)
            deployments.remove(s, "m@shadow", actor="test")  # ended: step 2 is nobody's
            deployments.deploy(s, "m@canary", 5, actor="test", share=0.5)
            deployments.deploy(s, "other@production", 4, actor="test")  # another model's step 4
        assert run.prune_deployed(keep=[6]) == [2, 4, 7]
        assert run.steps() == [1, 3, 5, 6, 8]
        assert [(run.checkpoint_dir(k) / OPTIMIZER).exists() for k in run.steps()] == [False, False, False, True, True]
        assert run.read(1).weights["w"].tolist() == [1.0, 1.0]  # served from its weights alone
        assert run.prune_deployed(rollback=0) == [1, 6]  # no rollback step kept; nothing kept whole but the latest
        assert run.steps() == [3, 5, 8]
        with store.session() as s:  # an alias's rollback steps follow its history replayed, as rollback does
            deployments.promote(s, "m", actor="test", source="canary")  # production 1 -> 3 -> 5
            assert deployments.steps_in_use(s, "m", rollback=2) == {5, 3, 1}
            deployments.deploy(s, "m@production", 3, actor="test", action="rollback")  # back to 3: then to 1
            assert deployments.steps_in_use(s, "m") == {3, 1, 5}
        assert not [p for p in run.checkpoints.iterdir() if p.name.startswith(".")]
    finally:
        store.close()


def test_a_checkpoint_write_on_a_full_disk_is_a_clear_error_and_the_previous_checkpoint_stays_the_latest(
    tmp_path, monkeypatch
):
    """The disk cannot be filled for real here safely, so torch.save is mocked to fail as it does on a full disk: it
    writes part of the file, then raises torch's own message."""
    run = RunStore(model_path(tmp_path, "tests", "m"))
    r1 = {"time": 1.0, "step": 1, "split": "train", "checkpoint": True}
    run.write(with_optimizer(tiny(1, rows=[r1])))

    def full(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\0" * 10)
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1024\nframe #0: c10::ThrowEnforceNotMet"
        )

    monkeypatch.setattr(torch, "save", full)
    r2 = {"time": 2.0, "step": 2, "split": "train", "checkpoint": True}
    with pytest.raises(CheckpointWriteError) as failed:
        run.write(with_optimizer(tiny(2, rows=[r2])))
    message = str(failed.value)
    assert f"Could not write checkpoint step 2 to {run.checkpoint_dir(2)}: RuntimeError: [enforce fail" in message
    assert "The disk looks full: the checkpoint needs about 24 bytes (its tensors)" in message  # 2 + 4 floats
    assert re.search(r"; [\d.]+ (GB|MB|bytes) is free there \(of [\d.]+ (GB|MB|bytes)\)", message), message
    assert "the latest checkpoint is still step 1, where a restart resumes" in message and "frame #0" not in message
    monkeypatch.undo()
    assert run.steps() == [1] and run.history() == [r1]  # nothing of step 2: neither its files nor its row
    assert not [p for p in run.checkpoints.iterdir() if p.name.startswith(".")]
    assert run.read(1).optimizer["exp_avg"].tolist() == [0.0] * 4


def test_recover_removes_the_run_id_temporary_a_kill_left(tmp_path, monkeypatch):
    run = RunStore(model_path(tmp_path, "tests", "m"))
    run.write(tiny(1))
    key = run.key
    leftover = run.path / f"{RUN}-k1ll3d"  # killed between _run_id's mkstemp and its unlink
    leftover.write_text("0123456789abcdef\n")
    run.recover()
    assert not leftover.exists() and RunStore(run.path).key == key

    # a reader making the id while the owner's recover() takes its temporary for a leftover: it makes it again
    fresh = RunStore(model_path(tmp_path, "tests", "fresh"))
    fresh.path.mkdir(parents=True)
    link, raced = os.link, []

    def racing(source, target):  # the race cannot be timed for real: recover() removes the file right here
        if not raced:
            raced.append(source)
            os.unlink(source)
        return link(source, target)

    monkeypatch.setattr(os, "link", racing)
    assert len(fresh.key.run) == 32 and raced
    assert sorted(p.name for p in fresh.path.iterdir()) == [RUN]


# ---- with the real model ---------------------------------------------------------------------------------------


async def sample_groups(model: art.TrainableModel) -> list[art.TrajectoryGroup]:
    """2 groups x 2 short real rollouts; rewards differ inside each group, so every step trains."""
    client = model.openai_client()

    async def rollout(q: str, i: int) -> art.Trajectory:
        messages = [SYSTEM, {"role": "user", "content": q}]
        r = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=6, logprobs=True
        )
        return art.Trajectory(messages_and_choices=[*messages, r.choices[0]], reward=float(i))

    return await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(q, i) for i in range(2)) for q in ("Name a fruit.", "Name a colour.")),
        pbar_desc=None,
    )


def draws() -> tuple[list[float], list[float], list[float]]:
    return [random.random() for _ in range(3)], torch.rand(3).tolist(), np.random.rand(3).tolist()


async def test_restore_then_training_abandons_the_later_branch_and_resume_keeps_rng_and_extra(fresh_backend, tmp_path):
    model = art.TrainableModel(name="branch", project="tests", base_model=EMBEDDED_MODEL)
    await model.register(fresh_backend)
    config = TrainConfig(learning_rate=1e-3)
    for step in (1, 2, 3):
        await model.train(await sample_groups(model), config=config, extra={"position": step * 10})
    assert await model.checkpoint_extra() == {"position": 30}
    await fresh_backend.restore(model, 1)
    assert await model.get_step() == 1 and await model.checkpoint_extra() == {"position": 10}
    run = fresh_backend.run(model)
    assert run.steps() == [1, 2, 3]  # restoring alone abandons nothing (e.g. evaluating an earlier checkpoint)

    await model.train(await sample_groups(model), config=config, extra={"position": 99})  # a new step 2
    expected = draws()  # what the run draws next
    after = fresh_backend.trainer(model).adapter_state()
    assert run.steps() == [1, 2] and run.state(2).extra == {"position": 99}
    assert [(r["step"], r["split"]) for r in run.history()] == [(1, "train"), (2, "train")]
    (archive,) = (tmp_path / "tests" / "models" / "branch" / "abandoned").iterdir()
    assert sorted(p.name for p in (archive / "checkpoints").iterdir()) == ["0002", "0003"]
    await fresh_backend.close()

    draws()  # the process moves on; a resumed run draws again what the run drew after its latest checkpoint
    resumed = art.LocalBackend(path=tmp_path, serve_http=False)
    try:
        again = art.TrainableModel(name="branch", project="tests", base_model=EMBEDDED_MODEL)
        await again.register(resumed)
        assert await again.get_step() == 2 and await again.checkpoint_extra() == {"position": 99}
        assert draws() == expected
        state = resumed.trainer(again).adapter_state()
        assert all(torch.equal(state[k], after[k]) for k in after)
    finally:
        await resumed.close()


async def test_a_skipped_save_writes_its_row_and_a_resume_redoes_the_step(fresh_backend, tmp_path):
    model = art.TrainableModel(name="nosave", project="tests", base_model=EMBEDDED_MODEL)
    await model.register(fresh_backend)
    await model.train(await sample_groups(model), config=TrainConfig(learning_rate=1e-3))
    await model.train(await sample_groups(model), config=TrainConfig(learning_rate=1e-3), save_checkpoint=False)
    run = fresh_backend.run(model)
    assert await model.get_step() == 2 and run.steps() == [1]
    assert [(r["step"], r["checkpoint"]) for r in run.history()] == [(1, True), (2, False)]
    demos = [
        art.Trajectory(
            messages_and_choices=[SYSTEM, {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello"}]
        )
    ] * 2
    await model.train_sft(demos, SFTConfig(learning_rate=1e-4, batch_size=1))  # two steps, one checkpoint at the end
    assert run.steps() == [1, 4] and [(r["step"], r["checkpoint"]) for r in run.history()][2:] == [
        (3, False),
        (4, True),
    ]
    await model.train(await sample_groups(model), config=TrainConfig(learning_rate=1e-3), save_checkpoint=False)
    await fresh_backend.close()
    resumed = art.LocalBackend(path=tmp_path, serve_http=False)
    try:
        again = art.TrainableModel(name="nosave", project="tests", base_model=EMBEDDED_MODEL)
        await again.register(resumed)  # step 5's weights are gone: so is its row (the step will be redone)
        assert await again.get_step() == 4 and [r["step"] for r in resumed.history(again)] == [1, 2, 3, 4]
        assert not (tmp_path / "tests" / "models" / "nosave" / "trajectories" / "train" / "0005.jsonl").exists()
    finally:
        await resumed.close()


async def test_two_concurrent_steps_on_one_model_each_get_their_own_checkpoint(fresh_backend):
    """Full fine-tuning: the widest window (a 1.6 GB checkpoint write) for a second step to run into a save. The
    second caller's step waits until the first one's checkpoint is written."""
    model = art.TrainableModel(
        name="both", project="tests", base_model=EMBEDDED_MODEL, trained_weights=TrainedWeights(mode="full")
    )
    await model.register(fresh_backend)
    first, second = await sample_groups(model), await sample_groups(model)
    config = TrainConfig(learning_rate=1e-5)
    await asyncio.gather(model.train(first, config=config), model.train(second, config=config))
    run = fresh_backend.run(model)
    assert run.steps() == [1, 2]
    assert [r["step"] for r in run.history()] == [1, 2]
    for step in (1, 2):
        checkpoint = run.read(step)
        assert checkpoint.state.step == step
        assert {int(s["step"]) for s in checkpoint.optimizer["state"].values()} == {step}  # AdamW's own count


LOCK_HOLDER = textwrap.dedent("""
    import asyncio, sys
    import flywheel as art
    from flywheel.inference.loading import EMBEDDED_MODEL

    async def main():
        backend = art.LocalBackend(path=sys.argv[1], serve_http=False)
        await art.TrainableModel(name="owned", project="tests", base_model=EMBEDDED_MODEL).register(backend)
        print("registered", flush=True)
        sys.stdin.read()  # until the test closes our stdin
        await backend.close()

    asyncio.run(main())
""")


async def test_one_backend_owns_a_model_directory(tmp_path):
    model = art.TrainableModel(name="owned", project="tests", base_model=EMBEDDED_MODEL)
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "registered"
        other = art.LocalBackend(path=tmp_path, serve_http=False)
        with pytest.raises(ModelInUseError, match=f"in process {holder.pid} has this model registered"):
            await other.register(model)
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
        await other.register(model)  # free once the holder closed (or died)
        trainer = other.trainer(model)
        other.run(model).write(await trainer.engine.call(trainer.checkpoint))  # a checkpoint to evaluate
        data, grader = tmp_path / "data.jsonl", tmp_path / "grader.json"
        data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi."}]}) + "\n")
        grader.write_text(
            json.dumps(
                {
                    "type": "string_check",
                    "name": "hi",
                    "input": "{{sample.output_text}}",
                    "reference": "hi",
                    "operation": "ilike",
                }
            )
        )
        evaluation = subprocess.run(  # `flywheel eval` of a model a run is training: a clear error, no traceback
            [sys.executable, "-m", "flywheel.cli", "eval", "--model", "owned@0", "--data", str(data), "--grader", str(grader), "--home", str(tmp_path)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert evaluation.returncode == 1 and f"in process {os.getpid()} has this model registered" in evaluation.stderr
        assert "Traceback" not in evaluation.stderr
        second = art.LocalBackend(path=tmp_path, serve_http=False)  # a second backend in this very process
        with pytest.raises(
            ModelInUseError, match=rf"in process {os.getpid()} has this model registered \(this process\)"
        ):
            await second.register(model)
        await other.close()
        await second.register(model)
        await second.close()
    finally:
        holder.kill()
        holder.wait()
