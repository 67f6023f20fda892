"""Log-probabilities of the trained tokens straight from the last hidden states and the output embedding.

The plain way (``log_softmax(lm_head(h).float()).gather(targets)``) makes and keeps several [K, V] tensors: the
logits in bf16 and fp32, the log-softmax output for backward, an entropy pass over it, and in backward a zero
[K, V] gradient to scatter into, the log-softmax gradient and its bf16 copy. At K = 2,048 trained tokens and
V = 49,152 each is 0.2-0.4 GB, and these passes over memory took longer than the LM head's matmuls (the
figures: docs/benchmarks.md, "Design figures behind code choices"). Here the logits are made a chunk of rows at a
time and reduced at once to the token's log-prob, the entropy and the probabilities (kept in the matmul dtype,
half the size); the backward pass turns those into the logits' gradient in place.
"""

from __future__ import annotations

import torch

CHUNK = 128  # rows of logits at a time: [128, V] fp32 temporaries (25 MB at V = 49,152); 256 is slower


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inverse_t: torch.Tensor | None):
        rows = hidden.shape[0]
        logp = hidden.new_empty(rows, dtype=torch.float32)
        entropy = torch.empty_like(logp)
        probs = hidden.new_empty(rows, weight.shape[0])
        for start in range(0, rows, CHUNK):
            part = slice(start, start + CHUNK)
            logits = (hidden[part] @ weight.T).float()
            if inverse_t is not None:  # the sampling temperature's distribution: softmax(logits / T)
                logits *= inverse_t[part, None]
            p = torch.softmax(logits, dim=-1)  # one row-wise kernel: each row's passes stay in cache
            # log-sum-exp from the most probable token: log p_max = l_max - lse
            p_max, top = p.max(dim=-1)
            lse = logits.gather(-1, top[:, None])[:, 0] - p_max.log()
            logp[part] = logits.gather(-1, targets[part, None])[:, 0] - lse
            entropy[part] = lse - (p * logits).sum(-1)
            probs[part] = p
        ctx.save_for_backward(hidden, weight, targets, probs, logp, inverse_t)
        ctx.mark_non_differentiable(entropy)
        ctx.consumed = False
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor | None):
        if ctx.consumed:
            raise RuntimeError(
                "token_logprobs: a second backward pass through the same graph (retain_graph) is not supported"
            )
        ctx.consumed = True
        hidden, weight, targets, probs, logp, inverse_t = ctx.saved_tensors
        # d logp / d logits = onehot(target) - p. The probabilities become the gradient in place (they are not read
        # again); the target's entry is set from the fp32 log-prob: 1 - p in bf16 would cancel to 0 or 2^-8 for a
        # confident token. The matmuls take all rows at once (in chunks of rows they ran slower).
        if inverse_t is not None:  # the logits were scaled by 1 / T: so is their gradient
            grad_logp = grad_logp * inverse_t
        grad_logits = probs.mul_(-grad_logp[:, None].to(probs.dtype))
        rows = torch.arange(len(targets), device=targets.device)
        grad_logits[rows, targets] = (grad_logp * -torch.expm1(logp)).to(probs.dtype)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.T @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inverse_t: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For hidden states ``hidden`` [K, d] and an output embedding ``weight`` [V, d] (logits = hidden @ weight.T,
    computed in their dtype, reduced in fp32): the log-probability of each of ``targets`` [K] (differentiable in
    ``hidden`` and ``weight``, fp32) and the entropy of each row's distribution (fp32, a metric without grad).
    ``inverse_t`` [K] (fp32), if given, scales each row's logits: the distribution at sampling temperature T.
    The backward pass may run once: it consumes what the forward pass kept."""
    with torch.autocast(hidden.device.type, enabled=False):
        return _TokenLogProbs.apply(hidden, weight, targets, inverse_t)
