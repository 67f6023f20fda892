"""The engine's forward pass for Llama-architecture models, written out instead of going through the HF forward.

What makes it faster than the generic forward at sampling time (the figures: docs/benchmarks.md, "Design figures
behind code choices"):
- none of the HF forward's per-call work (output capture, mask creation, keyword plumbing through each module);
- q/k/v and gate/up as one GEMM each on stacked packed weights (``PackedLinears.ready``, ``run``): fewer, larger
  calls; with peft's LoRA layers, their A matrices are stacked in too (a LoRA decode step is faster than with
  peft's own forward);
- each group's plan (what stacks, the packed weights) kept between calls instead of made from peft's attributes;
- the rotary embedding applied to queries and keys at once, in 4 operators instead of 14 (``_rotate``);
- the plans checked once per forward and the packed GEMMs called directly on [tokens, hidden] activations, the
  norms written inline (the same operators): Python overhead weighs most at one row, where a step is shortest.
It calls the model's own submodules for everything else (the rotary embedding's cos/sin with its scaling,
activation, LoRA layers that cannot be stacked), and its logits are bit-identical to the HF forward's (tested).
Training keeps the HF forward; models of other architectures sample through it too (``supports`` is False).
``CompiledDecode`` is the opt-in compiled decode step: the same layer loop on tensors only, for torch.compile.
"""

from __future__ import annotations

import os
import shutil

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaRMSNorm

from flywheel.inference.kv_attention import DecodeBatch, PrefillBatch, attend, decode_attention
from flywheel.inference.packed_linear import Gemm, PackedLinears, run


def supports(model: torch.nn.Module) -> bool:
    """Exactly Llama's classes (a subclass may change a forward), e.g. SmolLM2, Llama 3, TinyLlama."""
    return (
        type(model) is LlamaForCausalLM
        and type(model.model.norm) is LlamaRMSNorm
        and all(
            type(layer) is LlamaDecoderLayer
            and type(layer.input_layernorm) is type(layer.post_attention_layernorm) is LlamaRMSNorm
            for layer in model.model.layers
        )
    )


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward``, the same operators in the same order (so the same bits), without a module call."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _linear(x: torch.Tensor, modules: tuple[torch.nn.Module, ...], gemm: Gemm | None) -> torch.Tensor:
    """The modules' outputs on ``x`` [tokens, in], concatenated: from one stacked GEMM where the packer has one
    for them, else module by module."""
    if gemm is not None:
        return run(gemm, x)
    return torch.cat([m(x) for m in modules], dim=-1) if len(modules) > 1 else modules[0](x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` for queries and keys at once ([tokens, heads, d]), in 4 operators instead of 14:
    ``rotate_half(x) * sin`` is ``x`` rolled by half a head times ``sin`` with its first half negated, to the bit."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _inputs(model: LlamaForCausalLM, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The embedded ``ids`` [R, T] as [tokens, hidden], and the rotary cos and signed sin [tokens, 1, head_dim]."""
    inner = model.model
    x = inner.embed_tokens(ids)  # [R, T, hidden]
    cos, sin = inner.rotary_emb(x, positions)  # [R, T, head_dim]
    half = cos.shape[-1] // 2
    sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return x.flatten(0, 1), cos.flatten(0, 1)[:, None], sin_signed.flatten(0, 1)[:, None]


def _groups(model: LlamaForCausalLM) -> list[tuple[tuple[torch.nn.Module, ...], ...]]:
    """Per layer, the linears that run as one GEMM each: q/k/v, o, gate/up, down."""
    return [
        ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj), (m.down_proj,))
        for a, m in ((layer.self_attn, layer.mlp) for layer in model.model.layers)
    ]


def logits(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    positions: torch.Tensor,
    batch: PrefillBatch | DecodeBatch,
    keep: torch.Tensor | int,
    packed: PackedLinears | None,
) -> torch.Tensor:
    """Logits [R, K, V] of the ``keep`` positions (indices, or the last ``keep``) of ``ids`` [R, T] at
    ``positions`` [R, T]: what ``model(input_ids=ids, position_ids=positions, logits_to_keep=keep, kv_batch=batch)``
    returns."""
    inner, config = model.model, model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    rows, length = ids.shape
    x, cos, sin_signed = _inputs(
        model, ids, positions
    )  # every linear and norm works on tokens; attention sees [R, heads, T, d]
    groups = _groups(model)
    # the plans are checked once per forward here, not at every call (a few microseconds each, 121 a step)
    packs = packed is not None and x.device.type == "cpu"
    gemms = [tuple(packed.ready(g, x.dtype) if packs else None for g in gs) for gs in groups]
    for layer, (qkv_g, o_g, gate_up_g, down_g), (qkv_p, o_p, gate_up_p, down_p) in zip(inner.layers, groups, gemms):
        attn, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        qkv = _linear(_norm(x, norm1.weight, norm1.variance_epsilon), qkv_g, qkv_p).view(
            -1, heads + 2 * kv_heads, attn.head_dim
        )
        qk = _rotate(qkv[:, : heads + kv_heads], cos, sin_signed).view(rows, length, heads + kv_heads, attn.head_dim)
        v = qkv[:, heads + kv_heads :].view(rows, length, kv_heads, attn.head_dim)
        q, k = qk[:, :, :heads], qk[:, :, heads:]
        out = attend(attn.layer_idx, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch, attn.scaling)
        x = x + _linear(out.reshape(rows * length, -1), o_g, o_p)
        gate, up = _linear(_norm(x, norm2.weight, norm2.variance_epsilon), gate_up_g, gate_up_p).chunk(2, dim=-1)
        x = x + _linear(mlp.act_fn(gate) * up, down_g, down_p)
    x = x.view(rows, length, -1)
    x = x[:, keep] if isinstance(keep, torch.Tensor) else x[:, -keep:]
    return model.lm_head(inner.norm(x))


def cxx_compiler_found() -> bool:
    """Whether a C++ compiler is on PATH (``CXX``, g++, clang++ or c++): what ``CompiledDecode`` needs on CPU."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c)


class CompiledDecode:
    """The decode step (one new token per row) compiled with ``torch.compile``: opt-in (``InferenceEngine(compile=
    True)``, ``flywheel serve --compile``), as inductor's CPU backend builds C++ kernels, so it needs a C++ compiler,
    and compiling takes minutes per process on a small CPU (less with inductor's on-disk cache warm).

    What it buys is the step's ~1,500 small operators fused into a few dozen kernels and run without Python in
    between: a shorter step, most of all at one row; less so at 32 rows, where GEMMs dominate (docs/benchmarks.md).
    The GEMMs stay oneDNN's on the same packed weights, which are inputs of the graph: a training step's new
    weights are new inputs, not a recompile. Fused kernels round bf16 less often than eager operators, so its
    logits are not bit-identical to the HF forward's (eager ones are); measured against an fp32 forward they are
    as close as the eager step's. Prefill and anything without a packed GEMM for every group (a LoRA variant, a
    GPU) stays eager (``logits`` returns None)."""

    def __init__(self, model: LlamaForCausalLM, packed: PackedLinears):
        self.model, self.packed = model, packed
        self._step = torch.compile(_decode_step, dynamic=False)  # dynamic dims are marked (``logits``)

    def logits(self, ids: torch.Tensor, lengths: torch.Tensor, batch: DecodeBatch) -> torch.Tensor | None:
        """Logits [R, 1, V] of ``ids`` [R, 1] at ``lengths`` (what ``logits`` returns for a decode step), or None
        where some group has no packed GEMM."""
        model, inner, config = self.model, self.model.model, self.model.config
        dtype = inner.embed_tokens.weight.dtype
        # the groups looked up each step, as in ``logits``: a trainer injects LoRA layers after the engine starts
        gemms = [[self.packed.ready(g, dtype) for g in gs] for gs in _groups(model)]
        head = self.packed.ready((model.lm_head,), dtype)
        if head is None or any(g is None for gs in gemms for g in gs):
            return None
        x, cos, sin_signed = _inputs(model, ids, lengths[:, None])
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        slots, bias = batch.layout(heads // kv_heads)
        layers = [
            (layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down, k, v)
            for layer, (qkv, o, gate_up, down), k, v in zip(inner.layers, gemms, batch.cache.k, batch.cache.v)
        ]
        # Rows and cache sizes vary from step to step: marked dynamic, one graph serves them all (plus one for a single
        # row, which torch.compile specialises). Unmarked, each new size would stall decoding to compile again.
        dynamic = [(t, 0) for t in (x, cos, sin_signed, slots, bias)] if len(ids) > 1 else []
        dynamic += [(bias, 2)] + [(t, d) for t in (*batch.cache.k, *batch.cache.v) for d in (0, 2)]
        for t, d in dynamic:
            torch._dynamo.mark_dynamic(t, d)
        attn = inner.layers[0].self_attn
        out = self._step(
            x,
            cos,
            sin_signed,
            slots,
            bias,
            layers,
            inner.norm.weight,
            head,
            inner.layers[0].mlp.act_fn,
            heads,
            kv_heads,
            attn.head_dim,
            inner.norm.variance_epsilon,
            attn.scaling,
        )
        return out[:, None]


# Not merged with ``logits``' loop: torch.compile traces tensors only; that one calls modules (prefill, unpacked groups)
def _decode_step(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    slots: torch.Tensor,
    bias: torch.Tensor,
    layers: list[tuple],
    final_norm: torch.Tensor,
    head: Gemm,
    act: torch.nn.Module,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    scaling: float,
) -> torch.Tensor:
    """``logits``' layer loop for one decode step, on tensors only (what ``torch.compile`` traces): ``x`` [B,
    hidden] the new tokens, ``layers`` per layer (norm weight, q/k/v GEMM, o GEMM, norm weight, gate/up GEMM,
    down GEMM, K buffer, V buffer). Logits [B, V]."""
    rows = x.shape[0]
    for norm1, qkv_g, o_g, norm2, gate_up_g, down_g, k_buffer, v_buffer in layers:
        qkv = run(qkv_g, _norm(x, norm1, eps)).view(rows, heads + 2 * kv_heads, head_dim)
        qk = _rotate(qkv[:, : heads + kv_heads], cos, sin_signed)
        q, k, v = qk[:, :heads, None], qk[:, heads:, None], qkv[:, heads + kv_heads :, None]  # [B, heads, 1, d]
        out = decode_attention(q, k, v, k_buffer, v_buffer, slots, bias, scaling)
        x = x + run(o_g, out.reshape(rows, -1))
        gate, up = run(gate_up_g, _norm(x, norm2, eps)).chunk(2, dim=-1)
        x = x + run(down_g, act(gate) * up)
    return run(head, _norm(x, final_norm, eps))
