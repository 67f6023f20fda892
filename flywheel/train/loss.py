"""Advantages and policy losses of the GRPO family, on flat per-token tensors.

Notation: rho = pi / pi_old per token, A = advantage of the token's sequence, eps = (low, high) clip range.
- GRPO (Shao et al. 2024, DeepSeekMath): mean_i (1/|o_i|) sum_t min(rho A, clip(rho, 1-eps, 1+eps) A).
- Dr. GRPO (Liu et al. 2025): no std scaling; sum over tokens divided by a constant (max length x sequences).
- DAPO (Yu et al. 2025): clip-higher (0.2, 0.28), mean over all tokens of the batch.
- GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean_t log rho_it), clipped per sequence.
- CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped, detached ratio: -sg(clip(rho)) A log pi.
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
    old_logp: torch.Tensor,  # [N] under the policy that sampled (no grad)
    adv: torch.Tensor,  # [N] advantage of each token's sequence
    seq: torch.Tensor,  # [N] sequence index of each token, 0..n_seqs-1
    n_seqs: int,
    config: TrainConfig,
    ref_logp: torch.Tensor | None = None,  # [N] under the reference policy, when beta > 0
    batch_seqs: int | None = None,  # sequences / tokens in the whole optimizer batch, when this call sees one
    batch_tokens: int | None = None,  # micro-batch of it: the micro-batch losses then add up to the batch loss
    max_tokens: int | None = None,  # longest sequence of the batch (Dr. GRPO's default normaliser)
) -> tuple[torch.Tensor, dict[str, float]]:
    low, high = config.clip
    batch_seqs, batch_tokens = batch_seqs or n_seqs, batch_tokens or logp.numel()
    log_ratio = logp - old_logp
    tokens_per_seq = _segment_sum(torch.ones_like(logp), seq, n_seqs)
    if config.loss == "gspo":
        seq_ratio = torch.exp(_segment_sum(log_ratio, seq, n_seqs) / tokens_per_seq)
        ratio = seq_ratio[seq]  # every token of a sequence shares its sequence's ratio
    else:
        ratio = torch.exp(log_ratio)
    if config.loss == "cispo":
        weight = ratio.clamp(1 - low, 1 + high).detach()
        per_token = -weight * adv * logp
    else:
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1 if ref_logp is not None else torch.zeros_like(logp)
    per_token = per_token + config.beta * kl

    if config.loss in ("grpo", "gspo"):  # mean over each sequence's tokens, then over sequences
        loss = (_segment_sum(per_token, seq, n_seqs) / tokens_per_seq).sum() / batch_seqs
    elif config.loss == "dr_grpo":  # a constant normaliser: no length bias
        norm = config.dr_grpo_max_tokens or max_tokens or int(tokens_per_seq.max())
        loss = per_token.sum() / (norm * batch_seqs)
    else:  # dapo, cispo: every token of the batch counts the same
        loss = per_token.sum() / batch_tokens

    clipped = ((ratio < 1 - low) | (ratio > 1 + high)).float().mean()
    return loss, {"clip_fraction": float(clipped), "kl": float(kl.detach().mean()), "ratio_mean": float(ratio.detach().mean())}
