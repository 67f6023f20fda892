"""The token sampler on its own: draw frequencies, excluded tokens, and the log-probabilities it reports."""

import math

import pytest
import torch

from flywheel.inference.sampling import BLOCK, SamplingParams, _draw, sample


def test_two_level_draw_matches_the_distribution():
    torch.manual_seed(0)
    vocab = 3 * BLOCK + 37  # not a multiple of the block: the padded tail must never be drawn
    probs = torch.rand(vocab) ** 8  # uneven, like a language model's
    probs[::5] = 0.0  # tokens with no mass (top-p cut, a grammar's mask)
    probs /= probs.sum()
    draws = 200_000
    tokens = _draw((probs * 3.0)[None].expand(draws, -1).contiguous(), torch.rand(draws, 1))  # unnormalised
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts.shape[0] == vocab and counts[::5].sum() == 0
    expected = probs.double() * draws
    big = expected > 50  # chi-square over the tokens drawn often enough for the approximation
    chi2 = (((counts - expected) ** 2) / expected)[big].sum().item()
    dof = int(big.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


def test_extreme_uniforms_never_draw_a_token_without_mass():
    weights = torch.zeros(4, 2 * BLOCK)
    weights[:, 3] = 1.0
    weights[:, BLOCK + 7] = 2.0  # the last token with mass sits mid-block; everything after it is zero
    uniform = torch.tensor([[0.0], [0.5], [1.0 - 1e-9], [1.0]])
    tokens = _draw(weights, uniform)
    assert tokens.tolist() == [3, BLOCK + 7, BLOCK + 7, BLOCK + 7]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.0, 1.0)])
def test_reported_logprobs_are_those_of_the_distribution_drawn_from(temperature, top_p):
    torch.manual_seed(1)
    logits = torch.randn(6, 1000) * 3
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_logprobs=3) for _ in range(6)]
    out = sample(logits, params, [None] * 6)
    # softmax(logits / T) (T = 1 for a greedy row), no top-p: what the trainer recomputes
    reference = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    got = torch.tensor(out.logprobs)
    assert torch.allclose(got, reference[torch.arange(6), torch.tensor(out.tokens)], atol=1e-5)
    values, ids = reference.topk(3, dim=-1)
    for row in range(6):
        assert [t for t, _ in out.top[row]] == ids[row].tolist()
        assert torch.allclose(torch.tensor([v for _, v in out.top[row]]), values[row], atol=1e-5)
    if temperature == 0.0:
        assert out.tokens == logits.argmax(dim=-1).tolist()


def test_top_p_and_mixed_rows_in_one_batch():
    torch.manual_seed(2)
    logits = torch.randn(3, 500)
    logits[:, 7] = 20.0  # nearly all the mass on one token
    params = [
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0),
    ]
    for _ in range(20):
        out = sample(logits, params, [None] * 3)
        assert out.tokens[:2] == [7, 7]  # the nucleus is that token alone; greedy picks it too
        assert 0 <= out.tokens[2] < 500


def test_a_seeded_row_repeats_its_draws():
    logits = torch.randn(2, 800)
    params = [SamplingParams(temperature=1.0)] * 2
    draws = [sample(logits, params, [torch.Generator().manual_seed(5), None]).tokens[0] for _ in range(5)]
    assert len(set(draws)) == 1
