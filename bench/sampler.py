"""Sampler throughput: concurrent chat requests through Flywheel's HTTP server vs plain batched ``generate``.

Same model, same prompts, 64 new tokens per request (EOS ignored, so every side does the same work), in one
run, alternating sides. With ``--turns T`` each concurrent client is a multi-turn agent: T requests, each
followed by an environment message, the whole conversation sent again every turn (as agents over the OpenAI API
do); plain ``generate`` runs the same agents turn by turn as one batch. Writes bench/results/sampler-<time>.json
and prints a markdown table.

    .venv/bin/python bench/sampler.py [--concurrency 1 8 32] [--runs 3] [--new-tokens 64] [--turns 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import openai
import torch

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from machine import describe  # bench/machine.py

TOPICS = ["cats", "the sea", "a robot", "winter", "a library", "trains", "the moon", "a market"]


def questions(n: int) -> list[str]:
    return [f"Tell me a short story about {TOPICS[i % len(TOPICS)]} (story {i})." for i in range(n)]


def follow_up(turn: int) -> dict:
    """What an agent's environment says between turns (a tool result, as a user turn so no tools are needed)."""
    return {"role": "user", "content": f"The tool returned {turn * 37 + 11}. Go on."}


async def http_run(base_url: str, n: int, new_tokens: int, turns: int) -> float:
    """n concurrent agents, each a conversation of ``turns`` requests; completion tokens per second."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)

    async def agent(q: str) -> int:
        messages, tokens = [{"role": "user", "content": q}], 0
        for turn in range(turns):
            r = await client.chat.completions.create(
                model=EMBEDDED_MODEL, messages=messages, max_tokens=new_tokens, temperature=1.0,
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


def generate_run(model, tokenizer, n: int, new_tokens: int, turns: int) -> float:
    """The same agents with plain ``generate``: every turn, all conversations as one left-padded batch."""
    tokenizer.padding_side = "left"
    conversations = [[{"role": "user", "content": q}] for q in questions(n)]
    start = time.perf_counter()
    for turn in range(turns):
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                                 pad_token_id=tokenizer.pad_token_id)
        assert out.shape[1] - batch["input_ids"].shape[1] == new_tokens
        replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        for c, reply in zip(conversations, replies):
            c += [{"role": "assistant", "content": reply}, follow_up(turn)]
    elapsed = time.perf_counter() - start
    return n * new_tokens * turns / elapsed


def summary(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "runs": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=1, help="requests per agent (>1: multi-turn conversations)")
    args = ap.parse_args()

    model, tokenizer, _ = load_model(EMBEDDED_MODEL)  # bf16 where the CPU has it
    registry = ModelRegistry()
    engine = InferenceEngine(model, tokenizer)
    registry.add(EMBEDDED_MODEL, engine)
    server = BackgroundServer(create_app(registry)).start()
    # plain generate gets its own copies: in the dtype the engine uses, and fp32 (what from_pretrained gives)
    plain = {str(model.dtype).removeprefix("torch."): load_model(EMBEDDED_MODEL, dtype=model.dtype)[0]}
    plain["float32"] = load_model(EMBEDDED_MODEL, dtype=torch.float32)[0]
    for m in plain.values():
        m.set_attn_implementation("sdpa")

    asyncio.run(http_run(server.base_url, 4, 8, 1))  # warm-up
    results = []
    for n in args.concurrency:
        ours: list[float] = []
        theirs: dict[str, list[float]] = {k: [] for k in plain}
        for _ in range(args.runs):  # alternate sides so drift on the machine hits both
            ours.append(asyncio.run(http_run(server.base_url, n, args.new_tokens, args.turns)))
            for k, m in plain.items():
                theirs[k].append(generate_run(m, tokenizer, n, args.new_tokens, args.turns))
        row = {"concurrency": n, "flywheel_http": summary(ours)}
        row.update({f"generate_{k}": summary(v) for k, v in theirs.items()})
        results.append(row)
        print(json.dumps(row), flush=True)
    server.stop()
    engine.close()

    machine = describe() | {"dtype": str(model.dtype)}
    out = Path(__file__).parent / "results" / f"sampler-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "new_tokens": args.new_tokens, "turns": args.turns, "results": results}, indent=2))
    keys = [k for k in results[0] if k != "concurrency"]
    print(f"\n{machine}\n")
    print(f"{args.turns} turn(s) of {args.new_tokens} new tokens per agent")
    print("| concurrent agents | " + " | ".join(f"{k} tok/s (median [min, max])" for k in keys) + " | flywheel / generate |")
    print("|---" * (len(keys) + 2) + "|")
    for r in results:
        cells = [f"{r[k]['median']:.0f} [{r[k]['min']:.0f}, {r[k]['max']:.0f}]" for k in keys]
        ratios = ", ".join(f"{r['flywheel_http']['median'] / r[k]['median']:.2f}x vs {k[9:]}" for k in keys[1:])
        print(f"| {r['concurrency']} | " + " | ".join(cells) + f" | {ratios} |")
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
