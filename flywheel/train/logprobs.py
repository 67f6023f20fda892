"""Log-probabilities of the trained tokens straight from the last hidden states and the output embedding.

The plain way (``log_softmax(lm_head(h).float()).gather(targets)``) makes and keeps several [K, V] tensors: the
logits in bf16 and fp32, the log-softmax output for backward, an entropy pass over it, and in backward a zero
[K, V] gradient to scatter into, the log-softmax gradient and its bf16 copy. At K = 2,048 trained tokens and
V = 49,152 each is 0.2-0.4 GB, and these passes over memory took ~1.1 s of a 2-core CPU's 8 s training step,
more than the LM head's matmuls. Here the logits are made a chunk of rows at a time and reduced at once to the
token's log-prob, the entropy and the probabilities (kept in the matmul dtype, half the size); the backward pass
turns those into the logits' gradient in place, chunk by chunk, on the way into the matmuls.
"""

from __future__ import annotations

import torch

CHUNK = 256  # rows of logits at a time: [256, V] fp32 temporaries (50 MB at V = 49,152)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        rows = hidden.shape[0]
        logp = hidden.new_empty(rows, dtype=torch.float32)
        entropy = torch.empty_like(logp)
        probs = hidden.new_empty(rows, weight.shape[0])
        for start in range(0, rows, CHUNK):
            part = slice(start, start + CHUNK)
            logits = (hidden[part] @ weight.T).float()
            logits -= torch.logsumexp(logits, dim=-1, keepdim=True)  # now log-probabilities
            p = logits.exp()
            logp[part] = logits.gather(-1, targets[part, None])[:, 0]
            entropy[part] = -(p * logits).sum(-1)
            probs[part] = p
        ctx.save_for_backward(hidden, weight, targets, probs, logp)
        ctx.mark_non_differentiable(entropy)
        ctx.consumed = False
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor | None):
        if ctx.consumed:
            raise RuntimeError("token_logprobs: a second backward pass through the same graph (retain_graph) is not supported")
        ctx.consumed = True
        hidden, weight, targets, probs, logp = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        for start in range(0, hidden.shape[0], CHUNK):
            part = slice(start, start + CHUNK)
            g = grad_logp[part]
            # d logp / d logits = onehot(target) - p. The probabilities become the gradient in place (they are not
            # read again); the target's entry is set from the fp32 log-prob: 1 - p in bf16 would cancel to 0 or
            # 2^-8 for a confident token.
            grad_logits = probs[part].mul_(-g[:, None].to(probs.dtype))
            rows = torch.arange(grad_logits.shape[0], device=g.device)
            grad_logits[rows, targets[part]] = (g * -torch.expm1(logp[part])).to(probs.dtype)
            if want_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[part])
            if want_weight:
                grad_weight.addmm_(grad_logits.T, hidden[part])
        return grad_hidden, grad_weight, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For hidden states ``hidden`` [K, d] and an output embedding ``weight`` [V, d] (logits = hidden @ weight.T,
    computed in their dtype, reduced in fp32): the log-probability of each of ``targets`` [K] (differentiable in
    ``hidden`` and ``weight``, fp32) and the entropy of each row's distribution (fp32, a metric without grad).
    The backward pass may run once: it consumes what the forward pass kept."""
    with torch.autocast(hidden.device.type, enabled=False):
        return _TokenLogProbs.apply(hidden, weight, targets)
