"""RL step time: Flywheel vs TRL's GRPOTrainer on the same work, alternating blocks of steps, each in a fresh process.

Same work on both sides: SmolLM2-135M-Instruct (the embedded model as safetensors, bf16 weights with bf16 autocast),
the same prompts (tool-free calculator word problems), P prompts x G generations per step, exactly L new tokens per
completion (EOS ignored on both sides), the same dense reward, LoRA r16/alpha32 on all seven projections, DAPO loss
(clip 0.2/0.28, token mean), beta 0, one optimizer step per batch. A step is everything: sampling, reward, training.
TRL runs with gradient checkpointing off (its default is on, which is slower) and without vLLM.

    .venv/bin/python bench/step_time.py [--runs 3] [--steps 3] [--prompts 4] [--group 8] [--new-tokens 64] [--model DIR]

On a machine with CUDA both sides run on the GPU (the same script, nothing else to change).

Needs the `bench` extra (TRL). Writes bench/results/step_time-<time>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from blocks import report, run_child, summary  # bench/blocks.py
from machine import describe  # bench/machine.py
from trl_side import grpo_config, train_lora  # bench/trl_side.py

from flywheel.examples.calculator.task import extract_answer, generate_problems
from flywheel.gather import gather_trajectory_groups
from flywheel.inference.loading import EMBEDDED_MODEL, resolve_model
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.train.config import TrainConfig, TrainedWeights
from flywheel.types import Trajectory, TrajectoryGroup

LORA = TrainedWeights(rank=16, alpha=32)
LEARNING_RATE = 5e-5


def prompts(n: int) -> list[tuple[str, int]]:
    problems = generate_problems("train", n, levels=(1, 2), seed=1)
    return [(f"{p.question} Reply with the number only.", p.answer) for p in problems]


def closeness(text: str, answer: int) -> float:
    """Dense reward, so that every group has variance and both sides train every completion: 1 for the exact number,
    less the further off, plus a small share for distinct characters (which also separates the completions of a
    random-weight model, used where the real weights cannot travel, e.g. to a GPU machine)."""
    value = extract_answer(text)
    variety = len(set(text)) / max(len(text), 1)
    return (0.0 if value is None else 1.0 / (1.0 + abs(value - answer) / max(abs(answer), 1))) + 0.01 * variety


# ---- Flywheel --------------------------------------------------------------------------------------------------


async def flywheel_steps(
    model: TrainableModel, batches: list[list[tuple[str, int]]], group: int, new_tokens: int
) -> tuple[list[float], list[int]]:
    """Seconds per step, and sequences trained per step (groups with all-equal rewards are dropped: less work)."""
    client, config = model.openai_client(), TrainConfig(learning_rate=LEARNING_RATE, loss="dapo")

    async def rollout(question: str, answer: int) -> Trajectory:
        messages = [{"role": "user", "content": question}]
        r = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=messages,
            max_tokens=new_tokens,
            temperature=1.0,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == new_tokens
        return Trajectory(
            messages_and_choices=[*messages, r.choices[0]], reward=closeness(r.choices[0].message.content or "", answer)
        )

    times, trained = [], []
    for batch in batches:
        start = time.perf_counter()
        groups = await gather_trajectory_groups(
            (TrajectoryGroup(rollout(q, a) for _ in range(group)) for q, a in batch), pbar_desc=None
        )
        metrics = await model.train(groups, config=config)
        times.append(time.perf_counter() - start)
        trained.append(int(metrics.get("sequences", 0)))
    return times, trained


# ---- TRL -------------------------------------------------------------------------------------------------------


def trl_steps(
    path: str, batches: list[list[tuple[str, int]]], group: int, new_tokens: int, out_dir: Path
) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    def reward(completions, answer, **_):
        return [closeness(c[-1]["content"], a) for c, a in zip(completions, answer)]

    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a} for batch in batches for q, a in batch]
    config = grpo_config(
        output_dir=str(out_dir),
        use_cpu=not torch.cuda.is_available(),
        bf16=True,
        steps=len(batches),
        learning_rate=LEARNING_RATE,
        prompts=len(batches[0]),
        group=group,
        new_tokens=new_tokens,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(path)
    timer = StepTimer()
    train_lora(model, tokenizer, reward, config, rows, LORA, timer)
    return timer.times


# ---- driver ----------------------------------------------------------------------------------------------------


def run_block(side: str, run: int) -> dict:
    """Run one block in a child process (this script with ``--block``) and return what it printed."""
    return run_child(__file__, [*sys.argv[1:], "--block", side, str(run)], f"the {side} block of run {run}")


async def block(side: str, batches: list[list[tuple[str, int]]], args: argparse.Namespace) -> dict:
    """One side's block of steps (the first warms up), in this process."""
    path, results_dir = str(resolve_model(args.model).path), Path(__file__).parent / "results"
    if side == "trl":
        return {"seconds": trl_steps(path, batches, args.group, args.new_tokens, results_dir / "trl_out")}
    async with LocalBackend(path=results_dir / "step_time_home", serve_http=True) as backend:
        model = TrainableModel(name=f"run-{time.time_ns()}", project="bench", base_model=path, trained_weights=LORA)
        await model.register(backend)
        seconds, trained = await flywheel_steps(model, batches, args.group, args.new_tokens)
    return {"seconds": seconds, "trained": trained}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="alternating runs (each: TRL block, then Flywheel block)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per block (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default=EMBEDDED_MODEL, help="the embedded model (default) or a local HF checkpoint dir")
    ap.add_argument("--block", nargs=2, metavar=("SIDE", "RUN"), help=argparse.SUPPRESS)  # internal: one block
    args = ap.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    data = prompts((args.steps + 1) * args.prompts * args.runs)
    blocks = [
        [
            data[(r * (args.steps + 1) + s) * args.prompts : (r * (args.steps + 1) + s + 1) * args.prompts]
            for s in range(args.steps + 1)
        ]
        for r in range(args.runs)
    ]
    if args.block:
        side, run = args.block[0], int(args.block[1])
        report(await block(side, blocks[run], args))
        return
    results_dir = Path(__file__).parent / "results"
    results_dir.mkdir(exist_ok=True)
    tokens_per_step = args.prompts * args.group * args.new_tokens
    ours: list[float] = []
    theirs: list[float] = []
    sequences: list[int] = []
    for run in range(args.runs):
        # Each block in a fresh process, TRL first: neither side inherits the other's threads (a second thread's
        # OpenMP team slows the first's parallel regions on a small machine) or memory.
        trl, fly = (run_block(side, run) for side in ("trl", "flywheel"))
        theirs.append(statistics.median(trl["seconds"][1:]))
        ours.append(statistics.median(fly["seconds"][1:]))
        sequences += fly["trained"][1:]
        print(
            json.dumps(
                {
                    "run": run,
                    "trl_seconds": trl["seconds"],
                    "flywheel_seconds": fly["seconds"],
                    "flywheel_trained": fly["trained"],
                }
            ),
            flush=True,
        )

    result = {
        "machine": describe(),
        "work": {
            "model": args.model,
            "prompts": args.prompts,
            "group": args.group,
            "new_tokens": args.new_tokens,
            "lora": LORA.model_dump(),
            "loss": "dapo",
            "dtype": "bf16 weights + bf16 autocast",
        },
        "flywheel_step_seconds": summary(ours),
        "trl_step_seconds": summary(theirs),
        "ratio_trl_over_flywheel": summary([t / o for t, o in zip(theirs, ours)]),
        # TRL trains every completion; Flywheel drops groups whose rewards are all equal (no signal)
        "flywheel_trained_fraction": sum(sequences) / (len(sequences) * args.prompts * args.group),
    }
    out = results_dir / f"step_time-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['machine']}\n{result['work']}\n")
    print("| side | s/step median [min, max] | completion tokens trained/s (median) |")
    print("|---|---|---|")
    for side, key in (("Flywheel", "flywheel_step_seconds"), ("TRL GRPOTrainer", "trl_step_seconds")):
        s = result[key]
        print(f"| {side} | {s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}] | {tokens_per_step / s['median']:.0f} |")
    ratio = result["ratio_trl_over_flywheel"]
    print(
        f"\nTRL / Flywheel step time: {ratio['median']:.2f}x [{ratio['min']:.2f}, {ratio['max']:.2f}]; "
        f"Flywheel trained {result['flywheel_trained_fraction']:.0%} of the completions (TRL: all); raw: {out}"
    )


if __name__ == "__main__":
    asyncio.run(main())
