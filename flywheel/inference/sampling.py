"""Token sampling for a batch of rows with per-row parameters.

Log-probabilities returned to callers are those of the distribution a row is drawn from: softmax(logits / T) at
the row's temperature T (a greedy row, T = 0, reports T = 1's), before top-p truncation. The trainer scores the
same tokens under softmax(logits / T) (``flywheel.train``), so the two agree up to rounding and their ratio is a
true importance weight; top-p truncation is left out of both, as in TRL and verl. For a constrained (guided) row the
logits come in masked, so its log-probabilities are the constrained distribution's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flywheel.inference.guided import Guide


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    ignore_eos: bool = False  # keep sampling past end-of-sequence (benchmarks: fixed-length work)
    guide: Guide | None = None  # constrained decoding (response_format); its rows' logits arrive already masked


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per row, the top-k (token id, logprob); empty when not asked


BLOCK = 256  # tokens per block of the two-level draw


def _draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from unnormalised ``weights`` [R, V] with one uniform [R, 1] per row, in two levels: the
    block of ``BLOCK`` tokens whose cumulative mass passes the target, then the token inside it. A cumulative sum
    over the whole vocabulary is a sequential scan; block sums vectorise, and only one block per row is scanned.
    Returns the tokens [R]."""
    rows, vocab = weights.shape
    if vocab % BLOCK:
        weights = torch.nn.functional.pad(weights, (0, BLOCK - vocab % BLOCK))
    blocks = weights.view(rows, -1, BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [R, blocks]
    total = block_cdf[:, -1:]
    # just below the total, so that rounding can never select a block (or token) with no mass
    target = torch.minimum(uniform * total, total * (1 - 1e-6))
    block = torch.searchsorted(block_cdf, target, right=True)  # [R, 1]: first block whose cdf passes the target
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    inner = blocks.gather(1, block[..., None].expand(-1, -1, BLOCK))[:, 0].cumsum(dim=-1)  # [R, BLOCK]
    rest = torch.minimum((target - before).clamp_(min=0.0), inner[:, -1:] * (1 - 1e-6))
    token = block * BLOCK + torch.searchsorted(inner, rest, right=True)
    return token[:, 0]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> SampleOutput:
    """Draw one token per row of ``logits`` [B, V]. Rows with temperature 0 are greedy.

    A pass over [B, V] is not cheap on a CPU at a 49k vocabulary, so there are few: softmax is one fused
    kernel (faster than a bare ``exp``, and than ``logsumexp``), and the log-sum-exp that turns logits into
    log-probabilities comes from it for free: the most likely token has probability 1 / sum(exp(logit - max)), so
    lse = max - log(max probability), exact to rounding and never underflowing."""
    logits = logits.float()
    inverse_t = [1.0 / p.temperature if p.temperature > 0 else 1.0 for p in params]
    if any(x != 1.0 for x in inverse_t):  # the distribution each row is drawn from, and reports log-probs of
        logits = logits * torch.tensor(inverse_t, device=logits.device)[:, None]
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    tokens = logits.argmax(dim=-1) if len(sampled) < len(params) else None
    probs = torch.softmax(logits, dim=-1)
    lse = logits.amax(dim=-1) - probs.amax(dim=-1).log()
    if sampled:
        index = None if len(sampled) == len(params) else torch.tensor(sampled, device=logits.device)
        weights = probs if index is None else probs[index]
        top_ps = torch.tensor([params[i].top_p for i in sampled], device=logits.device)[:, None]
        if bool((top_ps < 1.0).any()):
            sorted_w, order = weights.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least the most likely token)
            sorted_w.masked_fill_(sorted_w.cumsum(dim=-1) - sorted_w >= top_ps, 0.0)
            weights = torch.zeros_like(weights).scatter_(-1, order, sorted_w)
        # A seeded row takes its uniform from its own generator, so it gets the same tokens whatever else shares
        # its batch.
        uniform = torch.rand(len(sampled), 1, device=logits.device)
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                uniform[j] = torch.rand(1, generator=generators[i], device=logits.device)
        drawn = _draw(weights, uniform)
        tokens = drawn if tokens is None else tokens.index_put_((index,), drawn)
    chosen = logits.gather(-1, tokens[:, None])[:, 0] - lse
    k = max(p.top_logprobs for p in params)
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    if k > 0:
        values, ids = logits.topk(k, dim=-1)
        values -= lse[:, None]
        for row, p in enumerate(params):
            # a constrained row may allow fewer than k tokens: the forbidden ones (-inf) are not alternatives
            pairs = zip(ids[row, : p.top_logprobs].tolist(), values[row, : p.top_logprobs].tolist())
            top[row] = [(t, v) for t, v in pairs if v != float("-inf")]
    return SampleOutput(tokens=tokens.tolist(), logprobs=chosen.tolist(), top=top)
