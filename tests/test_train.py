"""Training on the real embedded model: masking, a two-step smoke test with checkpoints and resume, skipping."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
from typing import NamedTuple

import openai
import pytest
import torch
from openai.types.chat.chat_completion import Choice

import flywheel as art
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.train.batch import pack, trajectory_sequences
from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights

from helpers import lora_b_off_zero, sampled

SYSTEM = {"role": "system", "content": "You answer with one word."}


def test_multi_turn_masking_trains_only_sampled_tokens(tokenizer):
    traj = art.Trajectory(
        messages_and_choices=[
            SYSTEM,
            {"role": "user", "content": "q"},
            sampled("a", [1, 2, 3], [4, 5]),
            {"role": "tool", "tool_call_id": "c", "content": "r"},
            sampled("b", [1, 2, 3, 4, 5, 6, 7], [8, 9]),  # prompt extends the sequence: merged
            {"role": "user", "content": "again"},
            sampled("c", [1, 2, 99], [10]),  # history re-rendered differently: a sequence of its own
        ]
    )
    first, second = trajectory_sequences(traj, tokenizer, advantage=0.5)
    assert first.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [t for t, m in zip(first.tokens, first.trained) if m] == [4, 5, 8, 9]
    assert second.tokens == [1, 2, 99, 10] and second.trained == [False, False, False, True]
    (mb,) = pack([first, second], max_tokens=64)
    assert mb.targets.tolist() in ([4, 5, 8, 9, 10], [10, 4, 5, 8, 9])
    # each target is predicted from the position just before it, inside its own sequence
    flat = mb.input_ids[0].tolist()
    assert [flat[p + 1] for p in mb.positions.tolist()] == mb.targets.tolist()
    assert mb.advantages.tolist() == [0.5] * 5
    assert sorted(mb.lengths) == [4, 9] and mb.position_ids[0].tolist().count(0) == 2


def test_assistant_message_dicts_are_context_for_rl_but_trained_by_sft(tokenizer):
    traj = art.Trajectory(
        messages_and_choices=[
            SYSTEM,
            {"role": "user", "content": "Colour of the sky?"},
            {"role": "assistant", "content": "Blue"},
        ]
    )
    assert trajectory_sequences(traj, tokenizer) == []
    (seq,) = trajectory_sequences(traj, tokenizer, train_message_dicts=True)
    trained = [t for t, m in zip(seq.tokens, seq.trained) if m]
    assert tokenizer.decode(trained) == "Blue<|im_end|>"


async def sample_groups(model: art.TrainableModel, n_groups: int = 2, size: int = 4) -> list[art.TrajectoryGroup]:
    client = model.openai_client()

    async def rollout(q: str) -> art.Trajectory:
        messages = [SYSTEM, {"role": "user", "content": q}]
        r = await client.chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=12, logprobs=True
        )
        choice = r.choices[0]
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=float(len(choice.message.content or "")))

    questions = ["Name a fruit.", "Name a colour.", "Name an animal."][:n_groups]
    return await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(q) for _ in range(size)) for q in questions), pbar_desc=None
    )


async def _greedy_logprobs(client, model: str, messages: list[dict]) -> list[float]:
    r = await client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True)
    return [t.logprob for t in r.choices[0].logprobs.content]


async def test_two_steps_change_the_adapter_checkpoint_and_resume(fresh_backend: art.LocalBackend, tmp_path):
    model = art.TrainableModel(name="smoke", project="tests", base_model=EMBEDDED_MODEL)
    await model.register(fresh_backend)
    trainer = fresh_backend.trainer(model)
    # mixed precision: the sampler adds adapters in the model's dtype, the optimizer keeps fp32 masters
    engine_dtype = trainer.engine.model.dtype
    assert {p.dtype for p in trainer.params} == {engine_dtype}
    assert {m.dtype for m in trainer.master} == {torch.float32}
    before = trainer.adapter_state()
    probe = [SYSTEM, {"role": "user", "content": "Name a fruit."}]
    client = model.openai_client()
    lp_before = (
        await client.chat.completions.create(
            model=model.name, messages=probe, max_tokens=4, temperature=0, logprobs=True
        )
    ).choices[0]

    config = TrainConfig(learning_rate=1e-3, loss="dapo")
    for expected_step in (1, 2):
        metrics = await model.train(await sample_groups(model), config=config)
        assert metrics["skipped"] == 0.0
        assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("loss", "entropy", "grad_norm"))
        assert metrics["tokens_trained"] > 0 and metrics["entropy"] > 0
        assert metrics["rollout_seconds"] > 0 and metrics["score_seconds"] >= 0 and metrics["train_seconds"] > 0
        assert await model.get_step() == expected_step
        if expected_step == 1:
            lp_step1 = await _greedy_logprobs(client, "smoke", probe)
    after = trainer.adapter_state()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training must change the adapter"
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(trainer.params, trainer.master)), (
        "sampler adapters = masters"
    )

    # the very next request samples from the new weights (shared model, no stale adapter)
    lp_after = (
        await client.chat.completions.create(
            model=model.get_inference_name(2), messages=probe, max_tokens=4, temperature=0, logprobs=True
        )
    ).choices[0]
    assert [t.logprob for t in lp_after.logprobs.content] != [t.logprob for t in lp_before.logprobs.content]
    served = [m.id for m in (await client.models.list()).data]
    assert "smoke" in served and "smoke@2" in served and "smoke@0" not in served and "smoke@1" not in served
    # an earlier step is served from its checkpoint, on an engine of its own, exactly as it was sampled then
    assert await _greedy_logprobs(client, "smoke@1", probe) == lp_step1
    assert "smoke@1" in [m.id for m in (await client.models.list()).data]
    with pytest.raises(openai.NotFoundError, match="smoke@7"):  # no such checkpoint
        await client.chat.completions.create(model="smoke@7", messages=probe, max_tokens=2)

    ckpt = tmp_path / "tests" / "models" / "smoke" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["0001", "0002"]
    assert (ckpt / "0002" / "adapter_model.safetensors").exists() and (ckpt / "0002" / "optimizer.pt").exists()
    assert json.loads((ckpt / "0002" / "trainer_state.json").read_text())["step"] == 2
    rows = [
        json.loads(line)
        for line in (tmp_path / "tests" / "models" / "smoke" / "history.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2]
    assert (tmp_path / "tests" / "models" / "smoke" / "trajectories" / "train" / "0002.jsonl").exists()

    # a new backend resumes at the exact step with the same adapter weights (once the first one let go of the model)
    await fresh_backend.close()
    resumed = art.LocalBackend(path=tmp_path)
    try:
        again = art.TrainableModel(name="smoke", project="tests", base_model=EMBEDDED_MODEL)
        await again.register(resumed)
        assert await again.get_step() == 2
        state = resumed.trainer(again).adapter_state()
        assert all(torch.equal(state[k], after[k]) for k in after)
        assert resumed.trainer(again).optimizer is not None
        metrics = await again.train(await sample_groups(again, n_groups=1), config=config)
        assert await again.get_step() == 3 and metrics["skipped"] == 0.0
    finally:
        await resumed.close()


async def test_full_fine_tuning_trains_every_weight_checkpoints_and_resumes(fresh_backend: art.LocalBackend, tmp_path):
    model = art.TrainableModel(
        name="full", project="tests", base_model=EMBEDDED_MODEL, trained_weights=TrainedWeights(mode="full")
    )
    await model.register(fresh_backend)
    trainer = fresh_backend.trainer(model)
    assert trainer.peft is None and "lora" not in " ".join(trainer.names)
    assert sum(p.numel() for p in trainer.params) == sum(p.numel() for p in trainer.engine.model.parameters())
    before = trainer.adapter_state()
    config = TrainConfig(learning_rate=1e-4, beta=0.05)  # KL against the weights as they were before training
    first = await model.train(await sample_groups(model), config=config)
    client, probe = model.openai_client(), [SYSTEM, {"role": "user", "content": "Name a fruit."}]
    lp_step1 = await _greedy_logprobs(client, "full", probe)
    second = await model.train(await sample_groups(model), config=config)
    assert await _greedy_logprobs(client, "full@1", probe) == lp_step1  # step 1, served from its checkpoint
    assert first["skipped"] == second["skipped"] == 0.0
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and second["kl"] > 1e-6  # the reference did not move
    after = trainer.adapter_state()
    assert set(after) == set(before) and "model.embed_tokens.weight" in after
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert (
        "model.embed_tokens.weight" in changed
        and any("mlp" in k for k in changed)
        and any("self_attn" in k for k in changed)
    )

    ckpt = tmp_path / "tests" / "models" / "full" / "checkpoints" / "0002"
    assert (ckpt / "model.safetensors").exists() and not (ckpt / "adapter_model.safetensors").exists()
    # free this trainer (fp32 masters, AdamW state: ~16 bytes per weight) before the resumed one is built
    await fresh_backend.close()
    del trainer, model, before
    gc.collect()
    resumed = art.LocalBackend(path=tmp_path)
    try:
        again = art.TrainableModel(
            name="full", project="tests", base_model=EMBEDDED_MODEL, trained_weights=TrainedWeights(mode="full")
        )
        await again.register(resumed)
        assert await again.get_step() == 2
        state = resumed.trainer(again).adapter_state()
        assert all(torch.equal(state[k], after[k]) for k in after)
        await resumed.close()  # one backend at a time has a model's directory
        as_lora = art.TrainableModel(name="full", project="tests", base_model=EMBEDDED_MODEL)  # the same run, as LoRA
        other = art.LocalBackend(path=tmp_path, serve_http=False)
        with pytest.raises(ValueError, match="0002 has no adapter_model.safetensors"):
            await as_lora.register(other)
        await other.close()
    finally:
        await resumed.close()


async def test_zero_variance_groups_are_dropped_and_an_empty_step_is_skipped(fresh_backend: art.LocalBackend, tmp_path):
    model = art.TrainableModel(name="flat", project="tests", base_model=EMBEDDED_MODEL)
    await model.register(fresh_backend)
    groups = await sample_groups(model)
    for g in groups:
        for t in g.trajectories:
            t.reward = 1.0
    metrics = await model.train(groups)
    assert (
        metrics["skipped"] == 1.0 and metrics["groups_zero_variance"] == 2 and metrics["zero_variance_fraction"] == 1.0
    )
    assert await model.get_step() == 0
    assert not (tmp_path / "tests" / "models" / "flat" / "checkpoints").exists()
    # one group with signal trains, the flat one is counted
    groups[0].trajectories[0].reward = 0.0
    metrics = await model.train(groups, config=TrainConfig(learning_rate=1e-4))
    assert metrics["skipped"] == 0.0 and metrics["groups_zero_variance"] == 1 and metrics["sequences"] == 4
    assert await model.get_step() == 1


async def test_sft_warm_start_lowers_the_loss_and_log_and_delete_checkpoints(fresh_backend: art.LocalBackend):
    model = art.TrainableModel(name="sft", project="tests", base_model=EMBEDDED_MODEL)
    await model.register(fresh_backend)
    demos = [
        art.Trajectory(
            messages_and_choices=[
                SYSTEM,
                {"role": "user", "content": f"Say the secret word {i}."},
                {"role": "assistant", "content": "Flywheel"},
            ]
        )
        for i in range(4)
    ]
    trainer = fresh_backend.trainer(model)
    calls = []  # (steps taken, metrics) at each progress call
    history = await model.train_sft(
        demos, SFTConfig(learning_rate=2e-3, epochs=3, batch_size=4), progress=lambda m: calls.append((trainer.step, m))
    )
    assert len(history) == 3 and history[-1]["loss"] < history[0]["loss"]
    assert calls == list(enumerate(history, start=1))  # once per step, as it is taken, with its loss and timing
    assert await model.get_step() == 3
    await model.log([art.Trajectory(messages_and_choices=[SYSTEM], reward=r) for r in (0.0, 1.0)], split="val")
    deleted = await model.delete_checkpoints("val/reward")
    assert deleted == []  # only one checkpoint (step 3), which is both latest and best


def test_a_lora_trainer_starts_without_a_warning():
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps the model: a FutureWarning on
    the console at every LoRA start, about peft's code. In a process of its own, with Python's default filters
    (pytest records warnings and resets filters between tests)."""
    code = (
        "from flywheel.inference.engine import InferenceEngine\n"
        "from flywheel.inference.loading import EMBEDDED_MODEL, load_model\n"
        "from flywheel.train.trainer import Trainer\n"
        "model, tokenizer, _ = load_model(EMBEDDED_MODEL)\n"
        "engine = InferenceEngine(model, tokenizer)\n"
        "Trainer(engine)\n"
        "engine.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Warning" not in r.stderr, r.stderr[-2000:]


def test_sft_jsonl_rows_load_and_bad_rows_say_where(tmp_path):
    from flywheel.model import _read_jsonl

    good = tmp_path / "data.jsonl"
    traj = art.Trajectory(messages_and_choices=[SYSTEM, {"role": "user", "content": "x"}, sampled("y", [1], [2])])
    good.write_text(
        json.dumps({"messages": [SYSTEM, {"role": "assistant", "content": "ok"}], "tools": None})
        + "\n\n"
        + traj.model_dump_json()
        + "\n"
    )
    rows = _read_jsonl(good)
    assert [len(r.messages_and_choices) for r in rows] == [2, 3]
    assert isinstance(rows[1].messages_and_choices[2], Choice) and rows[1].messages_and_choices[2].token_ids == [2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [SYSTEM]}) + "\n" + '{"prompt": "no messages here"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a trajectory"):
        _read_jsonl(bad)


async def test_packed_rows_with_shared_prompts_give_the_same_log_probs(fp32_engine, tokenizer):
    """Two groups of rollouts, each sharing its own prompt: packing stores each group's prompt once and its answers
    as segments that continue it, and every trained token gets the log-probability of an ordinary forward pass of
    its sequence alone."""
    from flywheel.inference.chat import render_prompt
    from flywheel.inference.kv_attention import PackedBatch
    from flywheel.train.batch import TrainingSequence, _micro_batch, families, pack

    system = {"role": "system", "content": "Be brief."}  # too short to share across the groups
    seqs, prompt_lengths = [], []
    questions = [
        ("Fruit: name one that grows on trees and tastes sweet. " * 3, ["Apple", "Pear, a green one"]),
        ("River: name one that flows through a capital city. " * 3, ["Nile", "The Danube", "Rhine"]),
    ]
    for q, answers in questions:
        prompt = render_prompt(tokenizer, [system, {"role": "user", "content": q}])
        prompt_lengths.append(len(prompt))
        for a in answers:
            answer = tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id]
            seqs.append(TrainingSequence(tokens=prompt + answer, trained=[False] * len(prompt) + [True] * len(answer)))
    for i, s in enumerate(seqs):
        s.index = i
    groups = families(seqs)
    # one family per prompt (each shares its whole prompt), not one for all (which would share the system prompt)
    assert sorted((len(members), prefix) for prefix, members in groups) == [
        (2, prompt_lengths[0]),
        (3, prompt_lengths[1]),
    ]
    (mb,) = pack(seqs, max_tokens=4096)
    plain = _micro_batch([(0, [s]) for s in seqs])
    assert mb.input_ids.shape[1] == plain.input_ids.shape[1] - sum(p * (len(m) - 1) for p, m in groups)
    prefixes = [i for i, c in enumerate(mb.context) if c < 0]
    assert len(prefixes) == 2 and sorted(mb.context.count(i) for i in prefixes) == [2, 3]

    def logprobs(mb) -> dict[int, list[float]]:
        with fp32_engine.exclusive(), torch.no_grad():
            out = fp32_engine.model(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                use_cache=False,
                logits_to_keep=mb.positions,
                kv_batch=PackedBatch(mb.lengths, mb.context),
            )
        lp = torch.log_softmax(out.logits[0].float(), -1).gather(-1, mb.targets[:, None])[:, 0]
        by_seq: dict[int, list[float]] = {}
        for value, j in zip(lp.tolist(), mb.seq.tolist()):
            by_seq.setdefault(mb.seq_ids[j], []).append(value)
        return by_seq

    shared = logprobs(mb)
    with fp32_engine.exclusive(), torch.no_grad():
        for s in seqs:  # an ordinary forward pass of each sequence alone
            lg = fp32_engine.model(input_ids=torch.tensor([s.tokens])).logits[0, :-1].float()
            lp = torch.log_softmax(lg, -1).gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
            alone = [v for v, m in zip(lp.tolist(), s.trained[1:]) if m]
            assert torch.allclose(torch.tensor(shared[s.index]), torch.tensor(alone), atol=1e-4)


def test_families_share_the_longest_prefixes_and_split_to_fit_rows():
    from flywheel.train.batch import MIN_SHARED_PREFIX, TrainingSequence, families, pack

    def seq(tokens: list[int]) -> TrainingSequence:
        return TrainingSequence(tokens=tokens, trained=[False] * (len(tokens) - 1) + [True])

    common = list(range(1000, 1000 + MIN_SHARED_PREFIX))  # a system prompt every sequence has
    a, b = common + list(range(100)), common + list(range(200, 300))
    seqs = [seq(a + [7]), seq(a + [8, 9]), seq(b + [1]), seq(b + [2]), seq(b + [3]), seq([5] * 40)]
    got = sorted((p, len(m)) for p, m in families(seqs))
    assert got == [(0, 1), (len(a), 2), (len(b), 3)]  # not one family sharing only ``common``
    # rows too small for a whole family: it is split, each part repeating its prefix; every sequence is packed once
    assert sum(mb.input_ids.shape[1] for mb in pack(seqs, max_tokens=4096)) == 40 + len(a) + 3 + len(b) + 3
    rows = pack(seqs, max_tokens=len(b) + 2)  # the b family (len(b) + 3 tokens) does not fit in one row
    assert sorted(i for mb in rows for i in mb.seq_ids) == list(range(6))
    assert all(mb.input_ids.shape[1] <= len(b) + 2 for mb in rows)
    assert sorted(mb.n_seqs for mb in rows if -1 in mb.context and len(mb.context) > mb.n_seqs) == [2]  # b1 + b2


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_gradients(tokenizer):
    from flywheel.inference.engine import InferenceEngine
    from flywheel.inference.loading import load_model
    from flywheel.train.batch import TrainingSequence, _micro_batch
    from flywheel.train.trainer import Trainer

    model, tok, _ = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    engine = InferenceEngine(model, tok)
    try:
        trainer = Trainer(engine, TrainedWeights(rank=4))
        lora_b_off_zero(trainer, std=0.02)  # so every adapter weight gets a gradient
        tokens = tokenizer.encode("Question: what is 2+3? Answer: 5, because two plus three is five.")
        mb = _micro_batch([(0, [TrainingSequence(tokens=tokens, trained=[False] * 6 + [True] * (len(tokens) - 6))])])
        # HF checkpoints a layer's forward inside its hooks, and the recompute stops once it has what backward
        # needs, so count entries into a module within the layer
        calls = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        embedding_hooks = len(model.model.embed_tokens._forward_hooks)

        def gradients(checkpointing: bool) -> list[torch.Tensor]:
            calls.clear()
            with trainer._training_mode(checkpointing):
                trainer._token_logprobs(mb)[0].sum().backward()
            grads = [m.grad.clone() for m in trainer.master]  # an update's gradients gather on the fp32 masters
            for m in trainer.master:
                m.grad = None
            return grads

        plain, checkpointed = gradients(False), len(calls)
        recomputed, with_checkpointing = gradients(True), len(calls)
        assert (checkpointed, with_checkpointing) == (1, 2)  # the layer ran again in the backward pass
        assert all(g.abs().sum() > 0 for g in plain)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, recomputed))
        # the sampler gets its model back as it was, and a second step adds nothing
        assert not model.is_activation_checkpointing and not model.training
        assert len(model.model.embed_tokens._forward_hooks) == embedding_hooks
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(recomputed, gradients(True)))
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_training_attention_is_as_accurate_as_flash_attention(dtype):
    """The matmul attention of small packed micro-batches against torch's SDPA, both measured from a float64
    reference: outputs and all three input gradients, with padded, masked keys as the packing makes them."""
    from flywheel.inference.kv_attention import _small_attention

    gen = torch.Generator().manual_seed(0)
    segments, heads, kv_heads, n, m, dim = 5, 9, 3, 20, 36, 64
    q, k, v = (
        torch.randn(segments, h, length, dim, generator=gen, dtype=torch.float64)
        for h, length in ((heads, n), (kv_heads, m), (kv_heads, m))
    )
    seen = torch.arange(m)[None, :] < torch.randint(n + 1, m + 1, (segments,), generator=gen)[:, None]  # [S, m]
    mask = (seen[:, None, :] & (torch.arange(m)[None, :] <= torch.arange(n)[:, None] + m - n))[:, None]  # [S, 1, n, m]
    out_grad = torch.randn(segments, heads, n, dim, generator=gen, dtype=torch.float64)

    def run(fn, dt):
        inputs = [t.to(dt, copy=True).requires_grad_() for t in (q, k, v)]
        out = fn(*inputs)
        out.backward(out_grad.to(dt))
        return [out.detach().double()] + [t.grad.double() for t in inputs]

    def sdpa(q_, k_, v_):
        return torch.nn.functional.scaled_dot_product_attention(
            q_, k_, v_, attn_mask=mask, scale=dim**-0.5, enable_gqa=True
        )

    exact = run(sdpa, torch.float64)
    small = run(lambda q_, k_, v_: _small_attention(q_, k_, v_, mask, dim**-0.5), dtype)
    flash = run(sdpa, dtype)
    for s, f, e in zip(small, flash, exact):
        assert (s - e).norm() <= 2 * (f - e).norm() + 1e-9 * e.norm()


U_BF16, U_FP32 = 2.0**-8, 2.0**-24  # unit roundoffs (round to nearest): 8 and 24 significant bits


class Bounded(NamedTuple):
    """A result computed in bf16 as its exact value (fp64) and a bound, elementwise, on how far the computed result
    may be from it: forward error analysis, |rnd(t) - t| <= u |t| for each rounding to bf16, and a k-term sum of
    products in fp32 off by at most k u32 / (1 - k u32) times the sum of the terms' magnitudes, in any order."""

    value: torch.Tensor
    error: torch.Tensor

    @staticmethod
    def exact(t: torch.Tensor) -> Bounded:
        return Bounded(t.double(), torch.zeros_like(t, dtype=torch.float64))

    @property
    def T(self) -> Bounded:
        return Bounded(self.value.T, self.error.T)

    def rounded(self) -> Bounded:
        """This result (within ``error`` before) rounded to bf16."""
        return Bounded(self.value, self.error + U_BF16 * (self.value.abs() + self.error))

    def __add__(self, other: Bounded) -> Bounded:  # a bf16 sum, rounded
        return Bounded(self.value + other.value, self.error + other.error).rounded()

    def __mul__(self, s: float) -> Bounded:  # a bf16 tensor times a scalar: exact for a power of two
        scaled = Bounded(self.value * s, self.error * abs(s))
        return scaled if math.frexp(s)[0] == 0.5 else scaled.rounded()

    def __matmul__(self, other: Bounded) -> Bounded:
        return self.gemm(other)

    def gemm(self, other: Bounded, scale: float = 1.0, add: Bounded | None = None) -> Bounded:
        """``add + scale * self @ other`` in one GEMM: summed in fp32, rounded to bf16 once."""
        (a, ea), (b, eb) = self, other
        value, carried = a @ b * scale, (ea @ b.abs() + a.abs() @ eb + ea @ eb) * scale
        size, k = (a.abs() + ea) @ (b.abs() + eb) * scale, a.shape[-1]
        if add is not None:
            value, carried, size, k = value + add.value, carried + add.error, size + add.value.abs() + add.error, k + 2
        return Bounded(value, carried + k * U_FP32 / (1 - k * U_FP32) * size).rounded()


def fused_lora_bounds(
    x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float, g: torch.Tensor
) -> list[Bounded]:
    """The fused LoRA layer's output y = x W^T + s (x A^T) B^T and its gradients dx, dA, dB (for the output's
    gradient g), each as computed from bf16 operands: the base GEMM rounded, then the B GEMM summed into it by
    ``addmm`` and rounded again; backward, each GEMM rounded once (addmm multiplies by s after its GEMM)."""
    x, w, a, b, g = map(Bounded.exact, (x, w, a, b, g))
    lora_a = x @ a.T
    y = lora_a.gemm(b.T, scale=s, add=x @ w.T)
    d_lora_a = (g @ b) * s
    return [y, g @ w + d_lora_a @ a, d_lora_a.T @ x, (g.T @ lora_a) * s]


def check_fused_lora_layers_in_bf16(trainer, layers: list, seen: dict) -> None:
    """Each fused layer run alone, as in an update (the trainer's training mode, autocast), on the input and output
    gradient it had in the model's backward pass: its output and gradients lie within the rounding bounds of
    ``fused_lora_bounds`` around the exact values for the same bf16 operands (the adapter's weights in bf16, as
    autocast hands them to the GEMMs)."""
    names = {m: n for n, m in trainer.engine.model.named_modules()}
    with trainer._training_mode(False), torch.autocast("cpu", dtype=torch.bfloat16):
        for m in layers:
            x, g = seen[m]
            assert x.dtype == g.dtype == torch.bfloat16
            a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
            x_ = x.clone().requires_grad_()
            y = m(x_)
            y.backward(g)
            computed = [y.detach(), x_.grad, a.grad, b.grad]
            a.grad = b.grad = None
            with torch.no_grad():
                flat = [t.reshape(-1, t.shape[-1]) for t in (x, g)]
                bounds = fused_lora_bounds(
                    flat[0], m.base_layer.weight, a.bfloat16(), b.bfloat16(), m.scaling["default"], flat[1]
                )
                for name, c, bound in zip(("y", "dx", "dA", "dB"), computed, bounds):
                    error = (c.double().reshape(bound.value.shape) - bound.value).abs()
                    within = bool((error <= bound.error).all())
                    assert within, (
                        f"{name} of {names[m]}: {(error / bound.error).nan_to_num(0).max():.2f} x its rounding bound"
                    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_training_forward_gives_peft_gradients_and_leaves_dropout_to_peft(tokenizer, dtype):
    from peft.tuners.lora import Linear as LoraLinear

    from flywheel.inference.engine import InferenceEngine
    from flywheel.inference.loading import load_model
    from flywheel.train.batch import TrainingSequence, pack
    from flywheel.train.trainer import Trainer

    tokens = tokenizer.encode("Question: what is 2+3? Answer: 5, because two plus three is five.")
    (mb,) = pack([TrainingSequence(tokens=tokens, trained=[False] * 6 + [True] * (len(tokens) - 6))], max_tokens=4096)

    def gradients(trainer: Trainer) -> torch.Tensor:
        with trainer._training_mode(False):
            trainer._token_logprobs(mb)[0].sum().backward()
        grads = torch.cat([m.grad.flatten() for m in trainer.master])  # gathered on the fp32 masters
        for m in trainer.master:
            m.grad = None
        return grads

    for dropout in (0.0, 0.3):
        model, tok, _ = load_model(EMBEDDED_MODEL, dtype=dtype)
        engine = InferenceEngine(model, tok)
        try:
            # peft draws the A matrices from torch's global generator: seeded, the adapter (and so the bf16
            # rounding compared below) does not depend on which tests ran before
            torch.manual_seed(0)
            trainer = Trainer(engine, TrainedWeights(rank=4, dropout=dropout))
            layers = [m for m in model.modules() if type(m) is LoraLinear]
            assert layers and all("forward" in vars(m) for m in layers)  # the fused forward is installed
            dropped = []
            for m in layers:
                m.lora_dropout["default"].register_forward_hook(lambda *_: dropped.append(1))
            lora_b_off_zero(trainer, std=0.02, seeded=True)  # so every adapter weight gets a gradient
            if dropout:  # peft's forward runs, with its dropout
                gradients(trainer)
                assert len(dropped) == len(layers)
                continue
            seen: dict = {}  # per layer: its input, then its output's gradient

            def keep(module, args, out):
                seen[module] = [args[0].detach()]
                out.register_hook(lambda grad: seen[module].append(grad.detach()))

            hooks = [m.register_forward_hook(keep) for m in layers]
            fused = gradients(trainer)
            for hook in hooks:
                hook.remove()
            assert not dropped  # no dropout module called: the fused path ran
            if dtype == torch.bfloat16:
                # Not the whole model's gradients against peft's: through 30 bf16 layers any other rounding moves
                # them ~5-20% from exact ones, peft's as much as ours, and which of the two lands closer is chance
                # (fused/peft distance ratios 0.56-2.7 over five seeds of B). Layer by layer the rounding is bounded.
                check_fused_lora_layers_in_bf16(trainer, layers, seen)
                continue
            for m in layers:
                del m.forward  # peft's own forward again
            reference = gradients(trainer)
            assert reference.norm() > 0
            assert (fused - reference).norm() / reference.norm() < 1e-5
        finally:
            engine.close()
