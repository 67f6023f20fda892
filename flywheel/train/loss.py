"""Advantages and policy losses of the GRPO family, on flat per-token tensors.

Notation: rho = pi / pi_old per token, A = advantage of the token's trajectory, eps = (low, high) clip range, G =
trajectories in the optimizer batch (every group given, zero-variance ones included), |o_i| = trained tokens of
trajectory i (all its turns and sequences), pi = softmax(logits / T) at the temperature the token was sampled at.
- GRPO (Shao et al. 2024, DeepSeekMath, eq. 3): (1/G) sum_i (1/|o_i|) sum_t min(rho A, clip(rho, 1-eps, 1+eps) A).
- Dr. GRPO (Liu et al. 2025): no std scaling; (1/G) sum_i sum_t (...) / L, L a constant (the generation budget,
  ``dr_grpo_max_tokens``).
- DAPO (Yu et al. 2025, eq. 8): clip-higher (0.2, 0.28), a mean over every token of the batch; its dynamic
  sampling drops zero-variance groups, so their tokens are not in that mean.
- GSPO (Zheng et al. 2025): one ratio per sampled sequence, s = exp(mean_t log rho_t), clipped per sequence; then
  normalised as GRPO.
- CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped, detached ratio: -sg(clip(rho)) A log pi; a token
  mean, as DAPO.
- Truncated importance sampling (TIS; Yao et al. 2025, TRL and verl): tokens sampled by other weights or another
  numeric path than the trainer's carry w = min(pi_old / pi_sampler, cap), detached, on their policy term.
- KL (optional): Schulman's k3 estimator to the reference policy, exp(ref - lp) - (ref - lp) - 1.
Advantage estimators: GRPO (r - group mean, optionally / group std), RLOO (Ahmadian et al. 2024: r_i minus the
mean of the others), REINFORCE++ baseline (Hu 2025: r - group mean, then whitened over the whole batch).
"""

from __future__ import annotations

import torch

from flywheel.train.config import TrainConfig


def advantages(groups: list[list[float]], estimator: str = "grpo", scale: bool = True) -> list[list[float]]:
    """Per-trajectory advantages, group by group. Zero-variance groups must be dropped before."""
    out = []
    for rewards in groups:
        r = torch.tensor(rewards, dtype=torch.float64)
        if estimator == "rloo":
            a = (r - r.mean()) * len(r) / (len(r) - 1)
        else:
            a = r - r.mean()
            if estimator == "grpo" and scale:
                a = a / (r.std(unbiased=False) + 1e-6)
        out.append(a)
    if estimator == "reinforce_pp":
        flat = torch.cat(out)
        mean, std = flat.mean(), flat.std(unbiased=False) + 1e-6
        out = [(a - mean) / std for a in out]
    return [a.tolist() for a in out]


def _segment_sum(x: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, seq, x)


def policy_loss(
    logp: torch.Tensor,  # [N] log pi(token) under the current policy (with grad)
    old_logp: torch.Tensor,  # [N] under the policy before this update (no grad)
    adv: torch.Tensor,  # [N] advantage of each token's trajectory (or turn)
    seq: torch.Tensor,  # [N] sequence index of each token, 0..n_seqs-1 (GSPO's ratio is per sequence)
    n_seqs: int,
    config: TrainConfig,
    ref_logp: torch.Tensor | None = None,  # [N] under the reference policy, when beta > 0
    is_weight: torch.Tensor | None = None,  # [N] truncated importance weight pi_old / pi_sampler (TIS), detached
    traj_tokens: torch.Tensor | None = None,  # [N] |o_i| of each token's trajectory; default: its sequence's
    n_trajectories: int | None = None,  # G; default: n_seqs. With these and ``batch_tokens`` (the DAPO/CISPO mean's
    batch_tokens: int | None = None,  # count), the losses of an optimizer batch's micro-batches add up to its loss
) -> tuple[torch.Tensor, dict[str, float]]:
    low, high = config.clip
    log_ratio = logp - old_logp
    if config.loss == "gspo":
        tokens_per_seq = _segment_sum(torch.ones_like(logp), seq, n_seqs)
        ratio = torch.exp(_segment_sum(log_ratio, seq, n_seqs) / tokens_per_seq)[seq]  # a sequence's tokens share it
    else:
        ratio = torch.exp(log_ratio)
    if config.loss == "cispo":
        per_token = -ratio.clamp(1 - low, 1 + high).detach() * adv * logp
    else:
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    if is_weight is not None:
        per_token = per_token * is_weight
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1 if ref_logp is not None else torch.zeros_like(logp)
    per_token = per_token + config.beta * kl

    n_trajectories = n_trajectories or n_seqs
    if config.loss in ("grpo", "gspo"):  # mean over each trajectory's tokens, then over trajectories
        if traj_tokens is None:
            traj_tokens = _segment_sum(torch.ones_like(logp), seq, n_seqs)[seq]
        loss = (per_token / traj_tokens).sum() / n_trajectories
    elif config.loss == "dr_grpo":  # a constant normaliser: no length bias
        loss = per_token.sum() / (config.dr_grpo_max_tokens * n_trajectories)
    else:  # dapo, cispo: every token of the batch counts the same
        loss = per_token.sum() / (batch_tokens or logp.numel())

    clipped = ((ratio < 1 - low) | (ratio > 1 + high)).float().mean()
    return loss, {
        "clip_fraction": float(clipped),
        "kl": float(kl.detach().mean()),
        "ratio_mean": float(ratio.detach().mean()),
    }


def importance_weights(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """TIS per token: the weight min(pi_old / pi_sampler, cap), 1 where the sampler's log-prob is unknown (NaN), None
    without a cap; and the ratio pi_old / pi_sampler itself, NaN where unknown (its metrics: ``ratio_stats``)."""
    ratio = torch.exp(old_logp - sampler_logp)
    weight = None if cap is None else torch.where(torch.isnan(sampler_logp), 1.0, ratio).clamp(max=cap)
    return weight, ratio


def ratio_stats(ratio: torch.Tensor, cap: float | None) -> dict[str, float]:
    """Over the tokens whose ratio is known (not NaN): how many, the ratios' sum and max, how many the cap clips."""
    seen = ratio[~torch.isnan(ratio)]
    if not seen.numel():
        return {"tokens": 0, "ratio_sum": 0.0, "ratio_max": 0.0, "clipped": 0}
    clipped = int((seen > cap).sum()) if cap is not None else 0
    return {"tokens": seen.numel(), "ratio_sum": float(seen.sum()), "ratio_max": float(seen.max()), "clipped": clipped}
