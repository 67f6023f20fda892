"""What an RL step trains on, checked on the real model in fp32 (where sampler and trainer agree to rounding): the
sampling temperature's distribution, truncated importance sampling of tokens other weights sampled, the zero-signal
filter on the advantages used, skipped steps, the learning-rate schedule and the KL reference."""

from __future__ import annotations

import math

import pytest
import torch
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

import flywheel as art
from flywheel.inference.chat import render_prompt
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.sampling import SamplingParams
from flywheel.train.batch import pack, trajectory_sequences
from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights
from flywheel.train.credit import set_turn_rewards
from flywheel.train.trainer import Trainer, lr_multiplier
from flywheel.types import OFF_POLICY, set_sampled_tokens

from helpers import lora_b_off_zero

QUESTIONS = ["Name three fruits.", "Name a colour and an animal."]


def new_trainer(trained_weights: TrainedWeights | None = None, dtype: torch.dtype = torch.float32) -> Trainer:
    """A trainer on an engine of its own (tests here change its weights)."""
    model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=dtype)
    engine = InferenceEngine(model, tokenizer)
    return Trainer(engine, trained_weights)


@pytest.fixture
def trainer():
    t = new_trainer()
    yield t
    t.engine.close()


def as_choice(prompt: list[int], completion, temperature: float, logprobs: bool = True) -> Choice:
    content = [ChatCompletionTokenLogprob(token="", logprob=lp, top_logprobs=[]) for lp in completion.logprobs]
    choice = Choice(
        index=0,
        finish_reason="stop",
        message=ChatCompletionMessage(role="assistant", content=completion.text),
        logprobs=ChoiceLogprobs(content=content) if logprobs else None,
    )
    set_sampled_tokens(choice, prompt, completion.token_ids, temperature)
    return choice


async def rollouts(
    engine: InferenceEngine, question: str, n: int, temperature: float, seed: int
) -> list[art.Trajectory]:
    messages = [{"role": "user", "content": question}]
    prompt = render_prompt(engine.tokenizer, messages)
    params = SamplingParams(temperature=temperature, max_tokens=16, seed=seed, logprobs=True, n=n)
    return [
        art.Trajectory(
            messages_and_choices=[*messages, as_choice(prompt, c, temperature)], reward=float(len(c.token_ids) % 5)
        )
        for c in await engine.generate(prompt, params)
    ]


async def groups(engine: InferenceEngine, temperature: float = 1.0) -> list[art.TrajectoryGroup]:
    out = []
    for i, q in enumerate(QUESTIONS):
        trajectories = await rollouts(engine, q, 4, temperature, seed=i)
        trajectories[0].reward, trajectories[1].reward = 0.0, 1.0  # every group has signal
        out.append(art.TrajectoryGroup(trajectories))
    return out


async def test_sampler_and_trainer_score_tokens_under_the_sampling_temperature(trainer: Trainer):
    (traj,) = await rollouts(trainer.engine, QUESTIONS[0], 1, temperature=0.7, seed=3)
    (seq,) = trajectory_sequences(traj, trainer.engine.tokenizer, 1.0)
    (mb,) = pack([seq], 4096)
    with trainer.engine.exclusive(), torch.no_grad():
        trainer_logp, _ = trainer._token_logprobs(mb)
        logits = trainer.engine.model(input_ids=torch.tensor([seq.tokens])).logits[0, :-1].float()
    at_t = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(seq.tokens[1:])[:, None])[:, 0]
    expected = at_t[torch.tensor(seq.trained[1:])]
    sampler = torch.tensor([t.logprob for t in traj.messages_and_choices[-1].logprobs.content])
    assert len(sampler) == len(expected) > 3
    # the sampler reports the distribution it drew from, softmax(logits / T), and the trainer scores the same
    assert torch.allclose(sampler, expected, atol=2e-4), (sampler - expected).abs().max()
    assert torch.allclose(trainer_logp, expected, atol=2e-4), (trainer_logp - expected).abs().max()
    # at T = 1 they would differ: the test can tell
    at_1 = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq.tokens[1:])[:, None])[:, 0][
        torch.tensor(seq.trained[1:])
    ]
    assert (at_1 - expected).abs().max() > 0.05


async def test_stale_rollouts_train_with_truncated_importance_weights(trainer: Trainer):
    gathered = await groups(trainer.engine)
    # a trajectory built by hand (no sampler log-probs) trains as before and is counted
    tokenizer = trainer.engine.tokenizer
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    hand = Choice(
        index=0, finish_reason="stop", message=ChatCompletionMessage(role="assistant", content="Apple, pear, plum.")
    )
    gathered[0].trajectories.append(art.Trajectory(messages_and_choices=[*messages, hand], reward=1.0))
    (hand_seq,) = trajectory_sequences(gathered[0].trajectories[-1], tokenizer, 1.0)
    hand_tokens = sum(hand_seq.trained[1:])

    config = TrainConfig(learning_rate=2e-3)
    first = trainer.rl_step(gathered, config)
    assert first["skipped"] == 0.0 and first["tokens_without_sampler_logprobs"] == hand_tokens
    # sampled by these very weights: the ratio is 1 to rounding, and the gap ignores the hand-built tokens
    assert first["is_ratio_mean"] == pytest.approx(1.0, abs=1e-3) and first["sampler_logprob_gap"] < 1e-3
    # the same groups again: sampled by the weights before the step (as groups gathered before a train() are)
    for t in (t for g in gathered for t in g.trajectories):
        t.metadata[OFF_POLICY] = True  # all of them: their ratios, reported apart, are all the ratios
    second = trainer.rl_step(gathered, config)
    assert abs(second["is_ratio_mean"] - 1.0) > 1e-3 and second["is_ratio_max"] > 1.0
    assert "sampler_logprob_gap" not in second  # the served/trained gap is the on-policy members': none here
    assert second["off_policy_tokens"] == second["tokens_trained"] - second["tokens_without_sampler_logprobs"]
    assert second["off_policy_is_ratio_mean"] == pytest.approx(second["is_ratio_mean"])
    assert second["off_policy_is_clipped_fraction"] == pytest.approx(second["is_clipped_fraction"])
    off = trainer.rl_step(gathered, config.model_copy(update={"importance_sampling_cap": None}))
    assert "is_ratio_mean" not in off and off["off_policy_is_clipped_fraction"] == 0.0
    assert abs(off["off_policy_is_ratio_mean"] - 1.0) > 1e-3  # reported without a cap too


async def test_turn_credit_trains_a_group_whose_total_rewards_tie(trainer: Trainer):
    """Equal totals (1.5 each) but the intermediate reward comes at another turn: per-turn returns differ, so the
    group has signal under credit="turn" (the filter used to look at total rewards and skip it)."""
    tokenizer = trainer.engine.tokenizer

    def two_turns(first: str, second: str) -> art.Trajectory:
        messages = [{"role": "user", "content": "Count."}]
        items: list = list(messages)
        for text in (first, second):
            prompt = render_prompt(tokenizer, [*items[:1], *[m for m in items[1:] if isinstance(m, dict)]])
            ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            choice = Choice(
                index=0, finish_reason="stop", message=ChatCompletionMessage(role="assistant", content=text)
            )
            set_sampled_tokens(choice, prompt, ids, 1.0)
            items += [choice, {"role": "user", "content": "Go on."}]
        return art.Trajectory(messages_and_choices=items[:-1], reward=1.0)

    a, b = two_turns("One.", "Two."), two_turns("Uno.", "Dos.")
    set_turn_rewards(a, [0.5, 0.0])
    set_turn_rewards(b, [0.0, 0.5])
    metrics = trainer.rl_step([art.TrajectoryGroup([a, b])], TrainConfig(credit="turn", learning_rate=1e-4))
    assert metrics["skipped"] == 0.0 and metrics["groups_zero_variance"] == 0 and trainer.step == 1
    # uniform credit sees no signal in the same group
    metrics = trainer.rl_step([art.TrajectoryGroup([a, b])], TrainConfig(credit="uniform"))
    assert metrics["skipped"] == 1.0 and metrics["skip_reason"] == 1.0 and trainer.step == 1


async def test_a_non_finite_gradient_is_a_skipped_step_not_a_new_one(trainer: Trainer):
    gathered = await groups(trainer.engine)
    with torch.no_grad():
        trainer.params[0].view(-1)[0] = math.inf  # a weight that went infinite: every gradient is NaN
    metrics = trainer.rl_step(gathered, TrainConfig())
    assert metrics["skipped"] == 1.0 and metrics["skip_reason"] == 2.0 and metrics["optimizer_steps"] == 0
    assert not math.isfinite(metrics["grad_norm"]) and trainer.step == 0


def test_learning_rate_schedules_are_transformers():
    assert [lr_multiplier(TrainConfig(), k) for k in (0, 5)] == [1.0, 1.0]
    warm = TrainConfig(warmup_steps=2)
    assert [lr_multiplier(warm, k) for k in (0, 1, 2, 9)] == [0.0, 0.5, 1.0, 1.0]
    cosine = TrainConfig(lr_scheduler_type="cosine", warmup_steps=2, max_steps=10)
    assert lr_multiplier(cosine, 6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    linear = TrainConfig(lr_scheduler_type="linear", max_steps=4)
    assert [lr_multiplier(linear, k) for k in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="set max_steps"):
        TrainConfig(lr_scheduler_type="cosine")


async def test_kl_reference_is_the_base_or_a_chosen_checkpoint(trainer: Trainer):
    gathered = await groups(trainer.engine)
    trainer.rl_step(gathered, TrainConfig(learning_rate=2e-3))  # the adapter moves away from the base
    to_base = trainer.rl_step(gathered, TrainConfig(learning_rate=1e-9, beta=0.1))
    assert to_base["kl"] > 1e-6
    trainer.set_reference(trainer.adapter_state(), step=trainer.step)  # e.g. the end of an SFT warm start
    to_now = trainer.rl_step(gathered, TrainConfig(learning_rate=1e-9, beta=0.1))
    assert to_now["kl"] < 1e-7


async def test_full_fine_tuning_keeps_no_copy_of_the_model_for_a_kl_it_does_not_use():
    trainer = new_trainer(TrainedWeights(mode="full"))
    try:
        n_params = sum(p.numel() for p in trainer.params)

        def held_copies() -> int:  # tensors the trainer holds besides its parameters and their fp32 masters
            ours = {id(t) for t in (*trainer.params, *trainer.master)}
            lists = [v for v in vars(trainer).values() if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)]
            return sum(t.numel() for values in lists for t in values if id(t) not in ours)

        assert held_copies() < n_params // 100
        gathered = await groups(trainer.engine)
        trainer.rl_step(gathered, TrainConfig(learning_rate=1e-5))
        assert held_copies() < n_params // 100
        # with beta > 0 the base weights come from the base checkpoint on disk: the policy has moved from them
        metrics = trainer.rl_step(gathered, TrainConfig(learning_rate=1e-9, beta=0.1))
        assert metrics["kl"] > 0.0
    finally:
        trainer.engine.close()


async def test_kl_reference_step_names_a_checkpoint_of_the_model(tmp_path):
    backend = art.LocalBackend(path=tmp_path, serve_http=False)
    try:
        model = art.TrainableModel(name="kl-ref", project="tests", base_model=EMBEDDED_MODEL)
        await model.register(backend)
        demos = [
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": f"Say yes {i}."},
                    {"role": "assistant", "content": "Yes."},
                ]
            )
            for i in range(4)
        ]
        await model.train_sft(demos, SFTConfig(learning_rate=1e-3, batch_size=4, epochs=2))
        sft_end = await model.get_step()
        gathered = await groups(backend.trainer(model).engine)
        with pytest.raises(ValueError, match="kl_reference_step=99: model 'kl-ref' has no checkpoint at that step"):
            await model.train(gathered, TrainConfig(beta=0.1, kl_reference_step=99))
        # the policy is still the end of SFT: its KL to that checkpoint is zero, to the base it is not
        to_sft = await model.train(gathered, TrainConfig(learning_rate=1e-9, beta=0.1, kl_reference_step=sft_end))
        assert to_sft["kl"] < 1e-3  # bf16 sampler model, fp32 reference values rounded the same way
        to_base = await model.train(gathered, TrainConfig(learning_rate=1e-9, beta=0.1))
        assert to_base["kl"] > 10 * to_sft["kl"]
    finally:
        await backend.close()


def _restart(trainer: Trainer, masters: list[torch.Tensor]) -> None:
    """Back to the given weights with a fresh optimizer, as if no step had been taken."""
    with torch.no_grad():
        for p, m, start in zip(trainer.params, trainer.master, masters):
            m.copy_(start)
            p.data = m.to(trainer.dtype, copy=True)
    trainer.optimizer, trainer.step, trainer.rl_steps = None, 0, 0


async def test_knobs_do_what_they_say_micro_batches_grad_norm_weight_decay_epochs(trainer: Trainer):
    gathered = await groups(trainer.engine)
    lora_b_off_zero(trainer, std=0.01, seeded=True)  # so that weight decay has something to decay everywhere
    start = [m.detach().clone() for m in trainer.master]

    def after(config: TrainConfig) -> tuple[list[torch.Tensor], dict]:
        _restart(trainer, start)
        metrics = trainer.rl_step(gathered, config)
        return [m.detach().clone() for m in trainer.master], metrics

    whole, m_whole = after(TrainConfig(learning_rate=1e-3, micro_batch_tokens=4096))
    parts, m_parts = after(TrainConfig(learning_rate=1e-3, micro_batch_tokens=64))
    assert m_parts["micro_batches"] > m_whole["micro_batches"] == 1
    # the same update whatever the micro-batching (fp32: to rounding)
    assert m_parts["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-4)
    moved = sum(float((a - s).norm()) for a, s in zip(whole, start))
    assert moved > 1e-3
    # Adam's first step is ~lr * sign(g): a gradient element near 0 may round either way, so compare whole updates
    differ = sum(float((a - b).norm()) for a, b in zip(parts, whole))
    assert differ < 1e-2 * moved, (differ, moved)

    # AdamW's decoupled decay: w <- w - lr * wd * w, on top of the same Adam update
    decayed, _ = after(TrainConfig(learning_rate=1e-3, weight_decay=0.5, micro_batch_tokens=4096))
    for a, b, s in zip(decayed, whole, start):
        torch.testing.assert_close(a - b, -1e-3 * 0.5 * s, rtol=1e-3, atol=1e-7)

    # clipping to a tiny norm leaves a tiny step (Adam's eps dominates the clipped gradient); the metric is the norm
    # before clipping
    clipped, m_clipped = after(TrainConfig(learning_rate=1e-3, max_grad_norm=1e-9, micro_batch_tokens=4096))
    assert m_clipped["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-4)
    assert sum(float((a - s).norm()) for a, s in zip(clipped, start)) < 1e-2 * moved

    # a second pass over the batch is off-policy: its ratios move and the clip branch is reached
    _, two = after(TrainConfig(learning_rate=5e-3, epochs=2, micro_batch_tokens=4096))
    assert two["optimizer_steps"] == 2 and two["clip_fraction"] > 0.0
