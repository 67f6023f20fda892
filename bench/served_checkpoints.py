"""Decode speed of what the engine serves after training, against the base model, in ONE process.

Configurations, each an engine the production path gives (``registry.resolve`` of a served name, as the server and
the gateway's deployment aliases resolve them):

- ``base``: the base model (``LocalBackend.load``);
- ``lora`` / ``full``: a registered model's live weights after ``train_sft`` (a LoRA adapter; every weight);
- ``lora@1`` / ``full@1``: an earlier checkpoint of it, served by an engine of its own (``name@step``, what an
  alias such as ``calc@production`` pointing at an older step resolves to).

Before the other engines exist, the base model runs a few rounds alone (``base_alone``): the cost of sharing the
process with more engines (each worker thread has an OpenMP team of its own); with ``--threads 2 1``, also at each
of those OpenMP thread counts, interleaved. Then rounds interleave the
configurations (base, lora, lora@1, full, full@1, base, ...), the same prompts, greedy, EOS ignored: one prompt
alone and all prompts at once. Completion tokens per second, best and median of the rounds. Each engine's dtype,
LoRA layers (merged or not) and packed GEMM plans are recorded too. With ``--profile``, then each engine's
one-row decode step on its own thread: mean time and torch.profiler's top operators. Writes
bench/results/served_checkpoints-*.json.

    .venv/bin/python bench/served_checkpoints.py [--rounds 5] [--new-tokens 64] [--prompts 4] [--threads 2 1] [--profile] [--shared]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch
from machine import describe, save_result  # bench/machine.py
from peft.tuners.lora import Linear as LoraLinear
from torch.profiler import ProfilerActivity, profile

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.kv_attention import DecodeBatch
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.inference.sampling import SamplingParams
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.train.config import SFTConfig, TrainedWeights
from flywheel.types import Trajectory

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "Explain what a prime number is.",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "Say hello in Spanish.",
]
DEMOS = [
    Trajectory(messages_and_choices=[{"role": "user", "content": q}, {"role": "assistant", "content": "I can help."}])
    for q in QUESTIONS[:4]
]
LEARNING_RATE = {"lora": 1e-3, "full": 1e-5}


def engine_facts(engine: InferenceEngine) -> dict:
    """What decides a decode step's cost: weight dtypes, LoRA layers (merged or not), packed GEMM plans."""
    model = engine.model
    lora = [m for m in model.modules() if type(m) is LoraLinear]
    plans = list(engine._packed._plans.values()) if engine._packed is not None else []
    return {
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "requires_grad": sum(p.requires_grad for p in model.parameters()),
        "lora_layers": len(lora),
        "lora_merged": sum(bool(m.merged) for m in lora),
        "packed_plans": len(plans),
        "plans_without_gemm": sum(p.gemm is None for p in plans),
        "compiled": engine._compiled is not None,
    }


async def rate(engine: InferenceEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Completion tokens per second of ``prompts`` sent at once, greedy, ``new_tokens`` each."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for out in outs for c in out) / elapsed


def step_profile(engine: InferenceEngine, rows: int, steps: int, top: int) -> dict:
    """On the engine's thread (``engine.call``): the mean decode step at ``rows`` rows (100 cached tokens each), and
    torch.profiler's top operators by self CPU time over 10 such steps."""
    vocab = engine.model.config.vocab_size

    def step(i: int) -> None:
        lengths = torch.full((rows,), 100 + i)
        ids = torch.randint(0, vocab, (rows, 1))
        engine._decode_logits(ids, lengths, DecodeBatch(engine.cache, lengths=lengths))

    with torch.inference_mode():
        engine.cache.fit(rows, 100 + steps + 16)
        for i in range(3):
            step(i)
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        ms = (time.perf_counter() - start) / steps * 1000
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(10):
                step(i)
        engine.cache.release()
    return {"rows": rows, "step_ms": ms, "top": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)}


async def rounds(
    engines: dict[str, InferenceEngine], prompts: list[list[int]], args: argparse.Namespace, n: int
) -> dict[str, dict[str, list[float]]]:
    """``n`` rounds, configurations interleaved in each: one prompt alone, then all prompts at once."""
    got: dict[str, dict[str, list[float]]] = {name: {"1": [], str(len(prompts)): []} for name in engines}
    for engine in engines.values():  # warm-up: plans made, caches sized, prompts' prefixes cached
        await rate(engine, prompts, 8)
    for r in range(n):
        for name, engine in engines.items():
            got[name]["1"].append(await rate(engine, prompts[:1], args.new_tokens))
            got[name][str(len(prompts))].append(await rate(engine, prompts, args.new_tokens))
            print(
                f"round {r} {name}: " + ", ".join(f"{k} rows {v[-1]:.1f} tok/s" for k, v in got[name].items()),
                flush=True,
            )
    return got


async def thread_rounds(engine: InferenceEngine, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """The base engine at each of ``args.threads`` OpenMP threads (set on its own thread), interleaved: on a machine
    others load, a team of 2 waits at every parallel region for a thread the OS has not scheduled."""
    got: dict[str, dict[str, list[float]]] = {f"base_alone_{n}_threads": {"1": []} for n in args.threads}
    before = await engine.call(torch.get_num_threads)
    try:
        for _ in range(max(2, args.rounds // 2)):
            for n in args.threads:
                await engine.call(torch.set_num_threads, n)
                got[f"base_alone_{n}_threads"]["1"].append(await rate(engine, prompts[:1], args.new_tokens))
                print(f"base alone, {n} threads: {got[f'base_alone_{n}_threads']['1'][-1]:.1f} tok/s", flush=True)
    finally:
        await engine.call(torch.set_num_threads, before)
    return got


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as home:
        backend = LocalBackend(path=home, serve_http=False)
        try:
            base = await backend.load(EMBEDDED_MODEL)
            tok = base.tokenizer
            prompts = [
                tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
                    "input_ids"
                ]
                for q in QUESTIONS[: args.prompts]
            ]
            alone = await rounds({"base_alone": base}, prompts, args, max(2, args.rounds // 2))
            if args.threads:
                alone |= await thread_rounds(base, prompts, args)
            for mode in ("lora", "full"):
                model = TrainableModel(
                    name=mode, project="bench", base_model=EMBEDDED_MODEL, trained_weights=TrainedWeights(mode=mode)
                )
                await model.register(backend)
                for _ in range(2):  # steps 1 and 2, each with a checkpoint: name@1 is served by an engine of its own
                    await model.train_sft(DEMOS, SFTConfig(learning_rate=LEARNING_RATE[mode], batch_size=len(DEMOS)))
            names = {"base": EMBEDDED_MODEL, "lora": "lora", "lora@1": "lora@1", "full": "full", "full@1": "full@1"}
            engines = {label: (await backend.registry.resolve(name)).engine for label, name in names.items()}
            got = alone | await rounds(engines, prompts, args, args.rounds)
            facts = {label: engine_facts(engine) for label, engine in engines.items()}
            if args.profile:
                for label, engine in engines.items():
                    facts[label]["profile"] = got_profile = await engine.call(step_profile, engine, 1, 20, 12)
                    print(f"{label}: {got_profile['step_ms']:.1f} ms a one-row step\n{got_profile['top']}")
        finally:
            await backend.close()
    summary = {
        label: {rows: {"best": max(xs), "median": statistics.median(xs), "runs": xs} for rows, xs in by_rows.items()}
        for label, by_rows in got.items()
    }
    result = {
        "machine": describe() | {"shared": args.shared},
        "new_tokens": args.new_tokens,
        "prompts": args.prompts,
        "rounds": args.rounds,
        "engines": facts,
        "tokens_per_s": summary,
    }
    save_result("served_checkpoints", result)
    base_rate = {rows: s["median"] for rows, s in summary["base"].items()}
    base_rate |= {rows: s["median"] for rows, s in summary["base_alone"].items() if rows not in base_rate}
    print("| served | " + " | ".join(f"{rows} rows tok/s best / median (x base)" for rows in base_rate) + " |")
    print("|---" * (len(base_rate) + 1) + "|")
    for label, by_rows in summary.items():
        cells = [
            f"{by_rows[rows]['best']:.1f} / {by_rows[rows]['median']:.1f} ({by_rows[rows]['median'] / base:.2f}x)"
            if rows in by_rows
            else "-"
            for rows, base in base_rate.items()
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"threads {torch.get_num_threads()}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, nargs="*", default=[], help="first, the base alone at these thread counts")
    ap.add_argument("--profile", action="store_true", help="then each engine's one-row decode step, profiled")
    ap.add_argument("--shared", action="store_true", help="record that others used the machine meanwhile")
    asyncio.run(main(ap.parse_args()))
