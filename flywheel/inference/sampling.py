"""Token sampling for a batch of rows with per-row parameters.

Log-probabilities returned to callers are those of the model's own distribution (temperature 1, no top-p),
which is what the trainer recomputes for the importance ratio; temperature and top-p only shape the draw. For a
constrained (guided) row the logits come in masked, so its log-probabilities are the constrained distribution's.
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


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> SampleOutput:
    """Draw one token per row of ``logits`` [B, V]. Rows with temperature 0 are greedy.

    Each pass over [B, V] costs 1-2 ms on a 2-core CPU at a 49k vocabulary (sampling was ~7% of a decode step at
    32 rows), so there are as few as possible: log-probabilities are logits minus one log-sum-exp per row (no full
    log-softmax), greedy rows alone take an argmax, and a batch where every row samples is not copied."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    tokens = logits.argmax(dim=-1) if len(sampled) < len(params) else None
    if sampled:
        index = None if len(sampled) == len(params) else torch.tensor(sampled, device=logits.device)
        rows = logits if index is None else logits[index]
        temps = [params[i].temperature for i in sampled]
        if any(t != 1.0 for t in temps):
            rows = rows / torch.tensor(temps, device=logits.device)[:, None]
        probs = torch.softmax(rows, dim=-1)
        top_ps = torch.tensor([params[i].top_p for i in sampled], device=logits.device)[:, None]
        if bool((top_ps < 1.0).any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least the most likely token)
            sorted_probs.masked_fill_(sorted_probs.cumsum(dim=-1) - sorted_probs >= top_ps, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        # Inverse-CDF draw: one uniform per row (torch.multinomial is ~30x slower on CPU at this vocabulary size).
        # A seeded row takes its uniform from its own generator, so it gets the same tokens whatever else shares
        # its batch.
        cdf = probs.cumsum(dim=-1)
        uniform = torch.rand(len(sampled), 1, device=logits.device)
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                uniform[j] = torch.rand(1, generator=generators[i], device=logits.device)
        drawn = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
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
