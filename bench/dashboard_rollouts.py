"""How fast the dashboard opens a big run's rollouts (issue #42: "a run with 10,000 trajectories opens its rollouts
page in under a second"): a store holding one run of ``--steps`` x ``--per-step`` saved trajectories (tool-using
chats of ~2 KB, as the calculator job saves them) beside ``--other-runs`` other runs of the same size, served by
``flywheel dashboard``'s app on a loopback port; each request a page makes, timed over real HTTP (median and max of
``--repeats`` after one warm-up): the runs table, the run's rollouts page (its steps and splits), a page of a step's
trajectories (first and last page), a step's groups ranked, one group side by side and one trajectory.

    .venv/bin/python bench/dashboard_rollouts.py                     # 10,000 trajectories, SQLite
    .venv/bin/python bench/dashboard_rollouts.py --steps 200 --per-step 100

Writes bench/results/dashboard_rollouts-<time>.json (``bench/machine.py``'s description of the machine with it)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from machine import describe, save_result  # bench/machine.py

from flywheel.dashboard.app import create_dashboard_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store, history
from flywheel.store.history import RunKey

GROUP = 8  # trajectories of one prompt in a row: a group


def trajectory(step: int, i: int) -> str:
    """A calculator-like episode: the task, a tool call, its result, the answer, a reward."""
    question = f"Step {step}, problem {i // GROUP}: a shop sells {i} pens at $3 each and {step} pads at $5; total?"
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{i}*3+{step}*5"})}}  # fmt: skip
    choice = {"index": 0, "finish_reason": "tool_calls", "logprobs": None,
              "message": {"role": "assistant", "content": None, "tool_calls": [call]}}  # fmt: skip
    answer = {"index": 0, "finish_reason": "stop", "logprobs": None,
              "message": {"role": "assistant", "content": f"The total is {i * 3 + step * 5}. " * 8}}  # fmt: skip
    return json.dumps({
        "messages_and_choices": [
            {"role": "system", "content": "You are a careful calculator agent. Use the calculator tool. " * 6},
            {"role": "user", "content": question},
            choice,
            {"role": "tool", "tool_call_id": f"call_{i}", "content": str(i * 3 + step * 5)},
            answer,
        ],
        "reward": (i % 3) / 2,
        "metrics": {"turns": 2, "tool_calls": 1, "correct": float(i % 2)},
        "metadata": {"problem": i // GROUP},
        "logs": [],
    })  # fmt: skip


def fill(store: Store, key: RunKey, steps: int, per_step: int) -> None:
    with store.session() as s:
        history.add(
            s, key, [{"step": k, "split": "train", "time": 1.7e9 + k, "reward_mean": 0.5} for k in range(steps)]
        )
    for step in range(steps):
        with store.session() as s:
            history.add_trajectories(s, key, "train", step, [trajectory(step, i) for i in range(per_step)])


def timed(http: httpx.Client, path: str, repeats: int) -> dict[str, float]:
    http.get(path).raise_for_status()  # warm-up
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        http.get(path).raise_for_status()
        seconds.append(time.perf_counter() - began)
    return {"median_ms": statistics.median(seconds) * 1000, "max_ms": max(seconds) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--per-step", type=int, default=100)
    parser.add_argument("--other-runs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        store = Store(f"sqlite:///{home}/store.db")
        began = time.perf_counter()
        key = RunKey("bench", "big", "run-0")
        for n in range(args.other_runs):
            fill(store, RunKey("bench", f"other-{n}", f"run-{n + 1}"), args.steps, args.per_step)
        fill(store, key, args.steps, args.per_step)
        filled = time.perf_counter() - began
        size = (Path(home) / "store.db").stat().st_size
        server = BackgroundServer(create_dashboard_app(store, Path(home))).start()
        middle, last = args.steps // 2, args.per_step // 50 * 50
        run = f"/ui/api/runs/{key.project}/{key.model}"
        try:
            with httpx.Client(base_url=f"http://{server.host}:{server.port}", timeout=60) as http:
                some = http.get(f"{run}/trajectories", params={"step": middle, "limit": 1}).json()["items"][0]["id"]
                paths = {
                    "runs table": "/ui/api/runs",
                    "rollouts page (steps and splits)": f"{run}/rollouts",
                    "a step's trajectories, first page": f"{run}/trajectories?step={middle}",
                    "a step's trajectories, last page": f"{run}/trajectories?step={middle}&offset={last}",
                    "all splits' trajectories, page 100": f"{run}/trajectories?offset={50 * 99}",
                    "a step's groups, ranked": f"{run}/groups?step={middle}",
                    "one group side by side": f"{run}/groups/3?step={middle}",
                    "one trajectory": f"/ui/api/trajectories/{some}",
                }
                timings = {name: timed(http, path, args.repeats) for name, path in paths.items()}
        finally:
            server.stop()
            store.close()
    result = {
        "benchmark": "dashboard_rollouts",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": describe(),
        "trajectories_in_run": args.steps * args.per_step,
        "runs": args.other_runs + 1,
        "store_mb": round(size / 2**20, 1),
        "fill_s": round(filled, 1),
        "repeats": args.repeats,
        "timings": {k: {m: round(v, 1) for m, v in t.items()} for k, t in timings.items()},
    }
    print(json.dumps(result, indent=2))
    save_result("dashboard_rollouts", result)


if __name__ == "__main__":
    main()
