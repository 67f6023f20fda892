"""Data-parallel replicas (``flywheel.train.data_parallel``): two processes on gloo, each a replica of a tiny random
Llama, rank 0 leading and rank 1 following, train an RL step (two epochs: two optimizer steps) and an SFT step on a
batch packed into micro-batches the ranks share unequally, and end with the weights, and report the metrics, of one
process training the whole batch alone (fp32, to summation order), LoRA and full fine-tuning; and a LocalBackend on
rank 0 drives a training script with a restore in it, the other rank following."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_rl_update import rollouts
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import flywheel as art
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model, resolve_model
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights
from flywheel.train.data_parallel import Replicas, share
from flywheel.train.trainer import Trainer

# summation order differs (threads, the ranks' split): Adam turns it into ~1e-5 on weights whose gradients are near 0;
# a step that went wrong (a gradient averaged, not summed; a rank left out) moves weights by ~1e-3 (lr 1e-3)
RL = TrainConfig(learning_rate=1e-3, epochs=2, micro_batch_tokens=192)
SFT = SFTConfig(learning_rate=1e-3, batch_size=12, micro_batch_tokens=192)  # one step on the 12
COMPARED = ["loss", "entropy", "grad_norm", "tokens_trained", "micro_batches", "is_ratio_mean", "sampler_logprob_gap"]


def tiny_llama(directory: Path) -> Path:
    """A random 2-layer Llama with the embedded model's tokenizer, saved as a checkpoint directory."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_MODEL).path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.random.fork_rng():  # the test process's random state stays as later tests expect it
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def train(trainer: Trainer, groups: list[art.TrajectoryGroup]) -> dict:
    rl = trainer.rl_step(groups, RL)
    (sft,) = trainer.sft([t for g in groups for t in g.trajectories], SFT)
    return {"rl": rl, "sft": sft, "weights": {k: v.clone() for k, v in trainer._master_state().items()}}


def new_trainer(model_dir: Path, mode: str, seed: int = 0) -> Trainer:
    """A trainer on the tiny model; ``seed``: its LoRA adapter's initialisation (drawn from a forked generator: the
    test process's own random state, which later tests sample with, is left as it was)."""
    model, tokenizer, _ = load_model(str(model_dir), dtype=torch.float32)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Trainer(InferenceEngine(model, tokenizer), TrainedWeights(mode=mode))


def replica(rank: int, world: int, model_dir: Path, mode: str, groups_file: Path, init: Path, out: Path) -> None:
    """Rank 0 trains (its trainer leads every call); the others follow it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    trainer = new_trainer(model_dir, mode, seed=rank)  # rank 1's adapter starts elsewhere: replicate() syncs it
    replicas = Replicas()
    try:
        if rank == 0:
            trainer.replicate(replicas)
            result = train(
                trainer, [art.TrajectoryGroup.model_validate(g) for g in json.loads(groups_file.read_text())]
            )
            replicas.stop()
        else:
            replicas.follow(trainer)
            result = {"weights": {k: v.clone() for k, v in trainer._master_state().items()}}
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        trainer.engine.close()
        dist.destroy_process_group()


async def drive(backend: LocalBackend, model_dir: Path, groups: list[art.TrajectoryGroup]) -> dict:
    """A training script on a backend: two steps (the second without a checkpoint), back to step 1, one more."""
    model = TrainableModel(name="dp", project="p", base_model=str(model_dir))
    try:
        with torch.random.fork_rng():  # the process's random state is left as it was for later tests
            torch.manual_seed(0)  # the adapter's initialisation, as the single process draws it
            await model.register(backend)
        losses = [(await backend.train(model, groups, RL)).metrics["loss"]]
        losses.append((await backend.train(model, groups, RL, save_checkpoint=False)).metrics["loss"])
        await backend.restore(model, 1)
        losses.append((await backend.train(model, groups, RL)).metrics["loss"])
        weights = {k: v.clone() for k, v in backend.trainer(model)._master_state().items()}
        return {"losses": losses, "step": await model.get_step(), "weights": weights}
    finally:
        await backend.close()


def backend_rank(rank: int, world: int, model_dir: Path, groups_file: Path, init: Path, out: Path) -> None:
    """Rank 0 runs ``drive`` on ``LocalBackend(replicas=...)``; the others follow with a trainer of their own."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        if rank == 0:
            groups = [art.TrajectoryGroup.model_validate(g) for g in json.loads(groups_file.read_text())]
            backend = LocalBackend(path=out / "home", serve_http=False, dtype=torch.float32, replicas=Replicas())
            result = asyncio.run(drive(backend, model_dir, groups))
        else:
            trainer = new_trainer(model_dir, "lora", seed=rank)
            try:
                Replicas().follow(trainer)
                result = {"weights": {k: v.clone() for k, v in trainer._master_state().items()}}
            finally:
                trainer.engine.close()
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def groups(model_dir) -> list[art.TrajectoryGroup]:
    """Rollouts sampled from the tiny model (with their log-probs), rewards that differ within each group."""
    model, tokenizer, _ = load_model(str(model_dir), dtype=torch.float32)
    engine = InferenceEngine(model, tokenizer)
    try:
        out = []
        for i, question in enumerate(["Name three fruits.", "Name a colour and an animal.", "Count to five."]):
            trajectories = asyncio.run(rollouts(engine, question, 4, 1.0, seed=i))
            for j, t in enumerate(trajectories):
                t.reward = float(j % 2)
            out.append(art.TrajectoryGroup(trajectories))
        return out
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_replicas_on_gloo_take_the_step_one_process_takes_on_the_whole_batch(model_dir, groups, mode, tmp_path):
    alone = new_trainer(model_dir, mode)
    try:
        single = train(alone, groups)
    finally:
        alone.engine.close()
    assert single["rl"]["micro_batches"] == 3 and single["rl"]["optimizer_steps"] == 2  # 2 ranks: shares of 2 and 1
    groups_file = tmp_path / "groups.json"
    groups_file.write_text(json.dumps([g.model_dump(mode="json") for g in groups]))
    mp.start_processes(
        replica, args=(2, model_dir, mode, groups_file, tmp_path / "init", tmp_path), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, weight in single["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name  # replicas stay equal
        torch.testing.assert_close(ranks[0]["weights"][name], weight, rtol=1e-4, atol=2e-5, msg=name)
    moved = sum(float((w - ranks[0]["weights"][n]).abs().max()) for n, w in new_trainer_state(model_dir, mode).items())
    assert moved > 1e-4  # the steps changed the weights: the comparison above has something to compare
    for key in COMPARED:  # rank 0's metrics are the whole batch's
        assert ranks[0]["rl"][key] == pytest.approx(single["rl"][key], rel=1e-5, abs=1e-7), key
    assert ranks[0]["sft"]["loss"] == pytest.approx(single["sft"]["loss"], rel=1e-5)
    assert ranks[0]["sft"]["grad_norm"] == pytest.approx(single["sft"]["grad_norm"], rel=1e-5)


def test_a_backend_on_rank_0_trains_restores_and_trains_on_with_a_follower_as_one_process_would(
    model_dir, groups, tmp_path
):
    """``LocalBackend(replicas=...)`` drives: its steps, a restore (the checkpoint pickled to the follower) and a step
    after it run on both ranks; the follower ends with rank 0's weights, and both with one process's."""
    alone = asyncio.run(
        drive(LocalBackend(path=tmp_path / "alone", serve_http=False, dtype=torch.float32), model_dir, groups)
    )
    groups_file = tmp_path / "groups.json"
    groups_file.write_text(json.dumps([g.model_dump(mode="json") for g in groups]))
    mp.start_processes(
        backend_rank, args=(2, model_dir, groups_file, tmp_path / "init", tmp_path), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["step"] == alone["step"] == 2  # step 1, step 2, back to 1, step 2 again
    assert ranks[0]["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    for name, weight in alone["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
        torch.testing.assert_close(ranks[0]["weights"][name], weight, rtol=1e-4, atol=2e-5, msg=name)


def new_trainer_state(model_dir: Path, mode: str) -> dict[str, torch.Tensor]:
    trainer = new_trainer(model_dir, mode)
    try:
        return {k: v.clone() for k, v in trainer._master_state().items()}
    finally:
        trainer.engine.close()


def test_shares_partition_the_micro_batches_balanced_by_size_and_replicas_need_a_process_group():
    items, sizes = list("abcdefg"), [90, 10, 40, 40, 60, 5, 30]
    shares = [share(items, sizes, rank, 3) for rank in range(3)]
    assert sorted(i for s in shares for i in s) == items and all(
        s == sorted(s) for s in shares
    )  # a partition, in order
    assert shares == [["a", "f"], ["e", "g"], ["b", "c", "d"]]  # loads 95, 90, 90: the largest first, to the least
    assert share(items[:1], sizes[:1], 1, 2) == []  # a rank may get none
    if dist.is_initialized():
        pytest.skip("a process group is set up in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        Replicas()
