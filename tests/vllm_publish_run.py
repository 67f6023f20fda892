"""A LoRA training run on a VLLMBackend for tests/test_vllm_backend.py to kill while it publishes a step:
``python tests/vllm_publish_run.py VLLM_URL HOME STEPS``.

Registers the model ``calc`` (resuming from its latest checkpoint) on a VLLMBackend over the vLLM server at
VLLM_URL (the test's stand-in), then until STEPS steps: two answers sampled through the backend's server (rewards 0
and 1), one step with a checkpoint, whose weights are then published to the server as ``calc@STEP``. Prints
``trained step=<k>`` after each step, so that the test can aim its kill at the next one's publish.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.model import TrainableModel
from flywheel.train.config import TrainConfig
from flywheel.types import Trajectory, TrajectoryGroup
from flywheel.vllm_backend import VLLMBackend

PROMPT = [{"role": "user", "content": "Name a fruit."}]


async def main(url: str, home: str, steps: int) -> None:
    backend = VLLMBackend([url], path=home, dtype=torch.float32)
    model = TrainableModel(name="calc", project="p", base_model=EMBEDDED_MODEL)
    try:
        await model.register(backend)
        client = model.openai_client()
        while await model.get_step() < steps:
            trajectories = []
            for reward in (0.0, 1.0):
                r = await client.chat.completions.create(
                    model=model.name, messages=PROMPT, max_tokens=6, temperature=1.0, logprobs=True
                )
                trajectories.append(Trajectory(messages_and_choices=[*PROMPT, r.choices[0]], reward=reward))
            await model.train([TrajectoryGroup(trajectories)], config=TrainConfig(learning_rate=1e-2))
            print(f"trained step={await model.get_step()}", flush=True)
    finally:
        await backend.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
