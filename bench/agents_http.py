"""Concurrent chat agents against any OpenAI-compatible server: the client side of bench/sampler.py, shared by all
servers it compares (Flywheel's, vLLM's). Needs only the openai package, so vLLM's own virtualenv can run it."""

from __future__ import annotations

import asyncio
import time

import openai

TOPICS = ["cats", "the sea", "a robot", "winter", "a library", "trains", "the moon", "a market"]


def questions(n: int) -> list[str]:
    return [f"Tell me a short story about {TOPICS[i % len(TOPICS)]} (story {i})." for i in range(n)]


def follow_up(turn: int) -> dict:
    """What an agent's environment says between turns (a tool result, as a user turn so no tools are needed)."""
    return {"role": "user", "content": f"The tool returned {turn * 37 + 11}. Go on."}


async def http_run(base_url: str, model: str, n: int, new_tokens: int, turns: int) -> float:
    """n concurrent agents, each a conversation of ``turns`` requests; completion tokens per second."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)

    async def agent(q: str) -> int:
        messages, tokens = [{"role": "user", "content": q}], 0
        for turn in range(turns):
            r = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=new_tokens,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            tokens += r.usage.completion_tokens
            messages += [{"role": "assistant", "content": r.choices[0].message.content or ""}, follow_up(turn)]
        return tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(agent(q) for q in questions(n))))
    elapsed = time.perf_counter() - start
    await client.close()
    assert tokens == n * new_tokens * turns, tokens
    return tokens / elapsed
