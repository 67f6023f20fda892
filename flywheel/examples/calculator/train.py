"""The main job: baseline -> SFT warm start -> GRPO with periodic validation -> best checkpoint -> report.

Everything runs in one process on the embedded model: rollouts go through the engine's OpenAI-compatible HTTP
API (as any agent would), training updates the LoRA adapter on the same model object.
"""

from __future__ import annotations

import json
import math
import random
import resource
import time
from pathlib import Path

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from flywheel.agents.curriculum import mixed_outcome_weight
from flywheel.backend import LocalBackend
from flywheel.examples.calculator.agent import rollout
from flywheel.examples.calculator.task import CALCULATOR_TOOL, Problem, demonstration, generate_problems
from flywheel.gather import gather_trajectory_groups
from flywheel.graders.evaluation import wilson
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.model import TrainableModel
from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights
from flywheel.types import Trajectory, TrajectoryGroup


class JobConfig(BaseModel):
    base_model: str = EMBEDDED_MODEL
    project: str = "calculator"
    name: str = "calculator-agent"
    seed: int = 0
    levels: list[int] = [1, 2, 3]
    # every weight trains: with a LoRA adapter (r8, all projections) level 3 stayed at ~42% after RL in every
    # setting tried (docs/benchmarks.md); ``with_lora()`` gives that variant
    trained_weights: TrainedWeights = TrainedWeights(mode="full")
    sft_examples: int = 64  # deliberately few: the warm start teaches the tool format, RL does the rest
    # 1024-token micro-batches: the same gradients as 2048 in two halves, ~1 GB less peak memory, a little slower
    sft: SFTConfig = SFTConfig(learning_rate=5e-5, epochs=2, batch_size=8, micro_batch_tokens=1024)
    rl_steps: int = 16
    groups_per_step: int = 6
    group_size: int = 8
    rl: TrainConfig = TrainConfig(learning_rate=1e-5, loss="dapo", micro_batch_tokens=1024)
    temperature: float = 0.7  # a 135M model at T=1 mostly produces noise: no group would have a success
    level_curriculum: bool = True  # draw RL problems by level, favouring the levels with mixed outcomes
    eval_every: int = 4
    val_problems: int = 64  # picks the best checkpoint: 32 problems (+-17 points) made that choice mostly noise
    test_problems: int = 100

    def with_lora(self) -> JobConfig:
        """The same job training a LoRA adapter instead of every weight, with the learning rates tuned for it."""
        return self.model_copy(update={
            "trained_weights": self.trained_weights.model_copy(update={"mode": "lora"}),
            # checkpointing: the LoRA job is the small-memory one (peak RSS 4.9 -> ~4 GB, docs/benchmarks.md)
            "sft": self.sft.model_copy(update={"learning_rate": 3e-4, "gradient_checkpointing": True}),
            "rl": self.rl.model_copy(update={"learning_rate": 1e-4, "gradient_checkpointing": True}),
        })  # fmt: skip


async def evaluate(model: TrainableModel, problems: list[Problem], desc: str) -> list[Trajectory]:
    groups = await gather_trajectory_groups(
        (TrajectoryGroup([rollout(model, p, temperature=0.0)]) for p in problems),
        pbar_desc=desc,
        max_exceptions=len(problems),
    )
    return [t for g in groups for t in g.trajectories]


async def warm_start(model: TrainableModel, demos: list[Trajectory], config: SFTConfig) -> list[dict[str, float]]:
    """SFT on the demonstrations with a progress bar: each step's loss and tokens per second, the time left."""
    steps = config.epochs * math.ceil(len(demos) / config.batch_size)  # one per batch (a non-finite one is skipped)
    with tqdm(total=steps, desc="SFT warm start", unit="step") as bar:

        def progress(metrics: dict[str, float]) -> None:  # on the engine's thread, after each step
            tokens_per_second = metrics["tokens_trained"] / metrics["train_seconds"]
            bar.set_postfix({"loss": f"{metrics['loss']:.3f}", "tokens/s": f"{tokens_per_second:.0f}"}, refresh=False)
            bar.update()

        return await model.train_sft(demos, config, progress=progress)


def accuracy(trajectories: list[Trajectory], n: int) -> float:
    return sum(t.reward for t in trajectories) / n if n else 0.0


class LevelCurriculum:
    """Draws RL problems by difficulty level with weight p (1 - p), p being the level's recent success rate at the
    sampling temperature (uniform prior): a level the policy nearly always solves (or never does) gives groups
    with equal rewards, which train nothing. Each problem is used once.

    The weighting is ``ScenarioPool``'s (``mixed_outcome_weight``), but not its sampling: that pool draws distinct
    scenarios to reuse and retires settled ones, with its own numpy generator; this one draws a level per problem
    (a level may repeat within a step), never reuses a problem, and draws from the job's ``random.Random``, whose
    sequence the job's results (docs/benchmarks.md) were measured with."""

    def __init__(self, problems: list[Problem], rng: random.Random, window: int = 48):
        self.rng, self.window = rng, window
        self.unused: dict[int, list[Problem]] = {}
        for p in problems:
            self.unused.setdefault(p.level, []).append(p)
        self.recent: dict[int, list[float]] = {level: [] for level in self.unused}

    def weights(self) -> dict[int, float]:
        return {level: mixed_outcome_weight(sum(r), len(r)) for level, r in self.recent.items() if self.unused[level]}

    def sample(self, n: int) -> list[Problem]:
        """``n`` unused problems (fewer once the pool runs dry)."""
        drawn = []
        for _ in range(n):
            weights = self.weights()  # a level drops out once its problems are used up
            if not weights:
                break
            (level,) = self.rng.choices(list(weights), weights=list(weights.values()))
            drawn.append(self.unused[level].pop(self.rng.randrange(len(self.unused[level]))))
        return drawn

    def record(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        for group in groups:
            for t in group.trajectories:
                level = t.metadata["level"]
                self.recent[level] = [*self.recent[level], t.reward][-self.window :]
        return {f"level_weight/{level}": w for level, w in self.weights().items()}


async def register_new(
    model: TrainableModel, backend: LocalBackend, remedy: str = "pick another --name or delete that directory."
) -> None:
    """Register a job's model, refusing a name that already has checkpoints (a job starts from its base model);
    the error says ``remedy``."""
    await model.register(backend)
    if await model.get_step() > 0:
        raise RuntimeError(f"{backend.model_dir(model)} already has checkpoints; {remedy}")


async def run(config: JobConfig, console: Console | None = None) -> dict:
    console = console or Console()
    start = time.perf_counter()
    backend = LocalBackend()
    model = TrainableModel(
        name=config.name, project=config.project, base_model=config.base_model, trained_weights=config.trained_weights
    )
    report: dict = {"config": config.model_dump()}
    try:
        await register_new(model, backend)
        train = generate_problems("train", 2000, levels=config.levels, seed=config.seed)
        val = generate_problems("val", config.val_problems, levels=config.levels, seed=config.seed)
        test = generate_problems("test", config.test_problems, levels=config.levels, seed=config.seed)

        base = await evaluate(model, test, "baseline (test)")
        report["base"] = accuracy(base, len(test))
        report["peak_rss_gb_by_phase"] = {"baseline": peak_rss_gb()}
        console.print(f"baseline test accuracy: {report['base']:.1%}")

        demos = [
            Trajectory(messages_and_choices=demonstration(p), tools=[CALCULATOR_TOOL])
            for p in train[: config.sft_examples]
        ]
        sft_history = await warm_start(model, demos, config.sft)
        console.print(
            f"SFT warm start: {len(sft_history)} steps, loss {sft_history[0]['loss']:.3f} -> {sft_history[-1]['loss']:.3f}"
        )
        sft_step = await model.get_step()
        report["peak_rss_gb_by_phase"]["sft"] = peak_rss_gb()
        sft = await evaluate(model, test, "after SFT (test)")
        report["sft"] = accuracy(sft, len(test))
        console.print(f"SFT test accuracy: {report['sft']:.1%}")
        await model.log(await evaluate(model, val, "val"), split="val")

        rng = random.Random(config.seed)
        pool = train[config.sft_examples :]
        levels = LevelCurriculum(pool, rng) if config.level_curriculum else None
        rl_rows = []
        # the whole phase's bar (steps done, time left, the last rewards) above each step's rollouts and validation
        with tqdm(total=config.rl_steps, desc="GRPO", unit="step") as bar:
            for i in range(config.rl_steps):
                scenarios = (
                    levels.sample(config.groups_per_step) if levels else rng.sample(pool, config.groups_per_step)
                )
                groups = await gather_trajectory_groups(
                    (
                        TrajectoryGroup(
                            rollout(model, p, temperature=config.temperature) for _ in range(config.group_size)
                        )
                        for p in scenarios
                    ),
                    pbar_desc=f"step {i + 1} rollouts",
                    max_exceptions=0.1,
                )
                bar.set_postfix_str(f"step {i + 1}: training on {sum(len(g.trajectories) for g in groups)} rollouts")
                validate = (i + 1) % config.eval_every == 0 or i + 1 == config.rl_steps
                # a checkpoint only where one can be needed: where the best is picked from (validation points; the
                # last step is one), not at every step (1.6 GB each when every weight trains)
                metrics = await model.train(
                    groups, config=config.rl, save_checkpoint=validate
                )  # with rollout_seconds and train/<metric> means
                row = {"step": await model.get_step(), **metrics, "peak_rss_gb": peak_rss_gb()}
                if levels:
                    row |= levels.record(groups)
                if validate:
                    bar.set_postfix_str(f"step {i + 1}: validation")
                    row |= await model.log(await evaluate(model, val, f"step {i + 1} val"), split="val")
                await model.delete_checkpoints("val/reward")  # the latest and the best so far (1.6 GB each when full)
                rl_rows.append(row)
                shown = {
                    "reward": f"{metrics['reward_mean']:.2f}",
                    "skipped": sum(int(r.get("skipped", 0)) for r in rl_rows),
                }
                vals = [r["val/reward"] for r in rl_rows if "val/reward" in r]
                if vals:
                    shown["val"] = f"{vals[-1]:.2f}"  # the latest
                bar.set_postfix(shown, refresh=False)
                bar.update()
        report["rl_history"] = rl_rows

        history = backend.history(model)
        saved = set(backend.run(model).steps())  # a validated step whose update was skipped may have none
        best = max(
            (
                (r["val/reward"], r["step"])
                for r in history
                if "val/reward" in r and r["step"] >= sft_step and r["step"] in saved
            ),
            default=(0.0, sft_step),
        )
        await backend.restore(model, best[1])
        rl = await evaluate(model, test, f"best checkpoint step {best[1]} (test)")
        report["rl"] = accuracy(rl, len(test))
        report["best_step"] = best[1]
        report["by_level"] = {name: by_level(trajs) for name, trajs in (("base", base), ("sft", sft), ("rl", rl))}
        report["wall_seconds"] = time.perf_counter() - start
        report["peak_rss_gb"] = peak_rss_gb()
        out = backend.model_dir(model)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        plot(history, sft_step, config.temperature, out / "reward.png")
        print_report(console, report, len(test), out)
        return report
    finally:
        await backend.close()


def peak_rss_gb() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def by_level(trajectories: list[Trajectory]) -> dict[int, float]:
    levels: dict[int, list[float]] = {}
    for t in trajectories:
        levels.setdefault(t.metadata["level"], []).append(t.reward)
    return {level: sum(r) / len(r) for level, r in sorted(levels.items())}


# the trainer's skip_reason: why, and the marker of such a step
SKIP_REASONS = {1: ("no group had reward variance", "x"), 2: ("non-finite gradients", "X")}


def rl_rounds(history: list[dict]) -> tuple[list[tuple[int, float, int]], list[tuple[int, float, int]]]:
    """The RL phase round by round from the history rows (in the order they were written): (round, rollout reward,
    skip_reason: 0 where the weights were updated) per RL step, and (round, validation reward, optimizer step) per
    validation, round 0 being the end of SFT. A skipped update leaves the optimizer step where it was, so rounds, not
    steps, tell the RL steps apart."""
    train, val, n = [], [], 0
    for r in history:
        if r.get("split") == "train":
            n += 1
            train.append((n, r["reward_mean"], int(r.get("skip_reason", 0)) if r.get("skipped") else 0))
        elif "val/reward" in r:
            val.append((n, r["val/reward"], r["step"]))
    return train, val


def plot(history: list[dict], sft_step: int, temperature: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = rl_rounds(history)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        ax.plot([t[0] for t in train], [t[1] for t in train], color="C0", alpha=0.4)
        updated = [t for t in train if not t[2]]
        ax.plot(
            [t[0] for t in updated],
            [t[1] for t in updated],
            "o",
            color="C0",
            label=f"train reward (rollouts, T={temperature})",
        )
        for reason, (why, marker) in SKIP_REASONS.items():
            skipped = [t for t in train if t[2] == reason]
            if skipped:
                label = f"train reward, update skipped ({why}): weights unchanged"
                ax.plot([t[0] for t in skipped], [t[1] for t in skipped], marker, color="C3", markersize=8, label=label)
    if val:
        ax.plot([v[0] for v in val], [v[1] for v in val], marker="s", color="C1", label="validation accuracy (greedy)")
        for x, y, step in val:
            ax.annotate(
                f"step {step}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7, color="C1"
            )
    ax.axvline(0, color="grey", linestyle=":", label=f"end of SFT warm start (step {sft_step})")
    ax.set_xlabel("RL step (rollouts, then an update unless skipped); validations name the optimizer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.08)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Calculator agent: SFT warm start then GRPO")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(console: Console, report: dict, n: int, out: Path) -> None:
    table = Table(title=f"Calculator agent, test accuracy ({n} problems, greedy)")
    for col in ("model", "accuracy", "95% interval"):
        table.add_column(col)
    for key, label in (
        ("base", "base model"),
        ("sft", "SFT warm start"),
        ("rl", f"GRPO (best checkpoint, step {report['best_step']})"),
    ):
        lo, hi = wilson(report[key] * n, n)
        table.add_row(label, f"{report[key]:.1%}", f"[{lo:.1%}, {hi:.1%}]")
    console.print(table)
    console.print(
        f"RL lift over SFT: {100 * (report['rl'] - report['sft']):+.1f} points; wall time {report['wall_seconds'] / 60:.1f} min; peak RSS {report['peak_rss_gb']:.1f} GB"
    )
    console.print(f"report: {out / 'report.json'}  plot: {out / 'reward.png'}")
