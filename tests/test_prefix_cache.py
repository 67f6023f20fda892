"""Prefix caching: shared prompts and earlier turns are reused, results do not change, weight updates clear it."""

from __future__ import annotations

import torch

from flywheel.inference.chat import render_prompt
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.kv_attention import SlotKVCache
from flywheel.inference.prefix_cache import MIN_REUSE, PrefixCache
from flywheel.inference.sampling import SamplingParams

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 12}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def test_rows_are_reused_evicted_and_never_shared():
    like = SlotKVCache(2, 1, 4, dtype=torch.float32, device="cpu")
    like.reserve(1, 64)
    cache = PrefixCache(like, max_entries=2)
    for layer in range(2):
        like.k[layer][0, :, :40] = torch.arange(40.0)[None, :, None]
    a, b, c = list(range(20)), list(range(100, 130)), list(range(200, 240))
    cache.insert(a, like, 0)
    cache.insert(a + [7] * 10, like, 0)  # extends a: a's row is reused, not duplicated
    assert list(cache.entries.values()) == [a + [7] * 10]
    cache.insert(b, like, 0)
    cache.insert(c, like, 0)  # full: the least recently used entry (a+...) goes
    assert sorted(map(tuple, cache.entries.values())) == sorted([tuple(b), tuple(c)])
    assert len(set(cache.entries)) == 2 and cache.allocated == 2
    row, n, logits = cache.lookup(c + [1, 2])
    assert n == len(c) and logits is None and cache.entries[row] == c
    assert cache.lookup(list(range(300, 300 + MIN_REUSE + 5)))[1] == 0
    assert torch.equal(cache.store.k[1][row, :, :40], like.k[1][0, :, :40])


def test_the_kv_cache_grows_close_to_its_need_and_keeps_its_contents():
    """48 rows of ~700 tokens get 48 x 768 slots, not the 64 x 1024 that doubling gave (half the memory)."""
    cache = SlotKVCache(2, 1, 4, dtype=torch.float32, device="cpu", max_rows=64, max_capacity=2048)
    cache.reserve(5, 300)
    assert (cache.rows, cache.capacity) == (8, 384)
    cache.k[1][4, 0, :300] = torch.arange(300.0)[:, None]
    cache.reserve(48, 700)
    assert (cache.rows, cache.capacity) == (48, 768)
    assert torch.equal(cache.k[1][4, 0, :300], torch.arange(300.0)[:, None].expand(300, 4))
    assert not cache.k[1][4, 0, 300:].any() and not cache.k[1][5:].any()
    cache.reserve(48, 769)  # one token more: 25% more capacity, so a slowly growing need does not copy every step
    assert cache.capacity == 1024
    cache.reserve(70, 4000)  # beyond the limits: what is asked for, no rounding past it
    assert (cache.rows, cache.capacity) == (70, 4000)


def test_a_decoding_cache_keeps_its_capacity_close_to_the_longest_row():
    """Decoding attends over the whole capacity (so the buffers are read in place, never copied per layer): it grows
    in steps of WINDOW_STEP tokens, shrinks once two steps are unused, and keeps every stored token either way."""
    from flywheel.inference.kv_attention import WINDOW_STEP as S

    cache = SlotKVCache(2, 1, 4, dtype=torch.float32, device="cpu", max_rows=64, max_capacity=2048)
    cache.fit(3, 40)
    assert (cache.rows, cache.capacity) == (8, S)
    cache.k[0][2, 0, :40] = torch.arange(40.0)[:, None]
    buffer = cache.k[0]
    cache.fit(3, S)  # still fits: nothing moves
    assert cache.k[0] is buffer
    cache.fit(3, S + 1)
    assert cache.capacity == 2 * S and torch.equal(cache.k[0][2, 0, :40], torch.arange(40.0)[:, None].expand(40, 4))
    cache.fit(3, 5 * S)
    cache.fit(3, 3 * S + 1)  # 2 steps unused, less one token: kept
    assert cache.capacity == 5 * S
    cache.fit(3, 3 * S)  # 2 steps unused: shrunk to the need, contents kept
    assert cache.capacity == 3 * S and torch.equal(cache.k[0][2, 0, :40], torch.arange(40.0)[:, None].expand(40, 4))
    cache.fit(3, 2047)  # the limit bounds the rounding
    assert cache.capacity == 2048


def test_emptying_keeps_small_buffers_zeroed_and_gives_large_ones_back(monkeypatch):
    """Around a training step the caches are emptied: small buffers stay (the next sampling phase would grow them
    again), zeroed; buffers over KEEP_BYTES are released."""
    from flywheel.inference import kv_attention

    cache = SlotKVCache(2, 1, 4, dtype=torch.float32, device="cpu")
    cache.fit(3, 40)
    cache.k[1][2, 0, :40] = 1.0
    buffer = cache.k[1]
    cache.empty()
    assert (
        cache.k[1] is buffer and (cache.rows, cache.capacity) != (0, 0) and not any(t.any() for t in cache.k + cache.v)
    )
    monkeypatch.setattr(kv_attention, "KEEP_BYTES", buffer.nbytes * 4 - 1)  # 4 buffers: one byte too many
    cache.empty()
    assert (cache.rows, cache.capacity) == (0, 0) and cache.k == []


async def test_shared_system_prompt_is_reused_without_changing_results(fp32_engine: InferenceEngine, tokenizer):
    engine = fp32_engine
    pc = engine.prefix_cache
    first = render_prompt(tokenizer, [SYSTEM, {"role": "user", "content": "Name a colour."}])
    second = render_prompt(tokenizer, [SYSTEM, {"role": "user", "content": "Name a fruit."}])
    with engine.exclusive():
        pass  # start from an empty cache
    cold = (await engine.generate(second, GREEDY))[0].token_ids
    with engine.exclusive():
        pass
    await engine.generate(first, GREEDY)
    hits, reused = pc.hits, pc.reused_tokens
    warm = (await engine.generate(second, GREEDY))[0].token_ids
    assert pc.hits == hits + 1
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert pc.reused_tokens - reused >= shared - 1 > 40
    assert warm == cold


async def test_next_turn_reuses_the_finished_turn(engine: InferenceEngine, tokenizer):
    pc = engine.prefix_cache
    messages = [SYSTEM, {"role": "user", "content": "Say hello."}]
    prompt = render_prompt(tokenizer, messages)
    reply = (await engine.generate(prompt, GREEDY))[0]
    follow = render_prompt(
        tokenizer, [*messages, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "Again."}]
    )
    assert (
        follow[: len(prompt) + len(reply.token_ids)] == prompt + reply.token_ids
    )  # the template renders history as sampled
    reused = pc.reused_tokens
    await engine.generate(follow, GREEDY)
    assert pc.reused_tokens - reused >= len(prompt) + len(reply.token_ids) - 1


async def test_weight_updates_clear_the_cache(engine: InferenceEngine, tokenizer):
    await engine.generate(render_prompt(tokenizer, [SYSTEM, {"role": "user", "content": "hi"}]), GREEDY)
    assert engine.prefix_cache.entries
    with engine.exclusive():
        pass
    assert not engine.prefix_cache.entries and not engine.prefix_cache.logits
