"""A small training run for tests/test_crash.py to kill and restart: ``python tests/crash_run.py HOME STEPS``.

Registers a LoRA model on the embedded model (resuming from its latest checkpoint), then until STEPS optimizer
steps: draws two questions with python's ``random`` (restored from the checkpoint on resume), gathers 2 groups x 2
short real rollouts through the engine's HTTP API, trains one step (a checkpoint every step, with the data
position as ``extra``) and prunes checkpoints by ``reward_mean``. It prints phase markers on stdout so that the
test can aim its kills: ``phase <name> step=<k>``.
"""

from __future__ import annotations

import asyncio
import random
import sys

import flywheel as art
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.train.config import TrainConfig

QUESTIONS = ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a city.", "Name a tree.", "Name a tool."]
SYSTEM = {"role": "system", "content": "You answer with one word."}


def phase(name: str, step: int) -> None:
    print(f"phase {name} step={step}", flush=True)


def reward(i: int, content: str) -> float:
    """Differs inside every group (i is the rollout's index), and from step to step."""
    return float(i) + (len(content) % 5) / 10


async def main(home: str, steps: int) -> None:
    phase("start", 0)
    backend = art.LocalBackend(path=home)
    model = art.TrainableModel(name="crash", project="tests", base_model=EMBEDDED_MODEL)
    try:
        await model.register(backend)
        step = await model.get_step()
        if step == 0:
            random.seed(0)
        elif await model.checkpoint_extra() != {"position": step}:
            raise SystemExit(f"resumed at step {step} with extra {await model.checkpoint_extra()}")
        phase("resumed", step)
        client = model.openai_client()

        async def rollout(q: int, i: int, draw: float) -> art.Trajectory:
            messages = [SYSTEM, {"role": "user", "content": QUESTIONS[q]}]
            r = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=4, logprobs=True)
            choice = r.choices[0]
            return art.Trajectory(
                messages_and_choices=[*messages, choice],
                reward=reward(i, choice.message.content or ""),
                metrics={"draw": draw},
            )

        while step < steps:
            phase("sampling", step + 1)
            drawn = random.sample(range(len(QUESTIONS)), 2)
            draw = float(10 * drawn[0] + drawn[1])  # recorded as train/draw: the test replays the draws
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(q, i, draw) for i in range(2)) for q in drawn), pbar_desc=None
            )
            phase("training", step + 1)
            await model.train(groups, config=TrainConfig(learning_rate=1e-3), extra={"position": step + 1})
            step = await model.get_step()
            phase("pruning", step)
            await model.delete_checkpoints("reward_mean")
            phase("done", step)
        await model.delete_checkpoints("reward_mean")  # a kill may have come between the last step and its pruning
        phase("finished", step)
    finally:
        await backend.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
