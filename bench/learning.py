"""Learning per wall-clock: the calculator agent's validation accuracy after a fixed training time, Flywheel vs TRL.

Both sides start from the same warm start (Flywheel's SFT on 64 demonstrations, every weight, as the main job), then
train every weight with the same GRPO settings (DAPO loss, clip 0.2/0.28, lr 1e-5 constant, beta 0, 6 problems x 8
rollouts per step at T=0.7, the same problems in the same order) for the same wall-clock budget, with the same
reward (`task.reward` of the final answer) and the same multi-turn tool loop: TRL's GRPOTrainer runs the calculator
tool itself, given a chat template that renders Flywheel's default tool format (checked token for token against
Flywheel's renderer before training) and a Hermes tool-call parser. Each side runs in a fresh process; its clock
starts at its first step and excludes the snapshots taken when a step ends past budget x k / snapshots.
Afterwards every snapshot is evaluated the same way: Flywheel's engine, the same agent loop, greedy, on held-out
problems.

    .venv/bin/python bench/learning.py [--budget 600] [--snapshots 3] [--val 64]
    .venv/bin/python bench/learning.py --budget 60 --snapshots 1 --val 4 --sft-examples 8   # smoke test

Needs the `bench` extra (TRL). Writes bench/results/learning-<time>.json and .png and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from blocks import report, run_child  # bench/blocks.py
from credit import rollout, validate  # bench/credit.py: the calculator agent on run_agent, greedy validation
from machine import describe  # bench/machine.py

from flywheel.checkpoints import layout
from flywheel.examples.calculator import task
from flywheel.gather import gather_trajectory_groups
from flywheel.inference.chat import render_prompt, to_default_format
from flywheel.inference.loading import EMBEDDED_MODEL, resolve_model
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights
from flywheel.types import Trajectory, TrajectoryGroup

FULL = TrainedWeights(mode="full")
WEIGHTS = "model.safetensors"


def problems(args: argparse.Namespace) -> tuple[list[task.Problem], list[task.Problem]]:
    """(demonstrations, RL problems in the order both sides see them)."""
    pool = task.generate_problems("train", args.sft_examples + 400 * args.groups, seed=args.seed)
    return pool[: args.sft_examples], pool[args.sft_examples :]


def snapshot(weights: Path, base: Path, directory: Path) -> None:
    """A loadable model directory: the warm start's config and tokenizer files with these weights."""
    directory.mkdir(parents=True)
    for file in base.iterdir():
        if file.is_file() and file.name != WEIGHTS:
            shutil.copy(file, directory / file.name)
    shutil.copy(weights, directory / WEIGHTS)


# ---- phases, each in a fresh process ---------------------------------------------------------------------------


async def warm_start(out: Path, args: argparse.Namespace) -> dict:
    demos, _ = problems(args)
    base = resolve_model(args.model).path
    async with LocalBackend(path=out / "home") as backend:
        model = TrainableModel(name="sft", project="learning", base_model=str(base), trained_weights=FULL)
        await model.register(backend)
        trajectories = [
            Trajectory(messages_and_choices=task.demonstration(p), tools=[task.CALCULATOR_TOOL]) for p in demos
        ]
        await model.train_sft(
            trajectories, SFTConfig(learning_rate=5e-5, epochs=2, batch_size=8, micro_batch_tokens=1024)
        )
        checkpoint = layout.checkpoint_dir(backend.model_dir(model), await model.get_step())
        snapshot(checkpoint / WEIGHTS, base, out / "warm")
    return {"dir": str(out / "warm")}


class Clock:
    """Training time since the first step, less the time spent taking snapshots; says when one is due."""

    def __init__(self, budget: float, snapshots: int) -> None:
        self.marks = [budget * (k + 1) / snapshots for k in range(snapshots)]
        self.start: float | None = None
        self.excluded = 0.0

    def begin(self) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def elapsed(self) -> float:
        assert self.start is not None
        return time.perf_counter() - self.start - self.excluded

    def due(self) -> bool:
        """A snapshot is due (and the marks it passes are consumed)."""
        elapsed, before = self.elapsed(), len(self.marks)
        self.marks = [m for m in self.marks if m > elapsed]
        return len(self.marks) < before

    @contextlib.contextmanager
    def excluding(self) -> Iterator[None]:
        """Time spent inside does not count."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t0


async def train_flywheel(out: Path, args: argparse.Namespace) -> dict:
    warm = out / "warm"
    _, pool = problems(args)
    config = TrainConfig(learning_rate=args.lr, loss="dapo", micro_batch_tokens=1024)
    clock, steps, snaps = Clock(args.budget, args.snapshots), [], []
    async with LocalBackend(path=out / "home") as backend:
        model = TrainableModel(name="rl", project="learning", base_model=str(warm), trained_weights=FULL)
        await model.register(backend)
        while clock.marks:
            clock.begin()
            i = len(steps)
            batch = pool[i * args.groups : (i + 1) * args.groups]
            rng = random.Random(f"{args.seed}:{i}")
            groups = await gather_trajectory_groups(
                (TrajectoryGroup(rollout(model, p, temperature=args.temperature, seed=rng.randrange(2**31), air=False)
                                 for _ in range(args.group_size)) for p in batch),
                pbar_desc=None, max_exceptions=0.1,
            )  # fmt: skip
            metrics = await model.train(groups, config)
            rewards = [t.reward for g in groups for t in g.trajectories]
            steps.append({"step": i + 1, "elapsed": clock.elapsed(), "reward_mean": sum(rewards) / len(rewards),
                          "sequences": metrics.get("sequences")})  # fmt: skip
            with clock.excluding():
                if clock.due():  # a step whose groups all had equal rewards trains nothing and saves nothing
                    directory, trained = out / "flywheel" / f"step-{i + 1}", await model.get_step()
                    checkpoint = layout.checkpoint_dir(backend.model_dir(model), trained) if trained else warm
                    snapshot(checkpoint / WEIGHTS, warm, directory)
                    snaps.append({"step": i + 1, "elapsed": steps[-1]["elapsed"], "dir": str(directory)})
                await model.delete_checkpoints()
    return {"steps": steps, "snapshots": snaps}


def hermes_template() -> str:
    """SmolLM2's ChatML template extended to render tools exactly as Flywheel's default tool format does
    (flywheel/inference/chat.py): the tool list in the system prompt, calls as <tool_call> JSON, tool results as
    user turns in <tool_response>. The tool block is this task's (``task.CALCULATOR_TOOL``), a constant."""
    block = to_default_format([{"role": "system", "content": ""}], [task.CALCULATOR_TOOL])[0]["content"]
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    return (
        "{%- set block = " + json.dumps(block) + " -%}"
        "{%- for message in messages -%}"
        "{%- set content = message['content'] if message['content'] is string else '' -%}"
        "{%- if loop.first and message['role'] != 'system' -%}"
        "{{ '<|im_start|>system\\n' + (" + json.dumps(block.lstrip()) + " if tools else " + json.dumps(default_system) + ") + '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- if message['role'] == 'system' -%}"
        "{{ '<|im_start|>system\\n' + content + (block if tools else '') + '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
        "{%- set ns = namespace(calls=[]) -%}"
        "{%- for call in message['tool_calls'] -%}"
        "{%- set fn = call['function'] -%}"
        "{%- set ns.calls = ns.calls + ['<tool_call>\\n' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) + '\\n</tool_call>'] -%}"
        "{%- endfor -%}"
        "{{ '<|im_start|>assistant\\n' + ((content + '\\n') if content else '') + (ns.calls | join('\\n')) + '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'tool' -%}"
        "{{ '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
        "{%- else -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )  # fmt: skip


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic expression to evaluate, using numbers only.
    """
    return task.calculator(expression)


def check_same_prompts(flywheel_tokenizer, trl_tokenizer, demos: list[task.Problem]) -> None:
    """TRL's prompts must be Flywheel's, token for token, or the comparison is of two different tasks."""
    for problem in demos[:8]:
        conversation = task.demonstration(problem)
        ours = [render_prompt(flywheel_tokenizer, conversation[:cut], [task.CALCULATOR_TOOL]) for cut in (2, 4)]
        for message in conversation:  # TRL's parser yields arguments as objects
            for call in message.get("tool_calls", []):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        for cut, expected in zip((2, 4), ours):  # before the first turn, and after the tool result
            theirs = trl_tokenizer.apply_chat_template(
                conversation[:cut], tools=[calculator], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if list(theirs) != expected:
                raise AssertionError(f"TRL's prompt differs from Flywheel's for {problem.id} (first {cut} messages)")


def train_trl(out: Path, args: argparse.Namespace) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template  # Qwen's tool calls are Hermes <tool_call> JSON, as ours

    warm = out / "warm"
    demos, pool = problems(args)
    tokenizer = AutoTokenizer.from_pretrained(warm)
    tokenizer.chat_template = hermes_template()
    check_same_prompts(AutoTokenizer.from_pretrained(warm), tokenizer, demos)
    tokenizer.response_template = qwen3_template
    by_id = {p.id: p for p in pool}
    clock, steps, snaps = Clock(args.budget, args.snapshots), [], []

    def final_text(completion: list[dict]) -> str:
        last = completion[-1] if completion else {}
        return "" if last.get("role") != "assistant" or last.get("tool_calls") else last.get("content") or ""

    def reward(completions, problem_id, **_):
        return [task.reward(by_id[i], final_text(c)) for c, i in zip(completions, problem_id)]

    class Snapshots(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, targs, state, control, model=None, **kwargs):
            steps.append({"step": state.global_step, "elapsed": clock.elapsed()})
            with clock.excluding():
                if clock.due():
                    directory = out / "trl" / f"step-{state.global_step}"
                    with tempfile.TemporaryDirectory() as tmp:
                        model.save_pretrained(tmp, safe_serialization=True)
                        snapshot(Path(tmp) / WEIGHTS, warm, directory)
                    snaps.append({"step": state.global_step, "elapsed": steps[-1]["elapsed"], "dir": str(directory)})
            if not clock.marks:
                control.should_training_stop = True

        def on_log(self, targs, state, control, logs=None, **kwargs):  # after on_step_end of the same step
            if steps and logs and "reward" in logs:
                steps[-1]["reward_mean"] = logs["reward"]

    rows = [{"prompt": [{"role": "system", "content": task.SYSTEM_PROMPT}, {"role": "user", "content": p.question}],
             "problem_id": p.id} for p in pool]  # fmt: skip
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # Flywheel's engine uses bf16 exactly where this holds
    config = GRPOConfig(
        output_dir=str(out / "trl_out"), use_cpu=True, bf16=bf16, max_steps=len(pool) // args.groups,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        # all 48 completions generated at once, trained in micro-batches of 8 (one batch of 48 at fp32 with a 49k
        # vocabulary needs ~7 GB for the logits alone: it was killed for memory), one optimizer step per 48
        per_device_train_batch_size=args.group_size, num_generations=args.group_size,
        gradient_accumulation_steps=args.groups, steps_per_generation=args.groups, temperature=args.temperature, top_p=1.0, max_completion_length=4 * 96,
        max_tool_calling_iterations=3, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0,
        scale_rewards="group", num_iterations=1, gradient_checkpointing=False, shuffle_dataset=False,
        logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, seed=args.seed,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32), reward_funcs=[reward], args=config,
        train_dataset=Dataset.from_list(rows), processing_class=tokenizer, tools=[calculator], callbacks=[Snapshots()],
    )  # fmt: skip
    trainer.train()
    return {"steps": steps, "snapshots": snaps}


async def evaluate(out: Path, args: argparse.Namespace) -> dict:
    """Greedy validation accuracy of every snapshot, one after another, the same way for both sides."""
    val = task.generate_problems("val", args.val, seed=args.seed)
    directories = json.loads((out / "to_evaluate.json").read_text())
    accuracy = {}
    for i, directory in enumerate(directories):
        async with LocalBackend(path=out / "eval_home") as backend:
            model = TrainableModel(name=f"eval-{i}", project="learning", base_model=directory, trained_weights=FULL)
            await model.register(backend)
            accuracy[directory] = await validate(model, val)
        print(f"{directory}: {accuracy[directory]:.1%}", flush=True)
    return {"accuracy": accuracy}


PHASES = {"warm": warm_start, "flywheel": train_flywheel, "trl": train_trl, "eval": evaluate}


def run_phase(phase: str, out: Path) -> dict:
    """One phase in a fresh process (this script with ``--phase``): no thread pools or allocator state shared."""
    return run_child(__file__, [*sys.argv[1:], "--phase", phase, "--work", str(out)], f"phase {phase}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for side in ("flywheel", "trl"):
        points = [(0.0, report["warm"]["accuracy"])] + [
            (s["elapsed"] / 60, s["accuracy"]) for s in report[side]["snapshots"]
        ]
        ax.plot(*zip(*points), marker="o", label=f"{side} ({len(report[side]['steps'])} steps)")
    ax.set_xlabel("training wall-clock (minutes)")
    ax.set_ylabel(f"validation accuracy ({report['config']['val']} problems, greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.set_title("Calculator agent: learning per wall-clock")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flywheel-learning-") as tmp:
        out = Path(tmp)
        warm = run_phase("warm", out)
        report: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                        "machine": describe()}  # fmt: skip
        for side in ("flywheel", "trl"):
            report[side] = run_phase(side, out)
            print(
                f"{side}: {len(report[side]['steps'])} steps in {report[side]['steps'][-1]['elapsed']:.0f} s",
                flush=True,
            )
        snaps = [s for side in ("flywheel", "trl") for s in report[side]["snapshots"]]
        (out / "to_evaluate.json").write_text(json.dumps([warm["dir"], *[s["dir"] for s in snaps]]))
        accuracy = run_phase("eval", out)["accuracy"]
    report["warm"] = {"accuracy": accuracy[warm["dir"]]}
    for s in snaps:
        s["accuracy"] = accuracy.pop(s["dir"])
        del s["dir"]
    report["wall_seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(report, stem.with_suffix(".png"))
    print(f"\nwarm start: {report['warm']['accuracy']:.1%} on {args.val} validation problems\n")
    print("| side | steps in budget | s/step | snapshots: minutes -> accuracy |")
    print("|---|---|---|---|")
    for side in ("flywheel", "trl"):
        steps = report[side]["steps"]
        points = ", ".join(f"{s['elapsed'] / 60:.1f} -> {s['accuracy']:.1%}" for s in report[side]["snapshots"])
        print(f"| {side} | {len(steps)} | {steps[-1]['elapsed'] / len(steps):.1f} | {points} |")
    print(f"\nresults: {stem.with_suffix('.json')}  plot: {stem.with_suffix('.png')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=600.0, help="training seconds per side")
    parser.add_argument("--snapshots", type=int, default=3)
    parser.add_argument("--groups", type=int, default=6, help="problems per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per problem")
    parser.add_argument("--val", type=int, default=64, help="validation problems")
    parser.add_argument("--sft-examples", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        phase = PHASES[args.phase]
        result = asyncio.run(phase(args.work, args)) if asyncio.iscoroutinefunction(phase) else phase(args.work, args)
        report(result)
    else:
        main(args)
