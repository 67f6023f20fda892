"""The support job (``flywheel train --task support``): database -> tickets -> baseline -> SFT warm start on the
scripted expert's demonstrations, epoch by epoch until validation stops improving (the best epoch: the SFT-only
arm, where RL starts) -> GRPO on the grader stack's reward with periodic validation, as many steps as the job's
time budget holds -> the best checkpoint -> report and plot.

As in the calculator job, everything runs in one process on the embedded model: rollouts go through the engine's
OpenAI-compatible HTTP API, training updates the same model object. The three arms (base, SFT-only, SFT+RL) are
evaluated greedily on the same held-out test tickets with the same transient failures (seeded per ticket), and
each behaviour is reported with a 95% percentile-bootstrap interval: resolution accuracy, safety violations,
escalation precision and recall, retry after a transient failure, recovery, tool calls per episode.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from flywheel.agents.air import AIRConfig
from flywheel.agents.dynamic_sampling import DynamicSampler, DynamicSamplingConfig, NoMixedGroupsError
from flywheel.examples.calculator.train import job_backend, peak_rss_gb, register_new, rl_rounds
from flywheel.examples.sft_arm import sft_best_epoch
from flywheel.examples.support.agent import MAX_TURNS, demonstration, expert_rollout, rollout
from flywheel.examples.support.db import build_database
from flywheel.examples.support.grading import support_stack
from flywheel.examples.support.tickets import Ticket, generate_tickets
from flywheel.gather import gather_trajectory_groups
from flywheel.graders.stack import GraderStack
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.model import TrainableModel
from flywheel.stats import bootstrap_mean
from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights
from flywheel.types import Trajectory, TrajectoryGroup

MAX_FAILED_ROLLOUTS = 0.1  # the share of a step's rollouts that may raise (recorded on their groups)


class JobConfig(BaseModel):
    base_model: str = EMBEDDED_MODEL
    project: str = "support"
    name: str = "support-agent"
    seed: int = 0
    customers: int = 400
    failure_rate: float = Field(0.1, ge=0.0, lt=1.0)  # each tool call's chance of a transient timeout or 503
    tool_budget: int = 8  # efficiency: tool calls past this lose efficiency_penalty each
    efficiency_penalty: float = 0.25
    trained_weights: TrainedWeights = TrainedWeights(mode="full")
    sft_examples: int = 64
    # the SFT-only arm: up to sft_epochs epochs, each validated, stopping once sft_patience epochs in a row did not
    # beat the best validation reward; the best epoch is kept (and RL starts from it). At lr 1e-4 validation rises
    # 0.08 / 0.19 / 0.56 / 0.60 by epoch: a fourth epoch adds little and costs RL three of its ~7 steps in the
    # budget (docs/benchmarks.md, support agent)
    sft_epochs: int = Field(3, ge=1)
    sft_patience: int = Field(1, ge=1)
    # micro-batches of 4096 (SFT) and 3072 (RL) tokens: a group's or a batch's shared prompt (~740 tokens, the
    # tools included) is computed once for more sequences than at 2048 (docs/benchmarks.md, support agent)
    sft: SFTConfig = SFTConfig(learning_rate=1e-4, batch_size=8, micro_batch_tokens=4096)
    rl_steps: int = 16  # at most; fewer when the time budget runs out first
    # the whole job's wall-clock budget: RL stops after the last step that leaves time for its validation and the
    # final test (each estimated from the slowest so far); None: exactly rl_steps
    time_budget_minutes: float | None = Field(43.0, gt=0)
    vllm: str | None = None  # vLLM servers (URL[,URL]) that sample the model instead of the embedded engine
    groups_per_step: int = 4  # with dynamic sampling: groups with mixed outcomes per step
    group_size: int = 6
    # DAPO's dynamic sampling: each step draws tickets until it has groups_per_step groups whose rewards differ (the
    # pool has max_draws x as many tickets); None: groups_per_step tickets a step, as they come. Off by default
    # until measured here: each step's extra draws cost RL steps in the time budget (the calculator's is on)
    dynamic_sampling: DynamicSamplingConfig | None = None
    rl: TrainConfig = TrainConfig(learning_rate=2e-5, loss="dapo", micro_batch_tokens=3072)
    temperature: float = 0.7
    eval_every: int = 4
    val_tickets: int = 24
    test_tickets: int = 50
    max_turns: int = MAX_TURNS
    max_tokens: int = 160

    def with_lora(self) -> JobConfig:
        """The same job training a LoRA adapter, with the calculator job's LoRA learning rates."""
        return self.model_copy(update={
            "trained_weights": self.trained_weights.model_copy(update={"mode": "lora"}),
            "sft": self.sft.model_copy(update={"learning_rate": 3e-4, "gradient_checkpointing": True}),
            "rl": self.rl.model_copy(update={"learning_rate": 1e-4, "gradient_checkpointing": True}),
        })  # fmt: skip


class Job:
    """The job's fixed parts: the model, the database, the grader stack, the rollout settings."""

    def __init__(self, config: JobConfig, model: TrainableModel, db_path: Path, stack: GraderStack) -> None:
        self.config, self.model, self.db_path, self.stack = config, model, db_path, stack

    def rollout(
        self,
        ticket: Ticket,
        *,
        seed: int,
        temperature: float,
        sampling_seed: int | None = None,
        air: AIRConfig | None = None,
    ) -> Coroutine[Any, Any, Trajectory]:
        """One episode (not yet started: ``gather`` runs it); ``agent.rollout`` says what the arguments do."""
        c = self.config
        return rollout(
            self.model,
            ticket,
            self.db_path,
            self.stack,
            failure_rate=c.failure_rate,
            seed=seed,
            temperature=temperature,
            max_turns=c.max_turns,
            max_tokens=c.max_tokens,
            sampling_seed=sampling_seed,
            air=air,
        )

    async def demonstrations(self, tickets: list[Ticket]) -> tuple[list[Trajectory], list[Trajectory]]:
        """The scripted expert's episodes on ``tickets`` (ticket i's failures seeded by i), and those it resolved
        as SFT demonstrations."""
        expert = await asyncio.gather(
            *(
                expert_rollout(t, self.db_path, self.stack, failure_rate=self.config.failure_rate, seed=i)
                for i, t in enumerate(tickets)
            )
        )
        return list(expert), [demonstration(t) for t in expert if t.metrics["resolved"]]

    def group(
        self, ticket: Ticket, seeds: list[int], *, seeded_sampling: bool = False, air: AIRConfig | None = None
    ) -> TrajectoryGroup:
        """A GRPO group on ``ticket``, not run yet: a rollout per seed at the job's temperature, the seed drawing
        its transient failures (and its sampling too with ``seeded_sampling``)."""
        return TrajectoryGroup(
            self.rollout(
                ticket,
                seed=s,
                sampling_seed=s if seeded_sampling else None,
                temperature=self.config.temperature,
                air=air,
            )
            for s in seeds
        )

    async def groups(
        self,
        plan: list[tuple[Ticket, list[int]]],
        desc: str,
        *,
        seeded_sampling: bool = False,
        air: AIRConfig | None = None,
    ) -> list[TrajectoryGroup]:
        """One GRPO step's groups: ``group`` for each ``(ticket, seeds)`` of ``plan``, run."""
        return await gather_trajectory_groups(
            (self.group(t, seeds, seeded_sampling=seeded_sampling, air=air) for t, seeds in plan),
            pbar_desc=desc,
            max_exceptions=MAX_FAILED_ROLLOUTS,
        )

    async def evaluate(self, tickets: list[Ticket], desc: str) -> list[Trajectory]:
        """Greedy episodes; ticket i's failures are seeded by i, so every arm meets the same ones."""
        groups = await gather_trajectory_groups(
            (TrajectoryGroup([self.rollout(t, seed=i, temperature=0.0)]) for i, t in enumerate(tickets)),
            pbar_desc=desc,
            max_exceptions=len(tickets),
        )
        return [t for g in groups for t in g.trajectories]


def job_tickets(db_path: Path, config: JobConfig) -> tuple[list[Ticket], list[Ticket], list[Ticket]]:
    """(train, validation, test) tickets: the first ``sft_examples`` of train are the demonstrations' tickets, the
    rest RL's (``rl_steps`` x ``groups_per_step``, x ``max_draws`` with dynamic sampling). Each split's first n
    tickets are the same for any larger count."""
    draws = config.dynamic_sampling.max_draws if config.dynamic_sampling else 1
    rl = math.ceil(config.rl_steps * config.groups_per_step * draws)
    train = generate_tickets(db_path, "train", config.sft_examples + rl, seed=config.seed)
    val = generate_tickets(db_path, "val", config.val_tickets, seed=config.seed)
    test = generate_tickets(db_path, "test", config.test_tickets, seed=config.seed)
    return train, val, test


def _interval(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "interval": None, "n": 0}
    return {"mean": sum(values) / len(values), "interval": list(bootstrap_mean(values, 2000, 0)), "n": len(values)}


def interval_cell(v: dict, sign: str = "") -> str:
    """One ``_interval`` as a table cell: "mean [low, high] (n)", "-" when it is over nothing; ``sign="+"`` for a
    difference."""
    if v["mean"] is None:
        return "-"
    return f"{v['mean']:{sign}.2f} [{v['interval'][0]:{sign}.2f}, {v['interval'][1]:{sign}.2f}] ({v['n']})"


def behaviour(trajectories: list[Trajectory]) -> dict[str, dict]:
    """The reported behaviours of one arm: each a mean over its episodes (or the relevant subset: escalation
    precision over escalated episodes, recall over those that should escalate, retry and recovery over those that
    hit a transient failure) with a 95% percentile-bootstrap interval and the subset's size."""

    def mean(metric: str, where: Callable[[dict], bool] = lambda m: True) -> dict:
        return _interval([float(t.metrics[metric]) for t in trajectories if where(t.metrics)])

    failed = lambda m: m["hit_failure"] > 0  # noqa: E731
    return {
        "resolution_accuracy": mean("resolved"),
        "reward": _interval([t.reward for t in trajectories]),
        "safety_violations": mean("safety_violation"),
        "escalation_precision": mean("should_escalate", lambda m: m["escalated"] > 0),
        "escalation_recall": mean("escalated", lambda m: m["should_escalate"] > 0),
        "retry_after_failure": mean("retried_after_failure", failed),
        "recovery": mean("recovered", failed),
        "tool_calls": mean("tool_calls"),
    }


PAIRED = (("resolution_accuracy", "resolved"), ("safety_violations", "safety_violation"))


def outcomes(trajectories: list[Trajectory]) -> dict[str, dict[str, float]]:
    """An arm's outcome per ticket (by id): its reward and each of ``PAIRED``'s metrics."""
    return {
        t.metadata["ticket_id"]: {"reward": t.reward} | {metric: t.metrics[metric] for _, metric in PAIRED}
        for t in trajectories
    }


def paired(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict]:
    """``after`` minus ``before`` ticket by ticket (``outcomes`` of arms that met the same tickets with the same
    failures): the mean difference with a 95% bootstrap interval over the tickets both arms completed, for each of
    ``PAIRED``."""
    common = [ticket for ticket in before if ticket in after]
    return {name: _interval([after[k][metric] - before[k][metric] for k in common]) for name, metric in PAIRED}


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
        out = backend.model_dir(model)
        db = build_database(out / "support.db", seed=config.seed, customers=config.customers)
        stack = support_stack(config.tool_budget, config.efficiency_penalty)
        report |= {"database": db.rows, "grader_stack": stack.version}
        job = Job(config, model, db.path, stack)
        train, val, test = job_tickets(db.path, config)
        arms: dict[str, list[Trajectory]] = {"base": await job.evaluate(test, "baseline (test)")}
        console.print(f"baseline test resolution accuracy: {_accuracy(arms['base']):.1%}")

        expert, demos = await job.demonstrations(train[: config.sft_examples])
        report["expert"] = behaviour(expert)
        console.print(f"expert demonstrations: {len(demos)} of {len(expert)} tickets resolved")
        sft_step, sft_vals, val_seconds = await sft_best_epoch(
            model,
            backend,
            demos,
            config.sft,
            max_epochs=config.sft_epochs,
            patience=config.sft_patience,
            validate=lambda epoch: job.evaluate(val, f"SFT epoch {epoch} val"),
        )
        sft_val = max(sft_vals)
        report |= {"sft_val_reward": sft_val, "sft_epoch_val_rewards": sft_vals}
        started = time.perf_counter()
        arms["sft"] = await job.evaluate(test, "SFT-only (test)")
        test_seconds = time.perf_counter() - started
        console.print(f"SFT-only (step {sft_step}) test resolution accuracy: {_accuracy(arms['sft']):.1%}")

        deadline = None if config.time_budget_minutes is None else start + 60 * config.time_budget_minutes
        rl_rows = await reinforce(
            model, job, train[config.sft_examples :], val, config, deadline, (val_seconds, test_seconds)
        )
        report["rl_history"] = rl_rows
        history = backend.history(model)
        saved = set(backend.run(model).steps())
        best = max(
            (
                (r["val/reward"], r["step"])
                for r in history
                if "val/reward" in r and r["step"] >= sft_step and r["step"] in saved
            ),
            default=(sft_val, sft_step),
        )
        await backend.restore(model, best[1])
        arms["rl"] = await job.evaluate(test, f"SFT+RL, best checkpoint step {best[1]} (test)")
        report |= {"sft_step": sft_step, "best_step": best[1]}
        report["arms"] = {name: behaviour(trajs) for name, trajs in arms.items()}
        report["tickets"] = {name: outcomes(trajs) for name, trajs in arms.items()}  # for any later paired comparison
        report["rl_minus_sft"] = paired(report["tickets"]["sft"], report["tickets"]["rl"])
        report["wall_seconds"] = time.perf_counter() - start
        report["peak_rss_gb"] = peak_rss_gb()
        (out / "report.json").write_text(json.dumps(report, indent=2))
        plot(report, history, config.temperature, out / "support.png")
        print_report(console, report, len(test), out)
        return report
    finally:
        await backend.close()


def _accuracy(trajectories: list[Trajectory]) -> float:
    return sum(t.metrics["resolved"] for t in trajectories) / max(1, len(trajectories))


def another_step_fits(seconds_left: float, step: float, validation: float, test: float) -> bool:
    """Whether the time left holds one more RL step (``step``: the slowest so far, rollouts and update), its
    validation (the last step is always validated) and the final test of the best checkpoint."""
    return step + validation + test <= seconds_left


def group_plan(tickets: list[Ticket], rng: random.Random, group_size: int) -> list[tuple[Ticket, list[int]]]:
    """``Job.groups``'s plan: each ticket with ``group_size`` rollout seeds drawn from ``rng``, ticket by ticket."""
    return list(lazy_plan(tickets, rng, group_size))


def lazy_plan(tickets: Iterable[Ticket], rng: random.Random, group_size: int) -> Iterator[tuple[Ticket, list[int]]]:
    """``group_plan`` as tickets are drawn (dynamic sampling draws as many as it needs): the same seeds."""
    for t in tickets:
        yield t, [rng.randrange(2**31) for _ in range(group_size)]


def rl_order(pool: list[Ticket], seed: int) -> tuple[list[Ticket], random.Random]:
    """The order in which ``reinforce`` draws its RL tickets (a copy of ``pool``, shuffled by ``seed``), and the
    generator that shuffled it, which then draws the rollouts' seeds."""
    rng = random.Random(seed)
    order = list(pool)
    rng.shuffle(order)
    return order, rng


async def reinforce(
    model: TrainableModel,
    job: Job,
    pool: list[Ticket],
    val: list[Ticket],
    config: JobConfig,
    deadline: float | None = None,
    eval_seconds: tuple[float, float] = (0.0, 0.0),
) -> list[dict]:
    """GRPO: each step ``groups_per_step`` unused tickets x ``group_size`` rollouts (each with its own failures; with
    ``dynamic_sampling``, unused tickets drawn until that many groups have rewards that differ), validated every
    ``eval_every`` steps and at the last; the latest and the best checkpoint are kept. With a ``deadline``
    (``time.perf_counter()``), the last step is the first after which ``another_step_fits`` does not hold,
    ``eval_seconds`` being (a validation's, the final test's) seconds (the first raised to the slowest seen). The
    pool running dry ends RL after a last validated step."""
    order, rng = rl_order(pool, config.seed)
    unused = iter(order)
    sampler = DynamicSampler(config.dynamic_sampling) if config.dynamic_sampling else None
    rows: list[dict] = []
    val_seconds, test_seconds = eval_seconds
    slowest_rollouts = slowest_update = 0.0
    with tqdm(total=config.rl_steps, desc="GRPO", unit="step") as bar:
        for i in range(config.rl_steps):
            started = time.perf_counter()
            desc, sampled = f"step {i + 1} rollouts", None
            if sampler is None:
                tickets = list(itertools.islice(unused, config.groups_per_step))
                groups = await job.groups(group_plan(tickets, rng, config.group_size), desc)
                dry = len(tickets) < config.groups_per_step
            else:
                source = (job.group(t, seeds) for t, seeds in lazy_plan(unused, rng, config.group_size))
                try:
                    mixed = await sampler.draw(
                        source, config.groups_per_step, pbar_desc=desc, max_exceptions=MAX_FAILED_ROLLOUTS
                    )
                    groups, sampled, dry = mixed.kept, mixed.metrics(), mixed.stop == "exhausted"
                except NoMixedGroupsError as exc:
                    groups, dry = [], True
                    tqdm.write(f"step {i + 1}: {exc}")
            # whether this step is the last is decided before its update, which takes as long as the slowest yet
            rollouts = time.perf_counter() - started
            slowest_rollouts = max(slowest_rollouts, rollouts)
            validating = (i + 1) % config.eval_every == 0
            last = (
                i + 1 == config.rl_steps
                or dry
                or (
                    deadline is not None
                    and not another_step_fits(
                        deadline - time.perf_counter() - slowest_update - (val_seconds if validating else 0.0),
                        slowest_rollouts + slowest_update,
                        val_seconds,
                        test_seconds,
                    )
                )
            )
            validate = validating or last
            update_started = time.perf_counter()
            metrics = await model.train(groups, config=config.rl, save_checkpoint=validate, metrics=sampled)
            slowest_update = max(slowest_update, time.perf_counter() - update_started)
            row = {"step": await model.get_step(), **metrics, "peak_rss_gb": peak_rss_gb()}
            if validate:
                val_started = time.perf_counter()
                row |= await model.log(await job.evaluate(val, f"step {i + 1} val"), split="val")
                val_seconds = max(val_seconds, time.perf_counter() - val_started)
            await model.delete_checkpoints("val/reward")
            rows.append(row)
            # every rollout drawn's, where the step sampled dynamically (the kept groups' lean to one half)
            bar.set_postfix(
                {"reward": f"{metrics.get('drawn_reward_mean', metrics['reward_mean']):.2f}"}, refresh=False
            )
            bar.update()
            if last:
                break
    return rows


# (key in the report, label) of the behaviours plotted and printed
SHOWN = (
    ("resolution_accuracy", "resolution accuracy"),
    ("safety_violations", "safety violations"),
    ("escalation_precision", "escalation precision"),
    ("escalation_recall", "escalation recall"),
    ("retry_after_failure", "retry after a transient failure"),
    ("recovery", "recovery (failure hit, still resolved)"),
)
ARMS = (("base", "base model"), ("sft", "SFT-only"), ("rl", "SFT+RL"))


def plot(report: dict, history: list[dict], temperature: float, path: Path) -> None:
    """Left: each behaviour per arm with its interval; right: the RL phase's rollout and validation rewards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curve) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(ARMS)
    for a, (arm, label) in enumerate(ARMS):
        xs, ys, errors = [], [], [[], []]
        for x, (key, _) in enumerate(SHOWN):
            value = report["arms"][arm][key]
            if value["mean"] is None:
                continue
            xs.append(x + (a - 1) * width)
            ys.append(value["mean"])
            errors[0].append(value["mean"] - value["interval"][0])
            errors[1].append(value["interval"][1] - value["mean"])
        bars.bar(xs, ys, width, yerr=errors, capsize=2, label=label)
    bars.set_xticks(range(len(SHOWN)), [label for _, label in SHOWN], rotation=20, ha="right", fontsize=8)
    bars.set_ylim(0, 1.05)
    bars.legend(fontsize=8)
    bars.set_title("Held-out test tickets (greedy), 95% bootstrap intervals", fontsize=9)
    train, val = rl_rounds(history)
    if train:
        curve.plot([t[0] for t in train], [t[1] for t in train], "o-", label=f"train reward (T={temperature})")
    if val:
        curve.plot([v[0] for v in val], [v[1] for v in val], "s-", label="validation reward (greedy)")
    curve.set_xlabel("RL step (0: end of SFT)")
    curve.set_ylim(-0.02, 1.05)
    curve.legend(fontsize=8)
    curve.set_title("GRPO on the grader stack's reward", fontsize=9)
    fig.suptitle("Support agent: base, SFT-only, SFT+RL")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(console: Console, report: dict, n: int, out: Path) -> None:
    table = Table(title=f"Support agent on {n} held-out test tickets (greedy); mean [95% interval] (episodes)")
    table.add_column("behaviour")
    for arm, label in ARMS:
        table.add_column(label if arm != "rl" else f"{label} (step {report['best_step']})")
    for key, label in (*SHOWN, ("tool_calls", "tool calls per episode")):
        table.add_row(label, *(interval_cell(report["arms"][arm][key]) for arm, _ in ARMS))
    console.print(table)
    differences = [
        f"{label} {interval_cell(v, '+')}"
        for (key, _), label in zip(PAIRED, ("resolution accuracy", "safety violations"), strict=True)
        if (v := report["rl_minus_sft"][key])["mean"] is not None
    ]
    console.print(f"SFT+RL minus SFT-only, ticket by ticket: {'; '.join(differences) or '-'}", highlight=False)
    console.print(
        f"wall time {report['wall_seconds'] / 60:.1f} min; peak RSS {report['peak_rss_gb']:.1f} GB; "
        f"report: {out / 'report.json'}  plot: {out / 'support.png'}"
    )
