"""The trainer's packed attention (flywheel/inference/kv_attention.py: PackedBatch, _packed) against a plain
per-sequence reference: each segment is causal SDPA over the segment it continues followed by its own tokens.
Random tensors, no model: forward and backward in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from flywheel.inference import kv_attention
from flywheel.inference.kv_attention import PackedBatch, _packed
from flywheel.train.config import TrainConfig
from flywheel.types import Trajectory, TrajectoryGroup

from helpers import sampled

HEADS, KV_HEADS, DIM, SCALING = 9, 3, 64, 0.125  # SmolLM2-135M's attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], context: list[int]):
    """Each segment on its own: keys are its context's tokens, then its own (causal)."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    out = []
    for start, n, c in zip(starts, lengths, context):
        own = slice(start, start + n)
        before = slice(starts[c], starts[c] + lengths[c]) if c >= 0 else slice(0, 0)
        keys = torch.cat([k[:, :, before], k[:, :, own]], dim=2)
        values = torch.cat([v[:, :, before], v[:, :, own]], dim=2)
        seen = before.stop - before.start
        mask = torch.ones(n, seen + n, dtype=torch.bool).tril(diagonal=seen)
        o = F.scaled_dot_product_attention(q[:, :, own], keys, values, attn_mask=mask, scale=SCALING, enable_gqa=True)
        out.append(o)
    return torch.cat(out, dim=2).transpose(1, 2)  # [1, T, heads, dim]


# sizes a quarter of the support job's rows (docs/benchmarks.md), with the threshold of one padded call lowered to
# match (SMALL_SCORES / 64), except for the small group, which stays one call at the real threshold
SMALL = 1 << 16
LAYOUTS = {
    "lone": ([200], [-1]),
    "small group (one call)": ([70, 64, 50, 64, 61], [-1, 0, 0, 0, 0]),
    "prompt and unequal continuations": ([228, 96, 31, 31, 31, 52], [-1, 0, 0, 0, 0, 0]),
    "two prompts with continuations": ([150, 33, 11, 175, 55, 3], [-1, 0, 0, -1, 3, 3]),
    "long context, short continuation; lone sequences of equal and other lengths": (
        [75, 300, 5, 75, 112],
        [-1, -1, 1, -1, -1],
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_packed_attention_equals_per_sequence_attention_forward_and_backward(name, monkeypatch):
    lengths, context = LAYOUTS[name]
    if name != "small group (one call)":
        monkeypatch.setattr(kv_attention, "SMALL_SCORES", SMALL)
    torch.manual_seed(0)
    total = sum(lengths)
    leaves = [torch.randn(1, h, total, DIM, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS)]
    weights = torch.randn(1, total, HEADS, DIM)  # a loss that weighs every output differently
    batch = PackedBatch(lengths, context)
    got = _packed(0, *leaves, batch, SCALING)
    want = reference(*leaves, lengths, context)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got_grads = torch.autograd.grad((got * weights).sum(), leaves)
    want_grads = torch.autograd.grad((want * weights).sum(), leaves)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)

    # the calls it made: prompts and lone sequences are not padded to anything longer than themselves, nor is a
    # continuation padded to its (longer) prompt; a small batch stays one call
    layout = batch.layout(torch.device("cpu"), HEADS)
    padded = [tuple(group.index.shape) for group in layout.groups]
    if len(lengths) * HEADS * max(lengths) * 2 * max(lengths) <= kv_attention.SMALL_SCORES:
        assert padded == [(len(lengths), max(lengths))]
    else:
        for group in layout.groups:
            members = [i for i, s in enumerate(lengths) if (group.index[:, 0] == sum(lengths[:i])).any()]
            assert group.index.shape[1] == max(lengths[i] for i in members)
            assert group.causal == all(context[i] < 0 and lengths[i] == group.index.shape[1] for i in members)
            assert len({context[i] < 0 for i in members}) == 1  # continuations are not padded with prompts


@pytest.mark.parametrize("name", LAYOUTS)
def test_flex_attention_equals_the_padded_calls_forward_and_its_mask_backward(name):
    """FlexAttention over the whole row with PackedBatch's block mask (``flex=True``: the fused kernel on GPUs,
    eager here) gives the padded calls' outputs. Its backward has no CPU kernel: the same mask_mod, made dense
    (torch's ``create_mask``) under SDPA, gives the padded calls' gradients."""
    lengths, context = LAYOUTS[name]
    torch.manual_seed(1)
    total = sum(lengths)
    leaves = [torch.randn(1, h, total, DIM, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS)]
    weights = torch.randn(1, total, HEADS, DIM)
    batch = PackedBatch(lengths, context, flex=True)
    padded = _packed(0, *leaves, PackedBatch(lengths, context), SCALING)
    flex = _packed(0, *[x.detach() for x in leaves], batch, SCALING)
    torch.testing.assert_close(flex, padded.detach(), rtol=1e-5, atol=1e-5)
    dense = create_mask(batch.visible(torch.device("cpu")), None, None, total, total, device="cpu")
    masked = F.scaled_dot_product_attention(*leaves, attn_mask=dense, scale=SCALING, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(masked, padded, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad((masked * weights).sum(), leaves), torch.autograd.grad((padded * weights).sum(), leaves)
    for m, p in zip(*grads, strict=True):
        torch.testing.assert_close(m, p, rtol=1e-4, atol=1e-5)


async def test_training_with_flex_attention_on_cpu_is_refused_with_what_to_use(model):
    """FlexAttention has no backward on CPU: a step that asks for it says so, and nothing trains (the session's
    model, on the real engine)."""
    step = await model.get_step()
    group = TrajectoryGroup(
        Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, sampled("Hello", [1, 2, 3], [4, 5])],
                   reward=reward)
        for reward in (0.0, 1.0)
    )  # fmt: skip
    with pytest.raises(ValueError, match="attention='flex' trains on GPUs: FlexAttention has no backward on CPU"):
        await model.train([group], config=TrainConfig(attention="flex"))
    assert await model.get_step() == step
