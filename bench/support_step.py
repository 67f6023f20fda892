"""One RL update of the support job (flywheel/examples/support) on the real model: the trainer's step alone, no
sampling. ``--tickets`` tickets x ``--episodes`` expert episodes each (multi-turn tool-calling trajectories sharing
the ~740-token system prompt), their assistant turns given token ids as T=0.7 samples would be, random rewards;
every weight trained, bf16 autocast, the job's RL config (DAPO, micro-batches of 3072 tokens).

    .venv/bin/python bench/support_step.py [--tickets 1] [--episodes 6] [--threads 2] [--label after]

Writes bench/results/support_step-<time>.json with the micro-batches' layouts and the step's seconds. To time
another tree (e.g. before a change): ``git archive <commit> flywheel | tar -x -C /tmp/old``, ``PYTHONPATH=/tmp/old``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import torch
from machine import describe, save_result  # bench/machine.py
from openai.types.chat.chat_completion import Choice

from flywheel.examples.support.agent import expert_rollout
from flywheel.examples.support.db import build_database
from flywheel.examples.support.grading import support_stack
from flywheel.examples.support.tickets import generate_tickets
from flywheel.examples.support.train import JobConfig
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.train import trainer as trainer_module
from flywheel.train.batch import assistant_turn_tokens, pack, trajectory_sequences
from flywheel.train.config import TrainedWeights
from flywheel.types import TrajectoryGroup, choice_to_message, set_sampled_tokens


async def groups(tokenizer, tickets: int, episodes: int, workdir: Path) -> list[TrajectoryGroup]:
    db = build_database(workdir / "support.db", seed=0, customers=400)
    stack = support_stack(8, 0.25)
    rng = random.Random(0)
    out = []
    for ticket in generate_tickets(db.path, "train", 64 + tickets, seed=0)[64:]:
        trajectories = await asyncio.gather(
            *(
                expert_rollout(ticket, db.path, stack, failure_rate=0.3, seed=rng.randrange(1 << 30))
                for _ in range(episodes)
            )
        )
        for trajectory in trajectories:
            context: list[dict] = []
            for item in trajectory.messages_and_choices:
                if isinstance(item, Choice):
                    message = choice_to_message(item)
                    prompt, completion = assistant_turn_tokens(tokenizer, context, message, trajectory.tools)
                    set_sampled_tokens(item, prompt, completion, 0.7)
                    context.append(message)
                else:
                    context.append(dict(item))
            trajectory.reward = rng.random()
        out.append(TrajectoryGroup(trajectories))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tickets", type=int, default=1)
    ap.add_argument("--episodes", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--label", default="", help="a name for this tree in the result file (e.g. before, after)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_model(EMBEDDED_MODEL)
    engine = InferenceEngine(model, tokenizer)
    config = JobConfig().rl
    try:
        with tempfile.TemporaryDirectory() as workdir:
            batch = asyncio.run(groups(tokenizer, args.tickets, args.episodes, Path(workdir)))
        sequences = [s for g in batch for t in g.trajectories for s in trajectory_sequences(t, tokenizer, 1.0)]
        layouts = [(mb.lengths, mb.context) for mb in pack(sequences, config.micro_batch_tokens)]
        for lengths, context in layouts:
            print("micro-batch", lengths, context, flush=True)
        trainer = trainer_module.Trainer(engine, TrainedWeights(mode="full"))
        start = time.perf_counter()
        metrics = trainer.rl_step(batch, config)
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    print(f"RL update: {seconds:.1f} s, {metrics['tokens_trained']:.0f} trained tokens", flush=True)
    result = {
        "label": args.label,
        "machine": describe(),
        "trainer": trainer_module.__file__,
        "threads": args.threads,
        "tickets": args.tickets,
        "episodes": args.episodes,
        "micro_batches": layouts,
        "seconds": seconds,
        "metrics": metrics,
    }
    save_result("support_step", result)


if __name__ == "__main__":
    main()
