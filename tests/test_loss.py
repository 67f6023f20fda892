"""Advantage estimators and policy losses against values computed by hand (see the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.train.config import TrainConfig
from flywheel.train.loss import advantages, policy_loss

# two sequences: seq 0 has two tokens (A = +1), seq 1 has one token (A = -1)
LOGP = [-1.0, -2.0, -0.5]
OLD = [-1.1, -1.8, -0.5]  # log ratios 0.1, -0.2, 0  ->  ratios 1.10517, 0.81873, 1
ADV = [1.0, 1.0, -1.0]
SEQ = [0, 0, 1]
R0, R1 = math.exp(0.1), math.exp(-0.2)


def run(loss: str, logp=LOGP, old=OLD, adv=ADV, ref=None, **cfg):
    lp = torch.tensor(logp, requires_grad=True)
    value, stats = policy_loss(
        lp, torch.tensor(old), torch.tensor(adv), torch.tensor(SEQ), 2, TrainConfig(loss=loss, **cfg),
        ref_logp=None if ref is None else torch.tensor(ref),
    )
    value.backward()
    return value.item(), lp.grad.tolist(), stats


def test_grpo_is_a_per_sequence_mean_then_a_mean_over_sequences():
    value, grad, stats = run("grpo")
    assert value == pytest.approx(((-R0 - R1) / 2 + 1) / 2, abs=1e-6)
    # d/dlogp of -(rho A)/|o|/n = -rho A / (|o| n)
    assert grad == pytest.approx([-R0 / 4, -R1 / 4, 1 / 2], abs=1e-6)
    assert stats["clip_fraction"] == 0.0


def test_grpo_clips_large_ratios_for_positive_advantages():
    value, grad, stats = run("grpo", logp=[-1.0, -1.0, -0.5], old=[-1.0 - math.log(1.5), -1.0, -0.5])
    # token 0: min(1.5 * 1, 1.2 * 1) = 1.2 (clipped: no gradient); token 1: ratio 1
    assert value == pytest.approx(((-1.2 - 1.0) / 2 + 1) / 2, abs=1e-6)
    assert grad[0] == 0.0 and grad[1] == pytest.approx(-1 / 4)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)


def test_dapo_is_a_token_mean_with_clip_higher():
    value, _, _ = run("dapo")
    assert value == pytest.approx((-R0 - R1 + 1) / 3, abs=1e-6)
    # ratio 1.25 with A > 0: inside DAPO's 1.28 bound, outside GRPO's 1.2
    up = dict(logp=[-1.0, -1.0, -0.5], old=[-1.0 - math.log(1.25), -1.0, -0.5])
    assert run("dapo", **up)[0] == pytest.approx((-1.25 - 1 + 1) / 3, abs=1e-6)
    assert run("grpo", **up)[0] == pytest.approx(((-1.2 - 1) / 2 + 1) / 2, abs=1e-6)


def test_dr_grpo_divides_by_a_constant():
    value, grad, _ = run("dr_grpo")
    assert value == pytest.approx((-R0 - R1 + 1) / (2 * 2), abs=1e-6)  # max length 2 x 2 sequences
    assert run("dr_grpo", dr_grpo_max_tokens=10)[0] == pytest.approx((-R0 - R1 + 1) / 20, abs=1e-6)
    assert TrainConfig(loss="dr_grpo").scale_rewards is False


def test_gspo_uses_one_clipped_ratio_per_sequence():
    value, grad, stats = run("gspo")
    s0 = math.exp((0.1 - 0.2) / 2)  # 0.9512, below 1 - 3e-4 but A > 0 so min() keeps the unclipped value
    assert value == pytest.approx((-s0 + 1) / 2, abs=1e-6)
    # both tokens of sequence 0 share d s0 / d logp_t = s0 / 2
    assert grad[0] == pytest.approx(grad[1]) and grad[0] == pytest.approx(-s0 / 2 / 2, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)


def test_cispo_weights_log_probs_by_the_detached_clipped_ratio():
    value, grad, _ = run("cispo")
    assert value == pytest.approx((R0 * 1.0 + R1 * 2.0 - 0.5) / 3, abs=1e-6)
    assert grad == pytest.approx([-R0 / 3, -R1 / 3, 1 / 3], abs=1e-6)
    big = run("cispo", logp=[-1.0, -2.0, -0.5], old=[-1.0 - math.log(9.0), -2.0, -0.5])
    assert big[1][0] == pytest.approx(-5.0 / 3, abs=1e-5)  # weight capped at 1 + 4.0


def test_k3_kl_term():
    ref = [-1.0, -1.0, -1.0]  # ref - logp = 0, 1, -0.5
    k3 = [0.0, math.e - 2, math.exp(-0.5) + 0.5 - 1]
    plain, _, _ = run("dapo")
    with_kl, _, stats = run("dapo", ref=ref, beta=0.1)
    assert with_kl - plain == pytest.approx(0.1 * sum(k3) / 3, abs=1e-6)
    assert stats["kl"] == pytest.approx(sum(k3) / 3, abs=1e-6)


def test_micro_batches_add_up_to_the_whole_batch():
    whole, _, _ = run("grpo")
    parts = 0.0
    for idx, n_tokens in (([0, 1], 2), ([2], 1)):
        lp = torch.tensor([LOGP[i] for i in idx])
        part, _ = policy_loss(
            lp, torch.tensor([OLD[i] for i in idx]), torch.tensor([ADV[i] for i in idx]),
            torch.zeros(len(idx), dtype=torch.long), 1, TrainConfig(loss="grpo"), batch_seqs=2, batch_tokens=3,
        )
        parts += part.item()
    assert parts == pytest.approx(whole, abs=1e-6)


def test_grpo_advantages_scaled_and_unscaled():
    (a,) = advantages([[1.0, 0.0, 0.0, 1.0]], "grpo", scale=True)
    assert a == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-4)  # (r - 0.5) / 0.5
    (b,) = advantages([[1.0, 0.0, 0.0, 1.0]], "grpo", scale=False)
    assert b == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_rloo_subtracts_the_mean_of_the_others():
    (a,) = advantages([[1.0, 0.0, 0.0, 0.0]], "rloo")
    assert a == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_reinforce_pp_whitens_over_the_batch():
    a, b = advantages([[1.0, 0.0], [3.0, 1.0, 2.0]], "reinforce_pp")
    centred = [0.5, -0.5, 1.0, -1.0, 0.0]  # minus each group's mean; batch mean 0, population std sqrt(0.5)
    std = math.sqrt(sum(x * x for x in centred) / 5)
    assert a + b == pytest.approx([x / std for x in centred], abs=1e-5)
