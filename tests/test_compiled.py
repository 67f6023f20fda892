"""The opt-in compiled decode step (``InferenceEngine(compile=True)``): torch.compile with inductor, for real (it
builds C++ kernels with the machine's compiler). A small Llama of the embedded model's architecture, randomly
initialised and in float32, keeps compiling to seconds; its numbers are compared with the eager decode step's,
which the other tests tie to the HF forward."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from flywheel.inference import llama_forward
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.kv_attention import DecodeBatch, PrefillBatch
from flywheel.inference.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not llama_forward.cxx_compiler_found(), reason="torch.compile needs a C++ compiler on CPU"
)


def small_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def decode_both(engine: InferenceEngine, rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager and compiled logits of one decode step of ``rows`` rows after prompts of ``length`` tokens, each
    from the same cache contents; and that both wrote the same K/V."""
    model = engine.model
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 512, (rows, length), generator=gen)
    step = torch.randint(0, 512, (rows, 1), generator=gen)
    lengths = torch.full((rows,), length)
    out, stored = [], []
    with torch.inference_mode():
        engine.cache.fit(rows, length + 1)
        for compiled in (False, True):
            for r in range(rows):
                prefill = PrefillBatch(engine.cache, rows=[r], starts=[0], lengths=[length])
                llama_forward.logits(model, prompt[r : r + 1], torch.arange(length)[None], prefill, 1, engine._packed)
            batch = DecodeBatch(engine.cache, lengths=lengths)
            if compiled:
                out.append(engine._compiled.logits(step, lengths, batch))
            else:
                out.append(llama_forward.logits(model, step, lengths[:, None], batch, 1, engine._packed))
            stored.append([k[:rows, :, : length + 1].clone() for k in engine.cache.k + engine.cache.v])
    for eager_kv, compiled_kv in zip(*stored):
        torch.testing.assert_close(compiled_kv, eager_kv, rtol=1e-5, atol=1e-5)
    return out[0], out[1]


async def test_compiled_decode_step_gives_the_eager_steps_logits_without_compiling_again(tokenizer):
    """Compiled once for one row and once for several (before serving); then rows, cache sizes and weights change
    without a new graph, and the logits stay those of the eager step (and follow a weight update)."""
    model = small_llama()
    engine = InferenceEngine(model, tokenizer, compile=True, prefix_cache_entries=0)
    try:
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))  # served after the warm-up
        assert engine._compiled is not None  # it did not fall back to eager
        warm = graphs()
        assert warm >= 2  # one graph for one row, one for several (compiled by this engine or an earlier one)
        for rows, length, seed in ((1, 5, 0), (3, 70, 1), (5, 200, 2), (1, 300, 3)):  # capacities 64 .. 320
            eager, compiled = decode_both(engine, rows, length, seed)
            assert compiled.shape == eager.shape == (rows, 1, 512)
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
        with engine.exclusive(), torch.no_grad():  # what a training step does: weights updated in place
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        eager, compiled = decode_both(engine, 4, 40, 4)
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
        before = decode_both(engine, 4, 40, 4)[1]
        assert graphs() == warm
        # a second model of the same architecture (a checkpoint's engine) reuses the graphs
        other = InferenceEngine(small_llama(seed=1), tokenizer, compile=True, prefix_cache_entries=0)
        try:
            await other.generate([1, 2, 3], SamplingParams(max_tokens=2))
            eager, compiled = decode_both(other, 2, 30, 5)
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
            assert not torch.allclose(decode_both(other, 4, 40, 4)[1], before)  # its own weights
        finally:
            other.close()
        assert graphs() == warm
    finally:
        engine.close()


async def test_compiled_engine_samples_the_same_tokens_as_an_eager_one(tokenizer):
    """Concurrent seeded requests (n > 1, rows joining and leaving) through a compiled engine and an eager one
    over the same weights draw the same tokens with the same log-probabilities."""
    model = small_llama(seed=2)
    compiled = InferenceEngine(model, tokenizer, compile=True)
    eager = InferenceEngine(model, tokenizer)
    try:
        prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
        params = [SamplingParams(max_tokens=m, seed=s, n=n) for m, s, n in ((12, 1, 1), (20, 2, 3), (7, 3, 2))]
        results = []
        for engine in (compiled, eager):
            results.append(await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params))))
        for got, want in zip(*results):
            assert [c.token_ids for c in got] == [c.token_ids for c in want]
            for c, w in zip(got, want):
                assert c.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert compiled._compiled is not None
    finally:
        compiled.close()
        eager.close()


async def test_compiled_step_runs_lora_adapters_stacked(tokenizer):
    """A peft LoRA adapter on all seven projections: the compiled step adds the B products as the eager one does."""
    from peft import LoraConfig, get_peft_model

    model = small_llama(seed=3)
    engine = InferenceEngine(model, tokenizer, compile=True, prefix_cache_entries=0)
    try:
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
        peft_model.eval()
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.2)  # peft starts B at zero: the adapter would add nothing
        eager, compiled = decode_both(engine, 3, 50, 6)
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
        assert any(plan.gemm is not None and plan.gemm.b_t is not None for plan in engine._packed._plans.values())
    finally:
        engine.close()


FALLBACK = """
import asyncio, json, sys
from transformers import AutoTokenizer
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.sampling import SamplingParams
sys.path.insert(0, sys.argv[2])
from test_compiled import small_llama
model, tokenizer = small_llama(), AutoTokenizer.from_pretrained(sys.argv[1])
params = SamplingParams(max_tokens=9, seed=7)
tokens = []
for compile in (True, False):
    engine = InferenceEngine(model, tokenizer, compile=compile)
    tokens.append(asyncio.run(engine.generate([4, 5, 6], params))[0].token_ids)
    if compile:
        fell_back = engine._compiled is None
    engine.close()
print(json.dumps({"fell_back": fell_back, "compiled": tokens[0], "eager": tokens[1]}))
"""


def test_a_compile_failure_falls_back_to_the_eager_step(tokenizer, tmp_path):
    """Inductor pointed at a C++ compiler that does not exist (a fault caused for real: ``CXX`` is read when torch
    starts, hence a process of its own, with an empty inductor cache so that no compiled graph hides it), while a
    working one is on PATH: the engine logs the failure and serves every request with the eager step."""
    env = os.environ | {"CXX": str(tmp_path / "no-such-c++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    args = [sys.executable, "-c", FALLBACK, tokenizer.name_or_path, os.path.dirname(__file__)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fell_back"] and result["compiled"] == result["eager"] and len(result["eager"]) == 9
    assert "the compiled decode step failed; decoding eagerly from now on" in out.stderr
    assert "InvalidCxxCompiler" in out.stderr


def test_compile_says_what_it_needs(tokenizer, monkeypatch, tmp_path):
    """No C++ compiler on PATH (an empty directory), or a model the compiled step does not cover: a clear error
    at construction, not a failure at the first request."""
    model = small_llama()
    with pytest.raises(ValueError, match="pack_weights=True|Leave compile off"):
        InferenceEngine(model, tokenizer, compile=True, pack_weights=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        InferenceEngine(model, tokenizer, compile=True)
