"""The jobs' SFT arm: a warm start with a progress bar, one epoch at a time, each validated, and the best epoch kept.

An RL phase is only as impressive as the SFT arm it is compared with: a fixed number of epochs may stop SFT short
(part of RL's lift would then be SFT's), or past its best. ``sft_best_epoch`` trains epoch by epoch until
``patience`` epochs in a row fail to beat the best validation reward, restores the best epoch's weights, and
returns every epoch's validation reward (the curve a report shows beside RL's). Both example jobs use it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

from tqdm.auto import tqdm

from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.train.config import SFTConfig
from flywheel.types import Trajectory


async def warm_start(model: TrainableModel, demos: list[Trajectory], config: SFTConfig) -> list[dict[str, float]]:
    """SFT on the demonstrations with a progress bar: each step's loss and tokens per second, the time left."""
    steps = config.epochs * math.ceil(len(demos) / config.batch_size)  # one per batch (a non-finite one is skipped)
    with tqdm(total=steps, desc="SFT warm start", unit="step") as bar:

        def progress(metrics: dict[str, float]) -> None:  # on the engine's thread, after each step
            tokens_per_second = metrics["tokens_trained"] / metrics["train_seconds"]
            bar.set_postfix({"loss": f"{metrics['loss']:.3f}", "tokens/s": f"{tokens_per_second:.0f}"}, refresh=False)
            bar.update()

        return await model.train_sft(demos, config, progress=progress)


def sft_converged(val_rewards: list[float], patience: int) -> bool:
    """Whether SFT stops after these epochs' validation rewards: the last ``patience`` epochs all failed to beat
    the best reward before them (an equal reward is no improvement)."""
    first_best = val_rewards.index(max(val_rewards))
    return len(val_rewards) - 1 - first_best >= patience


async def sft_best_epoch(
    model: TrainableModel,
    backend: LocalBackend,
    demos: list[Trajectory],
    config: SFTConfig,
    *,
    max_epochs: int,
    patience: int,
    validate: Callable[[int], Awaitable[list[Trajectory]]],
) -> tuple[int, list[float], float]:
    """SFT one epoch at a time (``config`` with one epoch), each validated by ``validate(epoch)`` (the trajectories
    are logged as the ``val`` split), until ``sft_converged`` or ``max_epochs``; the best epoch's weights are
    restored: (its step, every epoch's val reward, the slowest validation's seconds)."""
    one_epoch = config.model_copy(update={"epochs": 1})
    epochs: list[tuple[float, int]] = []  # each epoch's val reward and step
    val_seconds = 0.0
    for epoch in range(max_epochs):
        await warm_start(model, demos, one_epoch)
        started = time.perf_counter()
        metrics = await model.log(await validate(epoch + 1), split="val")
        val_seconds = max(val_seconds, time.perf_counter() - started)
        epochs.append((metrics["val/reward"], await model.get_step()))
        await model.delete_checkpoints("val/reward")
        if sft_converged([reward for reward, _ in epochs], patience):
            break
    best = max(epochs)[1]  # the best reward's step; of equal ones the later, as delete_checkpoints keeps
    if best != await model.get_step():
        await backend.restore(model, best)
    return best, [reward for reward, _ in epochs], val_seconds
