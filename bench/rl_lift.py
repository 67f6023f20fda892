"""What RL adds over a fair SFT arm on the main job, with each technique on and off (issue #38).

Each arm is the whole main job (``flywheel.examples.calculator.train.run``: baseline, the SFT arm at the best of
its epochs by validation, GRPO, the best checkpoint by validation, the test) with one setting changed, run for each
seed in a FLYWHEEL_HOME of its own. Per run it records the paired difference RL - SFT on the same test problems
with its 95% bootstrap interval, the wall time, and per RL step the share of groups without reward variance (of
those drawn) and the policy's per-token entropy on the trained rollouts. The results file is rewritten after every
run, so a long sweep stopped early keeps what it finished.

    .venv/bin/python bench/rl_lift.py --seeds 0 1 2 --arms dynamic fixed          # ~12 min per run on 2 cores
    .venv/bin/python bench/rl_lift.py --seeds 0 --arms dynamic --smoke             # a minute: the plumbing
    .venv/bin/python bench/rl_lift.py --seeds 0 --arms dynamic async1              # the pipeline against sync
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flywheel.examples.calculator.train import JobConfig, run

ARMS = {
    "dynamic": {},  # the job's defaults: DAPO's dynamic sampling, the SFT arm at its best epoch
    "fixed": {"dynamic_sampling": None},  # groups_per_step problems per step, whatever their groups' outcomes
    "clip-higher": {"rl": {"epsilon_high": 0.28}},  # DAPO's decoupled upper clip, with dynamic sampling
    # the asynchronous pipeline (issue #40): the next step's rollouts drawn while a step trains, at most 1 step stale
    "async1": {"async_steps": 1},
}


def arm_config(arm: str, seed: int, smoke: bool) -> JobConfig:
    config = JobConfig(seed=seed, name=f"{arm}-seed{seed}")
    update = dict(ARMS[arm])
    if "rl" in update:
        update["rl"] = config.rl.model_copy(update=update["rl"])
    if smoke:
        update |= {"rl_steps": 2, "groups_per_step": 1, "group_size": 2, "eval_every": 2, "sft_examples": 8}
        update |= {"sft_epochs": 1, "val_problems": 4, "test_problems": 4}
    return config.model_copy(update=update)


def per_step(report: dict) -> dict[str, list[float]]:
    """Each RL step's share of groups without reward variance among those drawn, its trained tokens' mean
    entropy (nats; absent where the step trained nothing), and with dynamic sampling the share of kept groups
    already mixed in their first half of rollouts (what screening items with half a group would keep)."""
    rows = report["rl_history"]
    zero = [
        r["groups_dropped"] / r["groups_drawn"] if "groups_drawn" in r else r["zero_variance_fraction"] for r in rows
    ]
    return {
        "zero_variance_share": zero,
        "entropy": [r["entropy"] for r in rows if "entropy" in r],
        "kept_mixed_in_half": [r["kept_mixed_in_half"] for r in rows if "kept_mixed_in_half" in r],
        # the pipeline's: how many steps older than the trained weights each step's rollouts were, groups dropped
        "staleness_max": [r["staleness_max"] for r in rows if "staleness_max" in r],
        "stale_groups": [r["stale_groups"] for r in rows if "stale_groups" in r],
        "val_rewards": [r["val/reward"] for r in rows if "val/reward" in r],
    }


async def main(args: argparse.Namespace) -> None:
    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rl_lift-{time.strftime('%Y%m%d-%H%M%S')}.json"
    results: list[dict] = []
    for seed in args.seeds:
        for arm in args.arms:
            with tempfile.TemporaryDirectory(prefix="flywheel-rl-lift-") as home:
                os.environ["FLYWHEEL_HOME"] = home
                report = await run(arm_config(arm, seed, args.smoke), console)
            lift = report["rl_minus_sft"]
            results.append({
                "arm": arm, "seed": seed, "base": report["base"], "sft": report["sft"], "rl": report["rl"],
                "rl_minus_sft": lift["mean"], "interval": lift["interval"], "best_step": report["best_step"],
                "sft_epoch_val_rewards": report["sft_epoch_val_rewards"], "wall_seconds": report["wall_seconds"],
                "rl_seconds": report.get("rl_seconds"), **per_step(report),
            })  # fmt: skip
            path.write_text(json.dumps({"cpu": cpu(), "smoke": args.smoke, "runs": results}, indent=2))
    table = Table(title=f"RL - SFT on the main job's test problems (paired, 95% bootstrap); {path.name}")
    for col in ("arm", "seed", "SFT arm", "SFT+RL", "RL - SFT", "interval", "zero-variance", "entropy", "RL min",
                "min"):  # fmt: skip
        table.add_column(col)
    for r in results:
        lo, hi = r["interval"]
        table.add_row(
            r["arm"], str(r["seed"]), f"{r['sft']:.0%}", f"{r['rl']:.0%}", f"{100 * r['rl_minus_sft']:+.0f}",
            f"[{100 * lo:+.0f}, {100 * hi:+.0f}]", f"{statistics.mean(r['zero_variance_share']):.0%}",
            f"{statistics.mean(r['entropy']):.3f}" if r["entropy"] else "-",
            f"{r['rl_seconds'] / 60:.1f}" if r["rl_seconds"] else "-", f"{r['wall_seconds'] / 60:.1f}",
        )  # fmt: skip
    console.print(table)
    console.print(f"results: {path}")


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            flags = Path("/proc/cpuinfo").read_text()
            isa = "AMX" if "amx_tile" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "AVX2"
            return f"{line.split(':', 1)[1].strip()} ({isa}), {os.cpu_count()} cores"
    return "unknown"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["dynamic", "fixed"])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the plumbing, measures nothing")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    asyncio.run(main(parser.parse_args()))
