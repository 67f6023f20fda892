"""The batching engine on the real model: batching must not change results, and every parameter must act."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from flywheel.inference.chat import render_prompt
from flywheel.inference.engine import ContextOverflowError, InferenceEngine
from flywheel.inference.sampling import SamplingParams

QUESTIONS = [
    "What is 12 + 7?",
    "Name three colors.",
    "Write one sentence about the sea.",
    "hi",
    "List the days of the week.",
    "What is the capital of France? Answer in one word, then explain why it is famous in two sentences.",
]


def prompts(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    return [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]


GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


async def test_the_embedded_engine_is_a_sampling_engine_and_serves_through_the_seam(engine: InferenceEngine, tokenizer):
    """What the server and gateway use of an engine (``SamplingEngine``) is all an engine must have: the embedded
    one has it, and sampling through the protocol's members alone gives tokens with log-probs."""
    import inspect

    from flywheel.inference.protocol import SamplingEngine

    assert isinstance(engine, SamplingEngine)
    for name in ("check_fits", "stream", "generate", "close"):  # the same signatures, not only the same names
        assert inspect.signature(getattr(engine, name)) == inspect.signature(getattr(SamplingEngine, name).__get__(engine)), name  # fmt: skip
    seam: SamplingEngine = engine
    prompt = seam.tokenizer.encode("Hello")
    seam.check_fits(len(prompt), 4)
    with pytest.raises(ContextOverflowError):
        seam.check_fits(len(prompt), seam.context_length)
    [completion] = await seam.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=True))
    assert completion.token_ids and len(completion.logprobs) == len(completion.token_ids)
    events = [event async for event in seam.stream(prompt, SamplingParams(max_tokens=4, temperature=0.0))]
    assert [t for e in events for t in e.token_ids] == completion.token_ids and events[-1].finish_reason


async def test_concurrent_requests_match_sequential_at_temperature_zero(fp32_engine: InferenceEngine, tokenizer):
    engine = fp32_engine
    ps = prompts(tokenizer)
    sequential = [(await engine.generate(p, GREEDY))[0] for p in ps]
    concurrent = [r[0] for r in await asyncio.gather(*(engine.generate(p, GREEDY) for p in ps))]
    assert [c.text for c in concurrent] == [s.text for s in sequential]
    assert [c.token_ids for c in concurrent] == [s.token_ids for s in sequential]
    assert all(s.text for s in sequential)


async def test_requests_joining_a_running_batch_get_the_same_tokens(fp32_engine: InferenceEngine, tokenizer):
    engine = fp32_engine
    ps = prompts(tokenizer)
    long_params = SamplingParams(temperature=0.0, max_tokens=60)
    alone = (await engine.generate(ps[2], long_params))[0]
    expected = [(await engine.generate(p, GREEDY))[0].token_ids for p in ps[:3]]

    async def late(p, delay):
        await asyncio.sleep(delay)
        return (await engine.generate(p, GREEDY))[0].token_ids

    long_task = asyncio.create_task(engine.generate(ps[2], long_params))
    joined = await asyncio.gather(late(ps[0], 0.3), late(ps[1], 0.6), late(ps[2], 0.9))
    assert joined == expected
    assert (await long_task)[0].token_ids == alone.token_ids


async def test_greedy_matches_transformers_generate(fp32_engine: InferenceEngine, tokenizer):
    engine = fp32_engine
    p = prompts(tokenizer)[1]
    ours = (await engine.generate(p, GREEDY))[0].token_ids
    with engine.exclusive(), torch.inference_mode():
        model = engine.model
        model.set_attn_implementation("sdpa")
        try:
            ref = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :].tolist()
        finally:
            model.set_attn_implementation("flywheel")
    assert ours[: len(ref)] == ref


async def test_n_shares_prefill_and_seed_is_reproducible(engine: InferenceEngine, tokenizer):
    p = prompts(tokenizer)[2]
    params = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=1234)
    first = await engine.generate(p, params)
    again = await engine.generate(p, params)
    assert [c.index for c in first] == [0, 1, 2, 3]
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1, "n samples should differ from each other"
    other = await engine.generate(p, SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=99))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


async def test_seeded_sample_does_not_depend_on_batch_neighbours(engine: InferenceEngine, tokenizer):
    ps = prompts(tokenizer)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7)
    alone = (await engine.generate(ps[0], params))[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=16)
    results = await asyncio.gather(engine.generate(ps[0], params), *(engine.generate(p, noisy) for p in ps[1:]))
    assert results[0][0].token_ids == alone


async def test_max_tokens_and_stop(engine: InferenceEngine, tokenizer):
    p = prompts(tokenizer)[4]
    capped = (await engine.generate(p, SamplingParams(temperature=0.0, max_tokens=5)))[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 5
    full = (await engine.generate(p, SamplingParams(temperature=0.0, max_tokens=40)))[0]
    assert "Tuesday" in full.text
    stopped = (await engine.generate(p, SamplingParams(temperature=0.0, max_tokens=40, stop=["Tuesday"])))[0]
    assert stopped.finish_reason == "stop"
    assert "Tuesday" not in stopped.text
    assert full.text.startswith(stopped.text)
    assert stopped.text == full.text[: full.text.index("Tuesday")]


async def test_eos_finishes_with_stop(engine: InferenceEngine, tokenizer):
    c = (await engine.generate(prompts(tokenizer)[3], SamplingParams(temperature=0.0, max_tokens=100)))[0]
    assert c.finish_reason == "stop"
    assert c.token_ids[-1] in engine.eos_ids
    assert "<|im_end|>" not in c.text


async def test_logprobs_are_those_of_the_distribution_sampled_from(fp32_engine: InferenceEngine, tokenizer):
    engine = fp32_engine
    p = prompts(tokenizer)[0]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, seed=3, logprobs=True, top_logprobs=3)
    c = (await engine.generate(p, params))[0]
    assert len(c.logprobs) == len(c.token_ids) == len(c.top_logprobs)
    assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
    for chosen_lp, top in zip(c.logprobs, c.top_logprobs):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]
        assert chosen_lp <= top[0][1] + 1e-6
    # recompute with a plain full forward pass: the engine's cached decode must agree
    ids = torch.tensor([p + c.token_ids])
    with engine.exclusive(), torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
    # at the sampling temperature (T = 0.7), before top-p truncation: what the trainer scores the tokens under
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs), ref, atol=2e-3)


async def test_top_p_restricts_to_the_nucleus(fp32_engine: InferenceEngine, tokenizer):
    # fp32: in bf16 a near-tie may round the other way between two calls of different shapes (the second call's
    # prompt comes from the prefix cache), which is the engine's arithmetic, not top-p (seen on Intel AMX)
    p = prompts(tokenizer)[2]
    tiny = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, n=3)
    greedy = [c.token_ids for c in await fp32_engine.generate(p, SamplingParams(temperature=0.0, max_tokens=12, n=3))]
    assert [c.token_ids for c in await fp32_engine.generate(p, tiny)] == greedy


async def test_a_non_streaming_request_gets_one_event_per_choice(engine: InferenceEngine, tokenizer):
    """``generate`` takes each choice whole when it finishes (fewer wake-ups of the caller's loop while decoding),
    and loses nothing on the way: every token, log-probability and character of text."""
    params = SamplingParams(max_tokens=12, n=2, ignore_eos=True, logprobs=True, top_logprobs=2, seed=5)
    events = [e async for e in engine._events(prompts(tokenizer)[1], params, whole=True)]
    assert sorted(e.index for e in events) == [0, 1]
    for e in events:
        assert len(e.token_ids) == len(e.logprobs) == len(e.top_logprobs) == 12 and e.finish_reason == "length"
        assert e.text_delta == tokenizer.decode(e.token_ids)
    streamed = [e async for e in engine.stream(prompts(tokenizer)[1], params)]
    assert len(streamed) == 24  # a stream gets every token as it comes
    for e in events:
        assert [t for s in streamed if s.index == e.index for t in s.token_ids] == e.token_ids


async def test_identical_prompts_arriving_together_are_prefilled_once(
    fp32_engine: InferenceEngine, tokenizer, monkeypatch
):
    """A GRPO group sends one prompt G times at once: the engine prefills it once and copies its cache rows, and
    every request gets what it would get alone."""
    import time

    from flywheel.inference.kv_attention import PrefillBatch

    engine, prompt = fp32_engine, prompts(tokenizer)[5]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    with engine.exclusive():
        pass  # an empty prefix cache: it would otherwise supply the prompt
    alone = (await engine.generate(prompt, params))[0]
    with engine.exclusive():
        pass
    prefilled: list[list[int]] = []
    forward = engine._forward

    def observed(ids, positions, batch, keep):  # records what each prefill computes, then runs it unchanged
        if isinstance(batch, PrefillBatch):
            prefilled.append(list(batch.lengths))
        return forward(ids, positions, batch, keep)

    monkeypatch.setattr(engine, "_forward", observed)
    busy = asyncio.create_task(engine.call(time.sleep, 0.5))  # the four requests queue up meanwhile
    await asyncio.sleep(0.1)
    together = await asyncio.gather(*(engine.generate(prompt, params) for _ in range(4)))
    await busy
    assert prefilled == [[len(prompt)]]
    assert all(r[0].token_ids == alone.token_ids for r in together)  # same seed, same tokens


async def test_context_overflow_is_refused(engine: InferenceEngine):
    with pytest.raises(ContextOverflowError, match=str(engine.context_length)):
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=engine.context_length))


async def test_abandoned_stream_frees_its_row(engine: InferenceEngine, tokenizer):
    p = prompts(tokenizer)[2]
    stream = engine.stream(p, SamplingParams(temperature=1.0, max_tokens=500))
    async for _ in stream:
        break
    await stream.aclose()
    await asyncio.sleep(0.3)
    assert engine._running == []  # the engine dropped it instead of decoding 500 tokens for nobody
    assert (await engine.generate(p, GREEDY))[0].token_ids


async def test_call_runs_on_the_engine_thread_between_steps(engine: InferenceEngine, tokenizer):
    import threading

    p = prompts(tokenizer)[2]
    decoding = asyncio.ensure_future(
        engine.generate(p, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
    )
    await asyncio.sleep(0.05)
    # while a request decodes, a call still runs, on the worker thread, and the request finishes afterwards
    assert await engine.call(lambda a, b: (threading.current_thread() is engine._thread, a + b), 2, 3) == (True, 5)
    with pytest.raises(ZeroDivisionError):  # the caller gets the call's exception; the engine keeps serving
        await engine.call(lambda: 1 / 0)
    assert len((await decoding)[0].token_ids) == 40
    assert (await engine.generate(p, GREEDY))[0].token_ids


async def test_packed_weights_give_the_models_own_numbers_and_follow_weight_changes(tokenizer):
    """Sampling runs the linears on oneDNN-packed copies of their weights. Against an engine without them: the same
    greedy tokens and log-probabilities, also after a weight changes in place behind the engine's back (the packed
    copy is keyed on the weight's version, so it is repacked, never sampled stale)."""
    from flywheel.inference.loading import EMBEDDED_MODEL, load_model
    from flywheel.inference.packed_linear import packing_available

    engines = []
    try:
        for pack in (True, False):
            model, tok, _ = load_model(EMBEDDED_MODEL, dtype=torch.float32)  # fp32 packs on every x86 CPU
            engines.append(InferenceEngine(model, tok, pack_weights=pack, prefix_cache_entries=0))
        packed, plain = engines
        assert packing_available(packed.model) and packed._packed is not None and plain._packed is None
        params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=True)
        ps = prompts(tokenizer)[:3]

        async def both() -> tuple[list, list]:
            return [[(await e.generate(p, params))[0] for p in ps] for e in engines]

        async def agree() -> list[list[int]]:
            a, b = await both()
            assert [c.token_ids for c in a] == [c.token_ids for c in b]
            for x, y in zip(a, b):
                assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3)
            return [c.token_ids for c in a]

        seen = [await agree()]
        # in-place updates outside engine.exclusive(), which only the version key can notice: a linear packed
        # alone (down_proj), then one packed stacked with others (up_proj, with gate_proj)
        for name in ("down_proj", "up_proj"):
            for e in engines:
                with torch.no_grad():
                    getattr(e.model.model.layers[0].mlp, name).weight.mul_(1.5)
            seen.append(await agree())
            assert seen[-1] != seen[-2]
    finally:
        for e in engines:
            e.close()


async def test_an_engine_whose_cpu_cannot_pack_falls_back_to_plain_linears(
    fp32_engine: InferenceEngine, tokenizer, monkeypatch, caplog
):
    """A oneDNN build or CPU that refuses to pack must cost speed, never a failed request. This machine packs
    fine, so the refusal is simulated (a fault that cannot be caused for real here)."""
    from flywheel.inference.packed_linear import PackedLinears

    prompt = prompts(tokenizer)[0]
    expected = (await fp32_engine.generate(prompt, GREEDY))[0]
    packed = fp32_engine._packed = PackedLinears(fp32_engine.model)  # takes over from the fixture's packer
    try:

        def refuse(*_):
            raise RuntimeError("no kernel for this CPU")

        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
        got = (await fp32_engine.generate(prompt, GREEDY))[0]
        assert packed.failed and "plain linears" in caplog.text
        assert got.token_ids == expected.token_ids
    finally:
        monkeypatch.undo()
        fp32_engine._packed = PackedLinears(fp32_engine.model)  # the fixture's engine packs again afterwards


AMX = "amx_tile" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
# On Intel AMX CPUs oneDNN's bf16 kernels round the stacked q/k/v and gate/up GEMMs otherwise than three separate
# ones (logits apart by up to 0.5, measured 2026-11-27): a known sampler/trainer gap there, which TIS corrects
BF16_ON_AMX = pytest.mark.xfail(AMX, reason="bf16 stacked GEMMs round differently on AMX (see the comment)")


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=BF16_ON_AMX), torch.float32])
def test_llama_forward_gives_the_hf_forwards_logits(tokenizer, dtype):
    """The engine runs Llama models through llama_forward (its own layer loop; q/k/v and gate/up as one GEMM on
    stacked packed weights). Prefill and decode logits must be exactly those of the HF forward over the same
    modules, also with LoRA adapters injected: stacked with their base weights where every layer of a group has one,
    module by module otherwise."""
    from peft import LoraConfig, get_peft_model

    from flywheel.inference import llama_forward
    from flywheel.inference.kv_attention import DecodeBatch, PrefillBatch
    from flywheel.inference.loading import EMBEDDED_MODEL, load_model
    from flywheel.inference.lora import fuse_lora_forward

    model, tok, _ = load_model(EMBEDDED_MODEL, dtype=dtype)
    engine = InferenceEngine(model, tok, prefix_cache_entries=0)
    try:
        assert llama_forward.supports(model)
        ps = prompts(tokenizer)[:3]
        ids = torch.tensor([t for p in ps for t in p])[None]
        pos = torch.cat([torch.arange(len(p)) for p in ps])[None]
        last = torch.tensor([len(p) for p in ps]).cumsum(0) - 1
        lengths = torch.tensor([len(p) for p in ps])
        step = torch.tensor([[11], [12], [13]])

        def both(exact: bool = True) -> list[torch.Tensor]:
            engine.cache.fit(len(ps), max(len(p) for p in ps) + 1)
            out = []
            with torch.inference_mode():
                for fast in (True, False):  # each writes the same K/V into the same cache rows
                    prefill = PrefillBatch(engine.cache, rows=[0, 1, 2], starts=[0, 0, 0], lengths=lengths.tolist())
                    decode = DecodeBatch(engine.cache, lengths=lengths)
                    if fast:
                        out += [
                            llama_forward.logits(model, ids, pos, prefill, last, engine._packed),
                            llama_forward.logits(model, step, lengths[:, None], decode, 1, engine._packed),
                        ]
                    else:
                        out += [
                            model(input_ids=ids, position_ids=pos, logits_to_keep=last, kv_batch=prefill).logits,
                            model(
                                input_ids=step, position_ids=lengths[:, None], logits_to_keep=1, kv_batch=decode
                            ).logits,
                        ]
            assert out[0].shape == (1, 3, model.config.vocab_size) and out[1].shape == (3, 1, model.config.vocab_size)
            for fast, hf in ((out[0], out[2]), (out[1], out[3])):
                if exact:
                    assert torch.equal(fast, hf)
                else:
                    torch.testing.assert_close(fast, hf, rtol=1e-5, atol=5e-4)
            return out

        stacks = engine._packed._plans if engine._packed is not None else {}  # where this CPU packs this dtype
        plain = both()
        assert engine._packed is None or any(
            len(group) == 3 and plan.gemm is not None for group, plan in stacks.items()
        )

        peft_model = None

        def adapt(name: str, targets: list[str]) -> list[torch.Tensor]:
            nonlocal peft_model
            config = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
            if peft_model is None:
                peft_model = get_peft_model(model, config, adapter_name=name)  # injected into ``model`` in place
            else:
                peft_model.add_adapter(name, config)
                peft_model.set_adapter(name)
            for p in model.parameters():  # adapters in the model's dtype, as the trainer keeps them
                p.data = p.data.to(dtype)
            fuse_lora_forward(model)  # as the trainer does: the layers' forward is the stacked groups' addmm
            model.eval()
            # the layers run A through torch's linear: oneDNN in bf16 (the same kernels, so exact), MKL in fp32
            # (another summation order than the stacked oneDNN GEMMs, so equal to rounding)
            adapted = both(exact=dtype == torch.bfloat16 or engine._packed is None)
            assert not torch.equal(adapted[0], plain[0])  # the adapter acts
            return adapted

        # some projections adapted: q (adapted) cannot stack with k and v (plain), so they run module by module
        adapt("default", ["q_proj", "v_proj", "gate_proj"])
        assert not any(plan.gemm is not None and plan.gemm.b_t is not None for plan in stacks.values())
        # all seven adapted: base weights and A matrices stacked, B matrices block-diagonal
        adapt("all", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        assert engine._packed is None or any(
            len(group) == 3 and plan.gemm is not None and plan.gemm.b_t is not None for group, plan in stacks.items()
        )
    finally:
        engine.close()


def test_an_open_engine_keeps_its_model_out_of_full_collections(tokenizer):
    """An automatic full garbage collection walks every tracked object (~480k with a model loaded: ~0.25 s holding
    the GIL, the engine stalled). An open engine freezes what is alive, its model included, so collections skip it;
    once closed, the model is collectable again (a frozen object in a reference cycle would never be freed)."""
    import gc

    from flywheel.inference.loading import EMBEDDED_MODEL, load_model

    model, tok, _ = load_model(EMBEDDED_MODEL)
    layer = model.model.layers[0]
    assert any(o is layer for o in gc.get_objects())
    engine = InferenceEngine(model, tok, prefix_cache_entries=0)
    try:
        assert not any(o is layer for o in gc.get_objects())  # frozen: in no generation a collection walks
        assert gc.get_freeze_count() > 0
    finally:
        engine.close()
    assert any(o is layer for o in gc.get_objects())


def test_decode_steps_reuse_their_memory_instead_of_faulting_in_fresh_pages(engine: InferenceEngine):
    """A decode step frees all it allocated; with glibc's default thresholds the heap's top went back to the OS
    after each step and the next step faulted ~15 MB in again at 32 rows (~3,800 page faults, ~3 ms of 54).
    With an engine started (keep_freed_memory), steady decode steps take next to no page faults."""
    import resource

    from flywheel.inference import llama_forward
    from flywheel.inference.kv_attention import DecodeBatch, SlotKVCache
    from flywheel.inference.sampling import sample

    model, rows = engine.model, 32
    cache = SlotKVCache(
        model.config.num_hidden_layers,
        model.config.num_key_value_heads,
        model.config.head_dim,
        dtype=model.dtype,
        device="cpu",
        max_rows=rows,
        max_capacity=256,
    )
    cache.fit(rows, 101)
    lengths, ids = torch.full((rows,), 100), torch.randint(0, 1000, (rows, 1))

    def step() -> None:
        logits = llama_forward.logits(
            model, ids, lengths[:, None], DecodeBatch(cache, lengths=lengths), 1, engine._packed
        )
        sample(logits[:, 0], [SamplingParams(temperature=1.0)] * rows, [None] * rows)

    with engine._model_lock, torch.inference_mode():  # the engine's thread stays out meanwhile
        for _ in range(3):
            step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            step()
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
    # a step that gives its memory back faults ~3,800 times; the count is the process's (other threads' too: 154
    # were seen in a CI run), so the bound sits well between
    assert faults < 500, f"{faults:.0f} page faults per decode step"
