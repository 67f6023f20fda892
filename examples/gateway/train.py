"""Train a model on an agent we did not write, through the gateway and runners, end to end on this machine.

    python examples/gateway/train.py [--framework langchain|agents_sdk] [--steps 2] [--tasks 2] [--group 4]

1. A LocalBackend serves the model, and with it the gateway (episodes, the rollout queue).
2. Runner processes (``flywheel runner``, as they would run on other machines) claim attempts; for each, the
   unmodified framework agent (``langchain_agent.py`` or ``agents_sdk_agent.py``) runs in a process of its own with
   OPENAI_BASE_URL set to the attempt's episode URL, and ``runner_agents.py`` scores what it printed.
3. Each step enqueues arithmetic tasks (a group of rollouts each), waits for their groups and trains on them: every
   trained token is one the model sampled, whatever the framework re-serialised.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from flywheel import LocalBackend, TrainableModel
from flywheel.gateway.client import QueueClient, TaskSpec
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.train.config import TrainConfig

HERE = Path(__file__).parent


def tasks(step: int, n: int, group: int, model: str, rng: random.Random) -> list[TaskSpec]:
    specs = []
    for i in range(n):
        a, b = rng.randint(2, 19), rng.randint(2, 19)
        payload = {"question": f"{a} * {b}", "answer": a * b}
        specs.append(
            TaskSpec(task_id=f"gateway-example-{step}-{i}-{a}x{b}", payload=payload, group_size=group, model=model)
        )
    return specs


def start_runners(root: str, framework: str, concurrency: int) -> subprocess.Popen:
    flywheel = Path(sys.executable).parent / "flywheel"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [str(flywheel), "runner", "--url", root, "--agent", f"runner_agents:{framework}"]
    return subprocess.Popen([*command, "--concurrency", str(concurrency)], env=env)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=["langchain", "agents_sdk"], default="langchain")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=2, help="tasks (groups) per step")
    ap.add_argument("--group", type=int, default=4, help="rollouts per task")
    ap.add_argument("--home", default=None, help="FLYWHEEL_HOME for this run (default: a temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    backend = LocalBackend(path=args.home or tempfile.mkdtemp(prefix="gateway-example-"))
    model = TrainableModel(name="gateway-agent", project="gateway-example", base_model=EMBEDDED_MODEL)
    await model.register(backend)
    root = backend.base_url.removesuffix("/v1")
    runners = start_runners(root, args.framework, concurrency=args.tasks * args.group)
    rng = random.Random(args.seed)
    try:
        async with QueueClient(root) as queue:
            for step in range(args.steps):
                groups = await queue.gather_groups(
                    tasks(step, args.tasks, args.group, model.name, rng), max_wait=1800, allow_failed=True
                )
                rewards = [t.reward for g in groups for t in g]
                result = await model.train(groups, config=TrainConfig(learning_rate=1e-4))
                trained = "skipped (no reward variance)" if result.get("skipped") else f"loss {result['loss']:.4f}"
                print(
                    f"step {step}: {len(rewards)} episodes, mean reward {sum(rewards) / max(len(rewards), 1):.2f}, "
                    f"{trained}, model step {await model.get_step()}",
                    flush=True,
                )
    finally:
        runners.terminate()  # runners give their attempts back on SIGTERM
        runners.wait(timeout=60)
        await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
