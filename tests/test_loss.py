"""Advantage estimators and policy losses against values computed by hand (see the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.train.config import TrainConfig
from flywheel.train.loss import advantages, importance_weights, policy_loss, ratio_stats

# two sequences: seq 0 has two tokens (A = +1), seq 1 has one token (A = -1)
LOGP = [-1.0, -2.0, -0.5]
OLD = [-1.1, -1.8, -0.5]  # log ratios 0.1, -0.2, 0  ->  ratios 1.10517, 0.81873, 1
ADV = [1.0, 1.0, -1.0]
SEQ = [0, 0, 1]
R0, R1 = math.exp(0.1), math.exp(-0.2)


def run(loss: str, logp=LOGP, old=OLD, adv=ADV, ref=None, **cfg):
    lp = torch.tensor(logp, requires_grad=True)
    value, stats = policy_loss(
        lp,
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(SEQ),
        2,
        TrainConfig(loss=loss, **cfg),
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


def test_dr_grpo_divides_by_a_configured_constant_not_the_batch_longest():
    value, grad, _ = run("dr_grpo", dr_grpo_max_tokens=10)
    assert value == pytest.approx((-R0 - R1 + 1) / (10 * 2), abs=1e-6)  # the budget x 2 trajectories
    assert run("dr_grpo")[0] == pytest.approx((-R0 - R1 + 1) / (1024 * 2), abs=1e-6)  # the default budget
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
    for idx in ([0, 1], [2]):
        lp = torch.tensor([LOGP[i] for i in idx])
        part, _ = policy_loss(
            lp,
            torch.tensor([OLD[i] for i in idx]),
            torch.tensor([ADV[i] for i in idx]),
            torch.zeros(len(idx), dtype=torch.long),
            1,
            TrainConfig(loss="grpo"),
            n_trajectories=2,
            batch_tokens=3,
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


def test_a_trajectory_in_several_sequences_weighs_as_one():
    """Trajectory 0 renders into two sequences (seq 0: tokens 0-1, seq 1: token 2), trajectory 1 into one (token
    3). GRPO: (1/G) sum_i (1/|o_i|) sum_t: trajectory 0's three tokens share 1/3 each of its half, not a half per
    sequence (which counted it twice)."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.7], requires_grad=True)
    seq = torch.tensor([0, 0, 1, 2])
    traj_tokens = torch.tensor([3.0, 3.0, 3.0, 1.0])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0])
    loss, _ = policy_loss(
        logp, logp.detach(), adv, seq, 3, TrainConfig(loss="grpo"), traj_tokens=traj_tokens, n_trajectories=2
    )
    loss.backward()
    # ratio 1 everywhere: d/dlogp of -A rho / (|o_i| G) = -A / (|o_i| G)
    assert logp.grad.tolist() == pytest.approx([-1 / 6, -1 / 6, -1 / 6, 1 / 2], abs=1e-6)
    # GSPO keeps one ratio per sampled sequence but normalises per trajectory the same way
    logp.grad = None
    loss, _ = policy_loss(
        logp, logp.detach(), adv, seq, 3, TrainConfig(loss="gspo"), traj_tokens=traj_tokens, n_trajectories=2
    )
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1 / 6, -1 / 6, -1 / 6, 1 / 2], abs=1e-6)


def test_zero_variance_trajectories_count_in_grpo_means():
    """4 trajectories were given, 2 of them (a solved group) have no signal and are not computed: the mean is still
    over 4 (DeepSeekMath's 1/G), so a batch with more solved groups takes a smaller step, not a larger one."""
    computed, _, _ = run("grpo")
    with_solved, _ = policy_loss(
        torch.tensor(LOGP),
        torch.tensor(OLD),
        torch.tensor(ADV),
        torch.tensor(SEQ),
        2,
        TrainConfig(loss="grpo"),
        n_trajectories=4,
    )
    assert with_solved.item() == pytest.approx(computed / 2, abs=1e-6)


def test_truncated_importance_weights_scale_the_policy_gradient_and_are_capped():
    old = torch.tensor([-1.0, -2.0, -0.5, -0.3])
    sampler = torch.tensor([-1.0 - math.log(1.5), -2.0 + math.log(2.0), math.nan, -0.3 - math.log(5.0)])
    weights, ratio = importance_weights(old, sampler, cap=2.0)
    # pi_old / pi_sampler: 1.5, 0.5, unknown -> 1, 5 -> capped at 2
    assert weights.tolist() == pytest.approx([1.5, 0.5, 1.0, 2.0], abs=1e-6)
    assert ratio_stats(ratio, 2.0) == {
        "tokens": 3,
        "ratio_sum": pytest.approx(7.0),
        "ratio_max": pytest.approx(5.0),
        "clipped": 1,
    }
    # without a cap: no weights, the same ratios (what the trainer reports of off-policy members), none clipped
    uncapped, same = importance_weights(old, sampler, cap=None)
    assert uncapped is None and torch.equal(same.isnan(), ratio.isnan()) and ratio_stats(same, None)["clipped"] == 0
    assert ratio_stats(same[torch.tensor([False, True, True, False])], None) == {
        "tokens": 1, "ratio_sum": pytest.approx(0.5), "ratio_max": pytest.approx(0.5), "clipped": 0
    }  # fmt: skip
    lp = old.clone().requires_grad_(True)
    adv, seq = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([0, 1, 2, 3])
    loss, _ = policy_loss(lp, old, adv, seq, 4, TrainConfig(loss="dapo"), is_weight=weights)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-1.5 / 4, -0.5 / 4, -1.0 / 4, -2.0 / 4], abs=1e-6)


def test_two_token_toy_gradient_at_a_temperature_is_the_analytic_one():
    """A tabular policy over two tokens, logits z, sampled at T = 0.7: pi_T = softmax(z / T). The policy gradient of
    -A log pi_T(a) is -A (onehot(a) - pi_T) / T; scoring at T = 1 gave -A (onehot(a) - pi_1), which is neither its
    size nor (for several tokens) its direction."""
    from flywheel.train.logprobs import token_logprobs

    T, adv = 0.7, 1.0
    z = torch.tensor([0.3, -0.4], dtype=torch.float64)
    weight = torch.eye(2, dtype=torch.float64).requires_grad_(True)  # logits = hidden @ I = z
    hidden = z[None].clone().requires_grad_(True)
    logp, _ = token_logprobs(hidden, weight, torch.tensor([0]), torch.tensor([1 / T], dtype=torch.float64))
    (-adv * logp).sum().backward()
    pi_t = torch.softmax(z / T, dim=-1)
    expected = -adv * (torch.tensor([1.0, 0.0], dtype=torch.float64) - pi_t) / T
    assert hidden.grad[0].tolist() == pytest.approx(expected.tolist(), abs=1e-6)  # reduced in fp32
    assert logp.item() == pytest.approx(math.log(pi_t[0].item()), abs=1e-6)
