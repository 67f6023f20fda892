"""Sampler throughput: concurrent chat requests through Flywheel's HTTP server vs plain batched ``generate``.

Same model, same prompts, 64 new tokens per request (EOS ignored, so every side does the same work); each side
runs in a fresh process of its own per run (see bench/blocks.py), sides alternating. With ``--turns T`` each
concurrent client is a multi-turn agent: T requests, each followed by an environment message, the whole conversation sent again every turn (as agents over the OpenAI API
do); plain ``generate`` runs the same agents turn by turn as one batch. Writes bench/results/sampler-<time>.json
and prints a markdown table.

    .venv/bin/python bench/sampler.py [--concurrency 1 8 32] [--runs 3] [--new-tokens 64] [--turns 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import openai
import torch

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from blocks import report, run_child, summary  # bench/blocks.py
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


SIDES = ("flywheel_http", "generate_engine_dtype", "generate_float32")


def side_block(side: str, args: argparse.Namespace) -> dict:
    """One side, in this (fresh) process: a warm-up, then each concurrency once; tokens per second."""
    if side == "flywheel_http":
        model, tokenizer, _ = load_model(EMBEDDED_MODEL)  # bf16 where the CPU has it
        registry = ModelRegistry()
        engine = InferenceEngine(model, tokenizer)
        registry.add(EMBEDDED_MODEL, engine)
        server = BackgroundServer(create_app(registry)).start()
        try:
            asyncio.run(http_run(server.base_url, 4, 8, 1))
            rates = {n: asyncio.run(http_run(server.base_url, n, args.new_tokens, args.turns)) for n in args.concurrency}
        finally:
            server.stop()
            engine.close()
        return {"dtype": str(model.dtype), "rates": rates}
    dtype = torch.float32 if side == "generate_float32" else None  # else the engine's dtype
    model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=dtype)
    model.set_attn_implementation("sdpa")
    generate_run(model, tokenizer, 4, 8, 1)
    return {"dtype": str(model.dtype), "rates": {n: generate_run(model, tokenizer, n, args.new_tokens, args.turns) for n in args.concurrency}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=1, help="requests per agent (>1: multi-turn conversations)")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: one side's block
    args = ap.parse_args()
    if args.side:
        report(side_block(args.side, args))
        return

    # each side in a fresh process per run, sides alternating, so drift on the machine hits all of them
    rates: dict[str, dict[int, list[float]]] = {side: {n: [] for n in args.concurrency} for side in SIDES}
    dtypes: dict[str, str] = {}
    for run in range(args.runs):
        for side in SIDES:
            got = run_child(__file__, [*sys.argv[1:], "--side", side], f"{side} in run {run}")
            dtypes[side] = got["dtype"]
            for n, rate in got["rates"].items():
                rates[side][int(n)].append(rate)
            print(json.dumps({"run": run, "side": side, **got}), flush=True)
    results = [{"concurrency": n, **{side: summary(rates[side][n]) for side in SIDES}} for n in args.concurrency]

    machine = describe() | {"dtype": dtypes["flywheel_http"], "dtypes": dtypes}
    out = Path(__file__).parent / "results" / f"sampler-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "new_tokens": args.new_tokens, "turns": args.turns, "results": results}, indent=2))
    print(f"\n{machine}\n")
    print(f"{args.turns} turn(s) of {args.new_tokens} new tokens per agent")
    names = {side: side.replace("engine_dtype", dtypes["generate_engine_dtype"].removeprefix("torch.")) for side in SIDES}
    print("| concurrent agents | " + " | ".join(f"{names[k]} tok/s (median [min, max])" for k in SIDES) + " | flywheel / generate |")
    print("|---" * (len(SIDES) + 2) + "|")
    for r in results:
        cells = [f"{r[k]['median']:.0f} [{r[k]['min']:.0f}, {r[k]['max']:.0f}]" for k in SIDES]
        ratios = ", ".join(f"{r['flywheel_http']['median'] / r[k]['median']:.2f}x vs {names[k][9:]}" for k in SIDES[1:])
        print(f"| {r['concurrency']} | " + " | ".join(cells) + f" | {ratios} |")
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
