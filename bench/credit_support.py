"""Credit assignment and automatic intermediate rewards on the support agent (issue #27, item 6): bench/credit.py's
four arms, uniform vs turn credit x AIR off vs on, on the support job (flywheel/examples/support).

Every arm starts from the same SFT checkpoint: ``--from DIR``, a checkpoint of ``flywheel train --task support``
(``$FLYWHEEL_HOME/support/models/<name>/checkpoints/<step>``, hard-linked, never written), or ``--sft-epochs N``: the
job's SFT warm start run here once (the best of at most N epochs by validation). Then each arm runs ``--steps`` GRPO
steps with the job's RL settings (``JobConfig.rl``: DAPO, learning rate, micro-batches), only ``credit`` differing,
on the same RL tickets with the same seeds (each rollout's seed draws both its desk's transient failures and its
sampling), AIR (``flywheel.agents.air``: ``SUPPORT_AIR`` unless ``--air``) on the turns where the arm says so: a
transient failure (a timeout or a 503) is a call that did not execute. No checkpoint is saved during the steps; each
arm's final weights, and the shared start, are evaluated greedily on the same held-out test tickets (the first
``--test`` of the job's, ticket i's failures seeded by i as in the job) with the job's ``behaviour()``: means with
95% bootstrap intervals, and each arm minus the start ticket by ticket (the job's ``paired()``). Each arm's
directory is deleted when it is done. Writes bench/results/credit_support-<time>.json and .png and prints a table.

    .venv/bin/python bench/credit_support.py --from DIR     # 4 steps x 3 tickets x 6 rollouts, 50 test tickets
    .venv/bin/python bench/credit_support.py --from DIR --steps 1 --tickets 1 --group-size 2 --test 2  # smoke test
    .venv/bin/python bench/credit_support.py --sft-epochs 2 ...  # SFT here first (no checkpoint of the job at hand)

The job keeps its latest and its best checkpoint by validation, so its SFT-only checkpoint is gone once an RL step
validates better: link it aside before (``cp -al``) to use it here. With other work on the cores, run with
OMP_NUM_THREADS=1: two torch threads that must wait for each other on an oversubscribed CPU made one greedy test
episode take minutes (13.5 min for 2 tickets under a load of 13 on 2 cores; 40 s with one thread).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from credit import ARMS  # bench/credit.py: the same four arms
from machine import describe, save_result  # bench/machine.py
from rich.console import Console
from rich.table import Table

from flywheel.agents import AIRConfig
from flywheel.checkpoints import layout
from flywheel.examples.support.db import build_database
from flywheel.examples.support.grading import support_stack
from flywheel.examples.support.tickets import Ticket
from flywheel.examples.support.train import (
    PAIRED,
    SHOWN,
    Job,
    JobConfig,
    behaviour,
    group_plan,
    interval_cell,
    job_tickets,
    outcomes,
    paired,
    sft_best_epoch,
)
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.types import Trajectory

PROJECT = "credit-support"
# per-rollout means in each step's row: the episode metrics of run_agent, AIR and grading.episode_metrics
ROLLOUT_METRICS = ("resolved", "air_reward", "tool_calls", "tool_errors", "tool_timeouts", "hit_failure", "turns")
BEHAVIOURS = (*SHOWN, ("tool_calls", "tool calls / episode"))
# AIR sized to the support reward: distinct rewards (correct x efficiency, JobConfig's penalty 0.25) differ by 0.125
# at least, so AIR's guarantee (2 x cap < outcome_gap: the better outcome keeps the higher total) needs a cap under
# 0.0625. 0.004 per well-formed, executed and (subtracted) repeated call: a first call that runs earns 0.008, one that
# fails transiently 0.004, its retry 0.004; an SFT episode's 4-6 calls earn 0.02-0.05, under the cap, so AIR still
# tells rollouts apart (with AIRConfig()'s defaults, 0.1 a call and a cap of 0.2, two calls that ran reach the cap
# and almost every rollout gets the same 0.2). In a group whose rewards tie, std scaling makes these differences
# the whole advantage.
SUPPORT_AIR = AIRConfig(well_formed=0.004, executed=0.004, repeated=0.004, cap=0.06, outcome_gap=0.125)


def job_config(args: argparse.Namespace) -> JobConfig:
    """The support job's configuration, sized by the arguments (RL tickets: ``steps`` x ``tickets``)."""
    config = JobConfig(
        seed=args.seed,
        sft_examples=args.sft_examples,
        sft_epochs=args.sft_epochs or 1,
        rl_steps=args.steps,
        groups_per_step=args.tickets,
        group_size=args.group_size,
        time_budget_minutes=None,
        val_tickets=args.val,
        test_tickets=args.test,
        temperature=args.temperature,
    )
    if args.from_dir is not None and (args.from_dir / layout.ADAPTER_WEIGHTS).exists():
        config = config.with_lora()  # a LoRA checkpoint: the arms train the adapter, as its job did
    if args.lr is not None:
        config = config.model_copy(update={"rl": config.rl.model_copy(update={"learning_rate": args.lr})})
    return config


def link_checkpoint(source: Path, backend: LocalBackend, model: TrainableModel) -> None:
    """Put the checkpoint at ``source`` into ``model``'s directory (register() resumes from it): hard links where
    the file system allows (checkpoints are written to a new directory and renamed, never in place), else a copy."""
    target = layout.checkpoints_dir(backend.model_dir(model)) / source.name
    try:
        shutil.copytree(source, target, copy_function=os.link)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)


def model_for(name: str, config: JobConfig) -> TrainableModel:
    return TrainableModel(
        name=name, project=PROJECT, base_model=config.base_model, trained_weights=config.trained_weights
    )


async def start(home: Path, args: argparse.Namespace, config: JobConfig, db_path: Path) -> tuple[Path, dict, dict]:
    """The shared start: ``--from``'s checkpoint, or SFT run here; (its checkpoint, its test behaviour, what SFT
    did: {} with ``--from``)."""
    backend = LocalBackend(path=home)
    try:
        model = model_for("start", config)
        if args.from_dir is not None:
            link_checkpoint(args.from_dir, backend, model)
        await model.register(backend)
        job = Job(config, model, db_path, support_stack(config.tool_budget, config.efficiency_penalty))
        train, val, test = job_tickets(db_path, config)
        sft: dict = {}
        step = await model.get_step()
        if args.from_dir is None:
            expert, demos = await job.demonstrations(train[: config.sft_examples])
            step, val_rewards, _ = await sft_best_epoch(model, backend, job, demos, val, config)
            sft = {"demonstrations": len(demos), "of": len(expert), "step": step, "epoch_val_rewards": val_rewards}
        trajectories = await job.evaluate(test, f"start, step {step} (test)")
        return layout.checkpoint_dir(backend.model_dir(model), step), summary(trajectories), sft
    finally:
        await backend.close()


def summary(trajectories: list[Trajectory]) -> dict:
    """An arm's test result: ``behaviour()`` and each ticket's outcome (the job's ``outcomes()``, for ``paired()``)."""
    return {"behaviour": behaviour(trajectories), "tickets": outcomes(trajectories)}


def step_plan(config: JobConfig, pool: list[Ticket], step: int) -> list[tuple[Ticket, list[int]]]:
    """Step ``step``'s tickets and each rollout's seed: the same in every arm."""
    rng = random.Random(f"credit-support:{config.seed}:{step}")
    tickets = pool[step * config.groups_per_step : (step + 1) * config.groups_per_step]
    return group_plan(tickets, rng, config.group_size)


async def run_arm(name: str, home: Path, sft: Path, config: JobConfig, air_config: AIRConfig, db_path: Path) -> dict:
    credit, air_on = ARMS[name]
    rl = config.rl.model_copy(update={"credit": credit})
    air = air_config if air_on else None
    backend = LocalBackend(path=home)
    model = model_for(name, config)
    try:
        link_checkpoint(sft, backend, model)
        await model.register(backend)
        job = Job(config, model, db_path, support_stack(config.tool_budget, config.efficiency_penalty))
        train, _, test = job_tickets(db_path, config)
        pool = train[config.sft_examples :]  # RL tickets the warm start never showed
        rows = []
        for i in range(config.rl_steps):
            started = time.perf_counter()
            groups = await job.groups(
                step_plan(config, pool, i), f"{name} step {i + 1} rollouts", seeded_sampling=True, air=air
            )
            rollout_seconds = time.perf_counter() - started
            trajectories = [t for g in groups for t in g.trajectories]
            metrics = await model.train(groups, rl, save_checkpoint=False)
            row = {"step": i + 1, **metrics, "rollout_seconds": rollout_seconds}
            for key in ROLLOUT_METRICS:
                row[key] = sum(float(t.metrics.get(key, 0.0)) for t in trajectories) / max(len(trajectories), 1)
            if air is not None:
                row["air_at_cap"] = sum(t.metrics["air_reward"] >= air.cap - 1e-9 for t in trajectories) / max(
                    len(trajectories), 1
                )
            rows.append(row)
        started = time.perf_counter()
        result = summary(await job.evaluate(test, f"{name} (test)"))
        return {**result, "steps": rows, "test_seconds": time.perf_counter() - started}
    finally:
        await backend.close()
        shutil.rmtree(backend.model_dir(model), ignore_errors=True)  # its checkpoint: disk


def plot(report: dict, path: Path) -> None:
    """Left: each behaviour per arm (the start first) with its interval; right: train reward per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {"start": report["start"], **report["arms"]}
    fig, (bars, curve) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(arms)
    for a, (arm, result) in enumerate(arms.items()):
        xs, ys, errors = [], [], [[], []]
        for x, (key, _) in enumerate(SHOWN):
            value = result["behaviour"][key]
            if value["mean"] is None:
                continue
            xs.append(x + (a - (len(arms) - 1) / 2) * width)
            ys.append(value["mean"])
            errors[0].append(value["mean"] - value["interval"][0])
            errors[1].append(value["interval"][1] - value["mean"])
        bars.bar(xs, ys, width, yerr=errors, capsize=2, label=arm)
        if arm != "start":
            steps = result["steps"]
            curve.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], "o-", label=arm)
    bars.set_xticks(range(len(SHOWN)), [label for _, label in SHOWN], rotation=20, ha="right", fontsize=8)
    bars.set_ylim(0, 1.05)
    bars.legend(fontsize=8)
    bars.set_title(f"{report['config']['test_tickets']} held-out test tickets (greedy), 95% bootstrap", fontsize=9)
    curve.set_xlabel("GRPO step after the shared SFT start")
    curve.set_ylabel(f"train reward (T={report['config']['temperature']})")
    curve.set_ylim(-0.02, 1.05)
    curve.legend(fontsize=8)
    fig.suptitle("Support agent: credit assignment and AIR")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(console: Console, report: dict) -> None:
    """One column per arm (the shared start first), one row per behaviour on the test tickets, then training."""
    c = report["config"]
    arms = {"start": report["start"], **report["arms"]}
    table = Table(
        title=f"Support agent, {c['rl_steps']} GRPO steps x {c['groups_per_step']} tickets x {c['group_size']} "
        f"rollouts; {c['test_tickets']} test tickets (greedy): mean [95% interval] (episodes)"
    )
    table.add_column("")
    for arm in arms:
        table.add_column(arm)
    for key, label in BEHAVIOURS:
        table.add_row(label, *(interval_cell(result["behaviour"][key]) for result in arms.values()))
    for name, _ in PAIRED:
        cells = (interval_cell(result["minus_start"][name], "+") for result in report["arms"].values())
        table.add_row(f"{name.replace('_', ' ')} minus start, paired", "-", *cells)

    def per_step(key: str, form: str) -> list[str]:
        return [
            " ".join(format(r.get(key, 0.0), form) for r in result.get("steps", [])) or "-" for result in arms.values()
        ]

    table.add_row("train reward per step", *per_step("reward_mean", ".2f"))
    table.add_row("sequences trained per step", *per_step("sequences", ".0f"))
    table.add_row("AIR per rollout, per step", *per_step("air_reward", ".3f"))
    console.print(table)


async def main(args: argparse.Namespace) -> None:
    console = Console()
    began = time.perf_counter()
    config = job_config(args)
    air_config = AIRConfig.model_validate_json(args.air) if args.air else SUPPORT_AIR
    report: dict = {
        "machine": describe(),
        "config": config.model_dump(mode="json"),
        "from": str(args.from_dir) if args.from_dir else None,
        "arm_order": args.arms,
        "air": air_config.model_dump(),
        "arms": {},
    }
    with tempfile.TemporaryDirectory(prefix="flywheel-credit-support-") as tmp:
        home = Path(tmp)
        db = build_database(home / "support.db", seed=config.seed, customers=config.customers)
        sft, report["start"], report["sft"] = await start(home, args, config, db.path)
        accuracy = report["start"]["behaviour"]["resolution_accuracy"]["mean"]
        console.print(f"start ({sft.name}): test resolution accuracy {accuracy:.1%}")
        try:
            for name in args.arms:
                t0 = time.perf_counter()
                arm = report["arms"][name] = await run_arm(name, home, sft, config, air_config, db.path)
                arm["wall_seconds"] = time.perf_counter() - t0
                arm["minus_start"] = paired(report["start"]["tickets"], arm["tickets"])
                console.print(f"{name}: done in {time.perf_counter() - t0:.0f} s")
        finally:  # an arm that failed loses only itself: the arms done so far are written
            report["wall_seconds"] = time.perf_counter() - began
            path = save_result("credit_support", report)
            plot(report, path.with_suffix(".png"))
            print_table(console, report)
            console.print(f"wall time {report['wall_seconds'] / 60:.1f} min; plot: {path.with_suffix('.png')}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    origin = parser.add_mutually_exclusive_group(required=True)
    origin.add_argument("--from", dest="from_dir", type=Path, help="a checkpoint directory of the support job")
    origin.add_argument("--sft-epochs", type=int, help="run the job's SFT warm start here instead (at most N epochs)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per arm")
    parser.add_argument("--tickets", type=int, default=3, help="tickets per step")
    parser.add_argument("--group-size", type=int, default=6, help="rollouts per ticket")
    parser.add_argument("--test", type=int, default=50, help="held-out test tickets (the job's first N)")
    parser.add_argument("--val", type=int, default=JobConfig().val_tickets, help="validation tickets (--sft-epochs)")
    parser.add_argument("--sft-examples", type=int, default=JobConfig().sft_examples, help="demonstration tickets")
    parser.add_argument("--temperature", type=float, default=JobConfig().temperature)
    parser.add_argument("--lr", type=float, help="RL learning rate (default: the job's)")
    parser.add_argument("--air", help="AIRConfig as JSON (default: SUPPORT_AIR; '{}': AIRConfig's own defaults)")
    parser.add_argument("--seed", type=int, default=0, help="the job's seed: database, tickets, splits")
    args = parser.parse_args()
    for name in ("steps", "tickets", "group_size", "test", "val", "sft_examples", "sft_epochs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.group_size < 2:
        parser.error(f"--group-size must be at least 2 (GRPO compares a ticket's rollouts), got {args.group_size}")
    if args.from_dir is not None and not (args.from_dir / layout.STATE).is_file():
        parser.error(
            f"--from {args.from_dir}: not a complete checkpoint directory (no trainer_state.json); expected "
            "$FLYWHEEL_HOME/support/models/<name>/checkpoints/<step>"
        )
    if args.air:
        try:
            AIRConfig.model_validate_json(args.air)
        except ValueError as exc:
            parser.error(f"--air: {exc}")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
