"""Where an RL step's time goes: torch.profiler over Flywheel's sampling and training of one step (the same work as
bench/step_time.py), printing the top operators by self CPU time for each phase.

    .venv/bin/python bench/profile_step.py [--prompts 4] [--group 8] [--new-tokens 64] [--top 15] [--model DIR]

With CUDA the GPU activity is profiled too. Each phase is first timed without the profiler.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from step_time import LEARNING_RATE, LORA, closeness, prompts
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from flywheel.gather import gather_trajectory_groups
from flywheel.inference.loading import EMBEDDED_MODEL, resolve_model
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.train.config import TrainConfig
from flywheel.types import Trajectory, TrajectoryGroup


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--model", default=EMBEDDED_MODEL, help="the embedded model (default) or a local HF checkpoint dir")
    args = ap.parse_args()

    async with LocalBackend(serve_http=True) as backend:
        model = TrainableModel(
            name=f"profile-{time.time_ns()}",
            project="bench",
            base_model=str(resolve_model(args.model).path),
            trained_weights=LORA,
        )
        await model.register(backend)
        client = model.openai_client()

        async def rollout(question: str, answer: int) -> Trajectory:
            messages = [{"role": "user", "content": question}]
            r = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=messages,
                max_tokens=args.new_tokens,
                temperature=1.0,
                logprobs=True,
                extra_body={"ignore_eos": True},
            )
            return Trajectory(
                messages_and_choices=[*messages, r.choices[0]],
                reward=closeness(r.choices[0].message.content or "", answer),
            )

        async def sample() -> list[TrajectoryGroup]:
            batch = prompts(args.prompts)
            return await gather_trajectory_groups(
                (TrajectoryGroup(rollout(q, a) for _ in range(args.group)) for q, a in batch), pbar_desc=None
            )

        config = TrainConfig(learning_rate=LEARNING_RATE, loss="dapo")
        await model.train(await sample(), config=config)  # warm-up
        start = time.perf_counter()
        groups = await sample()
        sampled = time.perf_counter()
        await model.train(groups, config=config)
        print(f"unprofiled step: sampling {sampled - start:.2f} s, training {time.perf_counter() - sampled:.2f} s")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        for phase in ("sampling", "training"):
            groups = await sample() if phase == "training" else None
            start = time.perf_counter()
            # the engine samples on its own thread and training runs in a worker thread: profile them all
            with profile(
                activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)
            ) as prof:
                if phase == "sampling":
                    await sample()
                else:
                    metrics = await model.train(groups, config=config)
                    assert metrics.get("sequences"), (
                        "nothing was trained (all groups had equal rewards): use larger groups"
                    )
            print(f"\n## {phase}: {time.perf_counter() - start:.2f} s (under the profiler)\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    asyncio.run(main())
