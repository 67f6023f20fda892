"""Credit assignment and automatic intermediate rewards on the calculator agent: uniform vs turn, AIR on vs off.

Every arm starts from the same SFT warm start (one SFT run, its checkpoint copied into each arm), then runs the
same number of GRPO steps on the same scenarios with the same sampling seeds; rollouts go through ``run_agent``
with the calculator tool (its "Error: ..." answers count as failed calls for AIR). Validation is greedy on held-out
problems. Writes bench/results/credit-<time>.json and .png and prints a table.

    .venv/bin/python bench/credit.py                       # the full comparison (hours on a 2-core CPU)
    .venv/bin/python bench/credit.py --steps 1 --groups 1 --group-size 2 --val 2 --sft-examples 8   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flywheel.agents import AIRConfig, Tool, ToolError, final_answer, run_agent
from flywheel.checkpoints import layout
from flywheel.examples.calculator import task
from flywheel.gather import gather_trajectory_groups
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.train.config import SFTConfig, TrainConfig
from flywheel.types import Trajectory, TrajectoryGroup

ARMS = {  # name -> (credit, AIR on)
    "uniform": ("uniform", False),
    "uniform+air": ("uniform", True),
    "turn": ("turn", False),
    "turn+air": ("turn", True),
}
MAX_TURNS, MAX_TOKENS = 4, 96


def calculator_tool() -> Tool:
    def calculator(expression: str) -> str:
        result = task.calculator(expression)
        if result.startswith("Error:"):
            raise ToolError(result.removeprefix("Error: "))  # the model reads the same text; AIR sees a failure
        return result

    spec = task.CALCULATOR_TOOL["function"]
    # the exact schema of the SFT demonstrations, so the prompt RL sees is the one SFT taught
    tool = dataclasses.replace(
        Tool.from_function(calculator), description=spec["description"], parameters=spec["parameters"]
    )
    assert tool.schema == task.CALCULATOR_TOOL
    return tool


async def rollout(
    model: TrainableModel, problem: task.Problem, *, temperature: float, seed: int | None, air: bool
) -> Trajectory:
    messages = [{"role": "system", "content": task.SYSTEM_PROMPT}, {"role": "user", "content": problem.question}]
    traj = await run_agent(
        model.openai_client(),
        model,
        messages,
        [calculator_tool()],
        MAX_TURNS,
        temperature=temperature,
        max_tokens=MAX_TOKENS,
        air=AIRConfig() if air else None,
        metadata={"problem_id": problem.id},
        seed=seed,
    )
    traj.reward = task.reward(problem, final_answer(traj))
    return traj


def train_pool(args: argparse.Namespace) -> list[task.Problem]:
    return task.generate_problems("train", 2000, seed=args.seed)


async def validate(model: TrainableModel, problems: list[task.Problem]) -> float:
    groups = await gather_trajectory_groups(
        (TrajectoryGroup([rollout(model, p, temperature=0.0, seed=None, air=False)]) for p in problems),
        pbar_desc=None,
        max_exceptions=len(problems),  # a failed episode counts as unsolved
    )
    return sum(t.reward for g in groups for t in g.trajectories) / len(problems)


async def warm_start(home: Path, args: argparse.Namespace, val: list[task.Problem]) -> tuple[Path, float]:
    """SFT once; its checkpoint directory and the validation accuracy it reaches."""
    backend = LocalBackend(path=home)
    try:
        model = TrainableModel(name="sft", project="credit", base_model=args.model)
        await model.register(backend)
        demos = [
            Trajectory(messages_and_choices=task.demonstration(p), tools=[task.CALCULATOR_TOOL])
            for p in train_pool(args)[: args.sft_examples]
        ]
        await model.train_sft(demos, SFTConfig(learning_rate=3e-4, epochs=2, batch_size=8))
        step = await model.get_step()
        return layout.checkpoint_dir(backend.model_dir(model), step), await validate(model, val)
    finally:
        await backend.close()


async def run_arm(
    name: str, home: Path, sft: Path, sft_val: float, args: argparse.Namespace, val: list[task.Problem]
) -> list[dict]:
    credit, air = ARMS[name]
    config = TrainConfig(learning_rate=args.lr, loss="dapo", credit=credit)
    backend = LocalBackend(path=home)
    try:
        model = TrainableModel(name=name, project="credit", base_model=args.model)
        shutil.copytree(sft, layout.checkpoints_dir(backend.model_dir(model)) / sft.name)  # register() resumes from it
        await model.register(backend)
        pool = train_pool(args)[args.sft_examples :]  # RL scenarios the warm start never showed
        rows = [{"step": 0, "val/reward": sft_val}]
        for i in range(args.steps):
            rng = random.Random(f"{args.seed}:{i}")  # same scenarios and sampling seeds in every arm
            scenarios = rng.sample(pool, args.groups)
            seeds = [[rng.randrange(2**31) for _ in range(args.group_size)] for _ in scenarios]
            groups = await gather_trajectory_groups(
                (
                    TrajectoryGroup(rollout(model, p, temperature=args.temperature, seed=s, air=air) for s in ss)
                    for p, ss in zip(scenarios, seeds)
                ),
                pbar_desc=None,
                max_exceptions=0.1,
            )
            trajectories = [t for g in groups for t in g.trajectories]
            metrics = await model.train(groups, config)
            row = {"step": i + 1, **metrics}
            for key in ("air_reward", "tool_calls", "tool_errors", "bad_arguments", "repeated_calls", "turns"):
                row[key] = sum(float(t.metrics.get(key, 0.0)) for t in trajectories) / max(len(trajectories), 1)
            if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
                row["val/reward"] = await validate(model, val)
            rows.append(row)
        return rows
    finally:
        await backend.close()


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in results.items():
        line = ax.plot(
            *zip(*[(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]), marker="o", label=f"{name} (val)"
        )
        train = [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r]
        if train:
            ax.plot(*zip(*train), linestyle=":", color=line[0].get_color(), alpha=0.6)
    ax.set_xlabel("GRPO step after the SFT warm start")
    ax.set_ylabel("accuracy (val: solid, greedy; train rollouts: dotted)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.set_title("Calculator agent: credit assignment and AIR")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def main(args: argparse.Namespace) -> None:
    console = Console()
    start = time.perf_counter()
    val = task.generate_problems("val", args.val, seed=args.seed)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="flywheel-credit-") as tmp:
        home = Path(tmp)
        sft, sft_val = await warm_start(home, args, val)
        console.print(f"SFT warm start: val accuracy {sft_val:.1%}")
        for name in args.arms:
            t0 = time.perf_counter()
            results[name] = await run_arm(name, home, sft, sft_val, args, val)
            console.print(f"{name}: done in {time.perf_counter() - t0:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"credit-{time.strftime('%Y%m%d-%H%M%S')}"
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_seconds": time.perf_counter() - start,
        "arms": results,
    }
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plot(results, stem.with_suffix(".png"))

    table = Table(
        title=f"Calculator agent, {args.steps} GRPO steps x {args.groups} groups x {args.group_size} rollouts, val {args.val} (greedy)"
    )
    for col in (
        "arm",
        "val after SFT",
        "final val",
        "best val",
        "train reward (last 4 steps)",
        "AIR / rollout",
        "tool errors / rollout",
    ):
        table.add_column(col)
    for name, rows in results.items():
        vals = [r["val/reward"] for r in rows if "val/reward" in r]
        last = rows[1:][-4:]
        mean = {
            key: sum(r.get(key, 0.0) for r in last) / max(len(last), 1)
            for key in ("reward_mean", "air_reward", "tool_errors")
        }
        table.add_row(
            name,
            f"{vals[0]:.1%}",
            f"{vals[-1]:.1%}",
            f"{max(vals):.1%}",
            f"{mean['reward_mean']:.1%}",
            f"{mean['air_reward']:.3f}",
            f"{mean['tool_errors']:.2f}",
        )
    console.print(table)
    console.print(f"results: {stem.with_suffix('.json')}  plot: {stem.with_suffix('.png')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--groups", type=int, default=6, help="scenarios per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per scenario")
    parser.add_argument("--val", type=int, default=32, help="validation problems")
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--sft-examples", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    asyncio.run(main(parser.parse_args()))
