"""The main job: baseline -> SFT warm start -> GRPO with periodic validation -> best checkpoint -> report.

Everything runs in one process on the embedded model: rollouts go through the engine's OpenAI-compatible HTTP
API (as any agent would), training updates the LoRA adapter on the same model object.
"""

from __future__ import annotations

import itertools
import json
import random
import resource
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from flywheel.agents.curriculum import mixed_outcome_weight
from flywheel.agents.dynamic_sampling import DynamicSampler, DynamicSamplingConfig, MixedGroups, NoMixedGroupsError
from flywheel.examples.calculator.agent import rollout
from flywheel.examples.calculator.task import CALCULATOR_TOOL, Problem, demonstration, generate_problems
from flywheel.examples.sft_arm import sft_best_epoch
from flywheel.gather import gather_trajectory_groups
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.pipeline import RolloutPipeline
from flywheel.stats import bootstrap_mean, wilson
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
    sft: SFTConfig = SFTConfig(learning_rate=5e-5, batch_size=8, micro_batch_tokens=1024)
    # the SFT-only arm, fair to it: up to sft_epochs epochs, each validated, stopping once sft_patience epochs in a
    # row did not beat the best; the best epoch is the arm RL is compared with, and where RL starts
    sft_epochs: int = Field(4, ge=1)
    sft_patience: int = Field(1, ge=1)
    rl_steps: int = 16
    groups_per_step: int = 6  # with dynamic sampling: groups with mixed outcomes per step
    group_size: int = 8
    # DAPO's dynamic sampling: each step draws problems until it has groups_per_step groups whose rewards differ
    # (at most max_draws x as many drawn); None: groups_per_step problems, whatever their groups' outcomes
    dynamic_sampling: DynamicSamplingConfig | None = DynamicSamplingConfig()
    rl: TrainConfig = TrainConfig(learning_rate=1e-5, loss="dapo", micro_batch_tokens=1024)
    temperature: float = 0.7  # a 135M model at T=1 mostly produces noise: no group would have a success
    level_curriculum: bool = True  # draw RL problems by level, favouring the levels with mixed outcomes
    # the rollouts of the next async_steps steps run while a step trains (flywheel.pipeline), each group up to that
    # many steps stale (rl.max_staleness_steps bounds it: set to async_steps when unset); 0: synchronous
    async_steps: int = Field(0, ge=0)
    eval_every: int = 4
    val_problems: int = 64  # picks the best checkpoint: 32 problems (+-17 points) made that choice mostly noise
    test_problems: int = 100
    vllm: str | None = None  # vLLM servers (URL[,URL]) that sample the model instead of the embedded engine

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

    def stream(self) -> Iterator[Problem]:
        """Unused problems one at a time, each drawn with the weights of the moment, until the pool runs dry."""
        while drawn := self.sample(1):
            yield drawn[0]

    def record(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        for group in groups:
            for t in group.trajectories:
                level = t.metadata["level"]
                self.recent[level] = [*self.recent[level], t.reward][-self.window :]
        return {f"level_weight/{level}": w for level, w in self.weights().items()}


def job_backend(vllm: str | None) -> LocalBackend:
    """The backend a job trains on: the embedded engine samples, or the vLLM servers ``vllm`` do (``VLLMBackend``:
    each step's weights synced into them)."""
    if vllm is None:
        return LocalBackend()
    from flywheel.vllm_backend import VLLMBackend

    return VLLMBackend(vllm)


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
    backend = job_backend(config.vllm)
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
        sft_step, sft_vals, _ = await sft_best_epoch(
            model,
            backend,
            demos,
            config.sft,
            max_epochs=config.sft_epochs,
            patience=config.sft_patience,
            validate=lambda epoch: evaluate(model, val, f"SFT epoch {epoch} val"),
        )
        report["sft_epoch_val_rewards"] = sft_vals
        console.print(
            f"SFT warm start: best of {len(sft_vals)} epochs by validation (step {sft_step}), validation "
            + " -> ".join(f"{v:.2f}" for v in sft_vals)
        )
        report["peak_rss_gb_by_phase"]["sft"] = peak_rss_gb()
        sft = await evaluate(model, test, "after SFT (test)")
        report["sft"] = accuracy(sft, len(test))
        console.print(f"SFT test accuracy: {report['sft']:.1%}")

        rng = random.Random(config.seed)
        pool = train[config.sft_examples :]
        levels = LevelCurriculum(pool, rng) if config.level_curriculum else None
        problems = levels.stream() if levels else iter(rng.sample(pool, len(pool)))
        sampler = DynamicSampler(config.dynamic_sampling) if config.dynamic_sampling else None
        rl_config = config.rl
        if config.async_steps and rl_config.max_staleness_steps is None:
            rl_config = rl_config.model_copy(update={"max_staleness_steps": config.async_steps})

        async def step_rollouts(i: int) -> tuple[list[TrajectoryGroup], MixedGroups | None]:
            """Step ``i + 1``'s groups (and what dynamic sampling drew); ``NoMixedGroupsError`` when the pool ran
            dry."""
            drawn = (
                TrajectoryGroup(rollout(model, p, temperature=config.temperature) for _ in range(config.group_size))
                for p in problems
            )
            # one progress bar at a time: a step's rollouts drawn ahead of it (async_steps) run without one
            desc = f"step {i + 1} rollouts" if not config.async_steps else None
            if sampler:
                mixed = await sampler.draw(drawn, config.groups_per_step, pbar_desc=desc, max_exceptions=0.1)
                return mixed.kept, mixed
            groups = await gather_trajectory_groups(
                list(itertools.islice(drawn, config.groups_per_step)), pbar_desc=desc, max_exceptions=0.1
            )
            return groups, None

        rl_rows = []
        # the whole phase's bar (steps done, time left, the last rewards) above each step's rollouts and validation
        pipeline = RolloutPipeline(step_rollouts, async_steps=config.async_steps, stop=config.rl_steps)
        rl_started = time.perf_counter()
        with tqdm(total=config.rl_steps, desc="GRPO", unit="step") as bar:
            try:
                async with pipeline:
                    async for i, (groups, mixed) in pipeline:
                        trained = sum(len(g.trajectories) for g in groups)
                        bar.set_postfix_str(f"step {i + 1}: training on {trained} rollouts")
                        validate = (i + 1) % config.eval_every == 0 or i + 1 == config.rl_steps
                        # a checkpoint only where one can be needed: where the best is picked from (validation
                        # points; the last step is one), not at every step (1.6 GB each when every weight trains)
                        metrics = await model.train(
                            groups,
                            config=rl_config,
                            save_checkpoint=validate,
                            metrics=mixed.metrics() if mixed else None,
                        )  # with rollout_seconds and train/<metric> means
                        row = {"step": await model.get_step(), **metrics, "peak_rss_gb": peak_rss_gb()}
                        if levels:
                            row |= levels.record(groups + (mixed.dropped if mixed else []))
                        if validate:
                            bar.set_postfix_str(f"step {i + 1}: validation")
                            row |= await model.log(await evaluate(model, val, f"step {i + 1} val"), split="val")
                        # the latest and the best so far (1.6 GB each when full)
                        await model.delete_checkpoints("val/reward")
                        rl_rows.append(row)
                        shown = {
                            # every rollout's
                            "reward": f"{metrics.get('drawn_reward_mean', metrics['reward_mean']):.2f}",
                            "skipped": sum(int(r.get("skipped", 0)) for r in rl_rows),
                        }
                        if mixed:
                            shown["kept"] = f"{len(mixed.kept)}/{mixed.drawn} groups"
                        vals = [r["val/reward"] for r in rl_rows if "val/reward" in r]
                        if vals:
                            shown["val"] = f"{vals[-1]:.2f}"  # the latest
                        bar.set_postfix(shown, refresh=False)
                        bar.update()
            except NoMixedGroupsError as exc:  # the pool ran dry: RL ends here, its best checkpoint stands
                console.print(f"RL stops after {pipeline.next} steps: {exc}")
        report["rl_history"] = rl_rows
        report["rl_seconds"] = time.perf_counter() - rl_started  # the RL phase: rollouts, steps, validations

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
        # paired on the same test problems (greedy: each arm's answer to each problem)
        diffs = [b.reward - a.reward for a, b in zip(sft, rl)]
        report["rl_minus_sft"] = {"mean": sum(diffs) / len(diffs), "interval": list(bootstrap_mean(diffs, 4000, 0))}
        report["sft_step"] = sft_step
        report["by_level"] = {name: by_level(trajs) for name, trajs in (("base", base), ("sft", sft), ("rl", rl))}
        report["wall_seconds"] = time.perf_counter() - start
        report["peak_rss_gb"] = peak_rss_gb()
        out = backend.model_dir(model)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        plot(history, sft_step, config.temperature, out / "reward.png", sft_vals)
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
    """The RL phase round by round from the history rows (in the order they were written): (round, rollout reward
    (of every rollout drawn, where the step sampled dynamically), skip_reason: 0 where the weights were updated) per
    RL step, and (round, validation reward, optimizer step) per validation, round 0 being the end of SFT (its last
    validation: the best epoch's). A skipped update leaves the optimizer step where it was, so rounds, not steps,
    tell the RL steps apart."""
    train, val, n = [], [], 0
    for r in history:
        if r.get("split") == "train":
            n += 1
            reward = r.get("drawn_reward_mean", r["reward_mean"])  # sampled dynamically: every rollout drawn
            train.append((n, reward, int(r.get("skip_reason", 0)) if r.get("skipped") else 0))
        elif "val/reward" in r:
            if n == 0 and val:  # SFT's epochs: the last one written is the arm RL starts from
                val.pop()
            val.append((n, r["val/reward"], r["step"]))
    return train, val


def sampling_rounds(history: list[dict]) -> list[tuple[int, int, int]]:
    """(round, groups kept, groups dropped) of each RL step that sampled dynamically (``MixedGroups.metrics``)."""
    rows = [r for r in history if r.get("split") == "train"]  # round n is the n-th, as in ``rl_rounds``
    return [(n, int(r["groups_kept"]), int(r["groups_dropped"])) for n, r in enumerate(rows, 1) if "groups_kept" in r]


def plot(
    history: list[dict], sft_step: int, temperature: float, path: Path, sft_vals: list[float] | None = None
) -> None:
    """The RL phase's training reward and validation accuracy by RL step, the SFT arm's validation per epoch to
    the left of it (``sft_vals``), and below, where it sampled dynamically, each step's groups kept and dropped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = rl_rounds(history)
    sampled = sampling_rounds(history)
    if sampled:
        fig, (ax, low) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[3, 1.2])
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        ax.plot([t[0] for t in train], [t[1] for t in train], color="C0", alpha=0.4)
        updated = [t for t in train if not t[2]]
        ax.plot(
            [t[0] for t in updated],
            [t[1] for t in updated],
            "o",
            color="C0",
            label=f"train reward (every rollout drawn, T={temperature})",
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
    if sft_vals:
        xs = [e - len(sft_vals) - 1 for e in range(1, len(sft_vals) + 1)]
        best = sft_vals.index(max(sft_vals))
        ax.plot(xs, sft_vals, "s--", color="C2", mfc="none", label="SFT-only arm: validation after each epoch")
        ax.plot([xs[best]], [sft_vals[best]], "*", color="C2", markersize=12, label=f"best epoch ({best + 1}): kept")
    ax.axvline(0, color="grey", linestyle=":", label=f"RL starts from the SFT arm (step {sft_step})")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.08)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Calculator agent: SFT warm start then GRPO")
    bottom = ax
    if sampled:
        rounds = [r for r, _, _ in sampled]
        low.bar(rounds, [k for _, k, _ in sampled], color="C0", label="kept (rewards differ)")
        low.bar(rounds, [d for _, _, d in sampled], bottom=[k for _, k, _ in sampled], color="0.75",
                label="dropped (all rewards equal)")  # fmt: skip
        low.set_ylabel("groups drawn")
        low.legend(fontsize=8, loc="upper left")
        bottom = low
    bottom.set_xlabel(
        "SFT epoch (< 0), RL step (rollouts, then an update unless skipped); validations name the optimizer step"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(console: Console, report: dict, n: int, out: Path) -> None:
    table = Table(title=f"Calculator agent, test accuracy ({n} problems, greedy)")
    for col in ("model", "accuracy", "95% interval"):
        table.add_column(col)
    epochs = report.get("sft_epoch_val_rewards", [])
    best_epoch = epochs.index(max(epochs)) + 1 if epochs else None
    for key, label in (
        ("base", "base model"),
        ("sft", f"SFT-only (best of {len(epochs)} epochs: epoch {best_epoch})" if epochs else "SFT warm start"),
        ("rl", f"SFT + GRPO (best checkpoint, step {report['best_step']})"),
    ):
        lo, hi = wilson(report[key] * n, n)
        table.add_row(label, f"{report[key]:.1%}", f"[{lo:.1%}, {hi:.1%}]")
    console.print(table)
    lift = report["rl_minus_sft"]
    lo, hi = lift["interval"]
    console.print(
        f"RL lift over the SFT-only arm: {100 * lift['mean']:+.1f} points, paired 95% interval [{100 * lo:+.1f},"
        f" {100 * hi:+.1f}] on the same problems; wall time {report['wall_seconds'] / 60:.1f} min; peak RSS"
        f" {report['peak_rss_gb']:.1f} GB"
    )
    console.print(f"report: {out / 'report.json'}  plot: {out / 'reward.png'}")
