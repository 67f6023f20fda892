"""How much a support checkpoint explores: the same GRPO groups sampled at several temperatures, counting the groups
whose rewards tie (no signal under uniform credit) and the episodes that resolve.

From ``--from DIR`` (a checkpoint of ``flywheel train --task support``, hard-linked, never written), ``--steps`` x
``--tickets`` RL tickets (the job's pool, in the job's order: the first steps' tickets) x ``--group-size`` rollouts,
each rollout's seed drawing its desk's transient failures and its sampling, the same seeds at every temperature; so
a temperature's row differs from another's only by how the policy samples. Per temperature: the groups tied, the
distinct rewards per group, the mean reward and resolution, the drawn tokens' mean negative log-probability (the
engine reports the sampling distribution's, at T: an estimate of its entropy per token), and the seconds. No
training. Writes bench/results/support_exploration-<time>.json and prints a table.

    .venv/bin/python bench/support_exploration.py --from DIR --seed 1 --temperatures 0.7 1.0 1.3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from credit_support import link_checkpoint  # bench/credit_support.py
from machine import describe, save_result  # bench/machine.py
from openai.types.chat.chat_completion import Choice
from rich.console import Console
from rich.table import Table

from flywheel.checkpoints import layout
from flywheel.examples.support.db import build_database
from flywheel.examples.support.grading import support_stack
from flywheel.examples.support.train import Job, JobConfig, group_plan, job_tickets, rl_order
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.types import TrajectoryGroup


def group_stats(groups: list[TrajectoryGroup]) -> dict:
    rewards = [[t.reward for t in g.trajectories] for g in groups]
    episodes = [t for g in groups for t in g.trajectories]
    drawn = [
        lp.logprob
        for t in episodes
        for c in t.messages_and_choices
        if isinstance(c, Choice) and c.logprobs and c.logprobs.content
        for lp in c.logprobs.content
    ]
    return {
        "groups": len(groups),
        "tied": sum(len(set(r)) == 1 for r in rewards),
        "distinct_rewards": [len(set(r)) for r in rewards],
        "reward": sum(t.reward for t in episodes) / len(episodes),
        "resolved": sum(t.metrics["resolved"] for t in episodes) / len(episodes),
        "drawn_token_nll": -sum(drawn) / len(drawn) if drawn else None,
    }


async def main(args: argparse.Namespace) -> None:
    console = Console()
    config = JobConfig(seed=args.seed, groups_per_step=args.tickets, group_size=args.group_size)
    report: dict = {"machine": describe(), "from": str(args.from_dir), "config": vars(args) | {"from_dir": None}}
    rows = report["temperatures"] = {}
    with tempfile.TemporaryDirectory(prefix="flywheel-support-exploration-") as tmp:
        home = Path(tmp)
        db = build_database(home / "support.db", seed=config.seed, customers=config.customers)
        backend = LocalBackend(path=home)
        model = TrainableModel(
            name="start",
            project="support-exploration",
            base_model=config.base_model,
            trained_weights=config.trained_weights,
        )
        try:
            link_checkpoint(args.from_dir, backend, model)
            await model.register(backend)
            train, _, _ = job_tickets(db.path, config)
            pool, _ = rl_order(train[config.sft_examples :], config.seed)  # the job's RL order
            rng = random.Random(f"support-exploration:{config.seed}")
            plan = group_plan(pool[: args.steps * args.tickets], rng, config.group_size)
            stack = support_stack(config.tool_budget, config.efficiency_penalty)
            for temperature in args.temperatures:
                job = Job(config.model_copy(update={"temperature": temperature}), model, db.path, stack)
                started = time.perf_counter()
                groups = await job.groups(plan, f"T={temperature}", seeded_sampling=True)
                rows[str(temperature)] = group_stats(groups) | {"seconds": time.perf_counter() - started}
        finally:
            await backend.close()
    save_result("support_exploration", report)
    table = Table(title=f"{args.steps * args.tickets} groups x {args.group_size} rollouts from {args.from_dir}")
    for column in ("T", "groups tied", "distinct rewards per group", "reward", "resolved", "drawn-token NLL", "s"):
        table.add_column(column)
    for temperature, r in rows.items():
        nll = "-" if r["drawn_token_nll"] is None else f"{r['drawn_token_nll']:.3f}"
        table.add_row(
            temperature,
            f"{r['tied']} of {r['groups']}",
            " ".join(map(str, r["distinct_rewards"])),
            f"{r['reward']:.3f}",
            f"{r['resolved']:.3f}",
            nll,
            f"{r['seconds']:.0f}",
        )
    console.print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="from_dir", type=Path, required=True, help="a support job checkpoint directory")
    parser.add_argument("--seed", type=int, default=0, help="the job's seed: database, tickets, splits")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.3])
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps' worth of tickets")
    parser.add_argument("--tickets", type=int, default=4, help="tickets per step")
    parser.add_argument("--group-size", type=int, default=6, help="rollouts per ticket")
    args = parser.parse_args()
    if not (args.from_dir / layout.STATE).is_file():
        parser.error(f"--from {args.from_dir}: not a complete checkpoint directory (no trainer_state.json)")
    if args.group_size < 2 or args.steps < 1 or args.tickets < 1:
        parser.error("--group-size must be at least 2, --steps and --tickets at least 1")
    if any(t <= 0 for t in args.temperatures):
        parser.error("--temperatures must be above 0 (0 is greedy: every group would tie)")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
