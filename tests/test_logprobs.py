"""The trainer's log-probs from hidden states (flywheel/train/logprobs.py) against the plain log-softmax of logits."""

from __future__ import annotations

import pytest
import torch
import transformers

from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.train.config import TrainedWeights
from flywheel.train.logprobs import CHUNK, token_logprobs

from helpers import lora_b_off_zero


def plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def inputs(dtype: torch.dtype, rows: int = CHUNK + 37) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows over more than one chunk; a third of them confident (the target's probability near 1)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, 48, generator=gen)
    weight = torch.randn(500, 48, generator=gen) * 0.3
    targets = torch.randint(0, 500, (rows,), generator=gen)
    hidden[::3] += 4 * weight[targets[::3]]  # a large logit for the target
    return hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), targets


def grads(fn, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    hidden, weight, targets = inputs(dtype)
    logp, entropy = fn(hidden, weight, targets)
    coeff = torch.linspace(-1, 2, len(targets))  # a loss that weighs tokens differently, both signs
    (logp * coeff).sum().backward()
    return logp.detach(), entropy.detach(), hidden.grad.float(), weight.grad.float()


def test_matches_log_softmax_in_fp32_values_and_both_gradients():
    fused, reference = grads(token_logprobs, torch.float32), grads(plain, torch.float32)
    assert fused[0].dtype == torch.float32 and (fused[0] > -0.01).sum() > 20  # confident rows are there
    for a, b in zip(fused[::2] + fused[3:], reference[::2] + reference[3:]):  # log-probs and both gradients
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], reference[1], rtol=0, atol=1e-4)  # entropy: lse - sum(p l) cancels


def test_bf16_matches_the_plain_path_to_bf16_rounding():
    fused, reference = grads(token_logprobs, torch.bfloat16), grads(plain, torch.bfloat16)
    torch.testing.assert_close(fused[0], reference[0], rtol=0, atol=1e-5)  # both reduce the same bf16 logits in fp32
    torch.testing.assert_close(fused[1], reference[1], rtol=0, atol=1e-4)
    for a, b in zip(fused[2:], reference[2:]):  # gradients go through bf16 matmuls on both sides
        assert (a - b).norm() / b.norm() < 0.01


def test_a_second_backward_pass_is_refused():
    hidden, weight, targets = inputs(torch.float32, rows=8)
    logp, _ = token_logprobs(hidden, weight, targets)
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        logp.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainer_log_probs_and_adapter_gradients_match_the_logits_path(tokenizer, dtype):
    """The real model with a LoRA adapter: log-probs from hidden states (the default for Llama models) against
    log-probs from the model's own logits, on a packed micro-batch."""
    from flywheel.inference.engine import InferenceEngine
    from flywheel.inference.loading import load_model
    from flywheel.train.batch import TrainingSequence, pack
    from flywheel.train.trainer import Trainer

    model, tok, _ = load_model(EMBEDDED_MODEL, dtype=dtype)
    engine = InferenceEngine(model, tok)
    try:
        trainer = Trainer(engine, TrainedWeights(rank=4))
        assert trainer.fused_head
        lora_b_off_zero(trainer, std=0.02)  # so every adapter weight gets a gradient
        prompt = tokenizer.encode("Question: what is 2+3? Answer:")
        seqs = [
            TrainingSequence(
                tokens=prompt + (a := tokenizer.encode(text)), trained=[False] * len(prompt) + [True] * len(a)
            )
            for text in (" 5, because two plus three is five.", " Five.", " It is 6.")
        ]
        (mb,) = pack(seqs, max_tokens=4096)

        def run(fused: bool) -> tuple[torch.Tensor, ...]:
            trainer.fused_head = fused
            with trainer._training_mode(False):
                logp, entropy = trainer._token_logprobs(mb)
                (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
            out = (logp.detach(), entropy, *(m.grad.clone() for m in trainer.master))  # gathered on the fp32 masters
            for m in trainer.master:
                m.grad = None
            return out

        fused, reference = run(True), run(False)
        tol = 1e-4 if dtype == torch.float32 else 2e-3  # fp32: matmuls of other shapes round differently
        torch.testing.assert_close(fused[0], reference[0], rtol=0, atol=tol)
        torch.testing.assert_close(fused[1], reference[1], rtol=0, atol=10 * tol)
        assert all(b.norm() > 0 for b in reference[2:])
        # all adapter gradients as one vector; in bf16 the backward pass through 30 layers rounds differently
        # after any change (its gradients sit ~100% from the fp32 model's), so only a loose check there
        a, b = torch.cat([g.flatten() for g in fused[2:]]), torch.cat([g.flatten() for g in reference[2:]])
        assert (a - b).norm() / b.norm() < (1e-4 if dtype == torch.float32 else 0.05)
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["Llama", "Mistral", "Qwen2", "Qwen3"])
def test_models_taken_as_plain_heads_compute_logits_as_the_head_of_the_last_hidden_state(arch):
    """What ``fuses_head`` assumes of each class it accepts, on a tiny random model of that class."""
    from flywheel.train.trainer import fuses_head

    config = getattr(transformers, f"{arch}Config")(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    assert fuses_head(model)
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = model.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(logits, hidden @ model.lm_head.weight.T, rtol=1e-5, atol=1e-5)
