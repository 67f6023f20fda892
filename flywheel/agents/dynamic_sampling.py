"""Dynamic sampling (DAPO): draw groups until a step has enough with mixed outcomes, and say what it drew.

A GRPO group whose rollouts all got the same reward has zero advantages: it costs its rollouts and trains nothing.
After a warm start most groups of an easy pool are all-correct and most of a hard one all-wrong, and a step made of
them is skipped. ``gather_mixed_groups`` draws groups from a source (any iterator of groups not yet run, usually a
generator over the unused items of a pool) in waves, runs each wave concurrently (``gather_trajectory_groups``),
keeps the groups the keep rule accepts (by default: rewards that differ) and draws again until it has the number
wanted, the draws allowed, the time allowed or the source are used up. Each item of the source is drawn once, so
nothing is trained twice; the dropped groups come back too (a curriculum learns from them). A wave is sized from
the share kept so far (``DynamicSampler`` carries it from step to step), so a step rarely needs more than two.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from flywheel.gather import gather_trajectory_groups, phase_seconds
from flywheel.train.credit import has_reward_variance, total_reward
from flywheel.types import TrajectoryGroup

GroupSource = Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]]
StopReason = Literal["full", "max_draws", "max_seconds", "exhausted"]


class DynamicSamplingConfig(BaseModel):
    """DAPO's dynamic sampling, per training step: ``max_draws`` (a multiple of the groups wanted, like verl's
    ``max_num_gen_batches``) bounds the groups drawn, ``max_seconds`` the wall time (checked between waves: a wave
    in flight finishes); ``oversample`` is the first wave's size over the groups wanted, before any share kept is
    known."""

    max_draws: float = Field(4.0, ge=1.0)
    max_seconds: float | None = Field(None, gt=0)
    oversample: float = Field(1.5, ge=1.0)


class NoMixedGroupsError(RuntimeError):
    """The source ran dry before any group with mixed outcomes was drawn: nothing to train on."""


@dataclass
class MixedGroups:
    """What one step drew: the groups kept (to train on) and dropped (in the order they finished), and why the
    drawing stopped."""

    kept: list[TrajectoryGroup]
    dropped: list[TrajectoryGroup]
    wanted: int
    waves: int
    stop: StopReason

    @property
    def drawn(self) -> int:
        return len(self.kept) + len(self.dropped)

    def metrics(self) -> dict[str, float]:
        """For the step's history row: ``groups_drawn``, ``groups_kept``, ``groups_dropped``, ``sampling_waves``,
        ``sampling_short`` (1 when the step has fewer groups than wanted), and of every group drawn (the kept
        ones alone would hide what the dropped ones cost, and lean to a mean reward near one half):
        ``drawn_reward_mean``, ``rollout_seconds`` and ``score_seconds``. With groups kept,
        ``kept_mixed_in_half``: the share of them whose first half of rollouts already had rewards that differ
        (what screening each item with half its rollouts, and completing only the mixed ones, would keep)."""
        rewards = [total_reward(t) for g in self.kept + self.dropped for t in g.trajectories]
        metrics = {
            "groups_drawn": self.drawn,
            "groups_kept": len(self.kept),
            "groups_dropped": len(self.dropped),
            "sampling_waves": self.waves,
            "sampling_short": float(len(self.kept) < self.wanted),
            "drawn_reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            **phase_seconds(self.kept + self.dropped),
        }
        if self.kept:
            halves = [TrajectoryGroup(g.trajectories[: (len(g.trajectories) + 1) // 2]) for g in self.kept]
            mixed = sum(has_reward_variance(half) for half in halves)
            metrics["kept_mixed_in_half"] = mixed / len(self.kept)
        return metrics


@dataclass
class DynamicSampler:
    """Dynamic sampling across steps: the config and the share of drawn groups kept so far (which sizes the
    waves)."""

    config: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    keep: Callable[[TrajectoryGroup], bool] = has_reward_variance
    drawn: int = 0
    kept: int = 0

    def keep_rate(self) -> float:
        """The share of groups kept so far, shrunk towards ``1 / oversample`` (as if ``oversample`` groups were
        drawn and one kept before the first): a step that kept nothing yet grows its next wave a few times over,
        not to every draw left. Never below ``1 / max_draws``."""
        rate = (self.kept + 1) / (self.drawn + self.config.oversample)
        return max(rate, 1 / self.config.max_draws)

    async def draw(
        self,
        source: GroupSource | Iterator[TrajectoryGroup | Awaitable[TrajectoryGroup]],
        groups: int,
        *,
        pbar_desc: str | None = "dynamic sampling",
        max_exceptions: int | float = 0,
        max_concurrency: int | None = None,
    ) -> MixedGroups:
        """At least ``groups`` groups the keep rule accepts, drawn from ``source`` in waves (a wave may bring more:
        all are kept, since their rollouts are paid for), or fewer once ``max_draws`` x ``groups`` groups were drawn,
        ``max_seconds`` passed or the source ran dry. Raises ``NoMixedGroupsError`` when the source ran dry with
        none kept. ``max_exceptions`` and ``max_concurrency`` apply to each wave as in
        ``gather_trajectory_groups``."""
        if groups < 1:
            raise ValueError(f"dynamic sampling needs at least 1 group per step, got {groups}")
        items = iter(source)
        limit = math.ceil(self.config.max_draws * groups)
        start = time.monotonic()
        kept: list[TrajectoryGroup] = []
        dropped: list[TrajectoryGroup] = []
        waves = 0
        stop: StopReason = "full"
        while len(kept) < groups:
            drawn = len(kept) + len(dropped)
            if drawn >= limit:
                stop = "max_draws"
                break
            if self.config.max_seconds is not None and time.monotonic() - start >= self.config.max_seconds:
                stop = "max_seconds"
                break
            size = min(limit - drawn, math.ceil((groups - len(kept)) / self.keep_rate()))
            wave = list(itertools.islice(items, size))
            if not wave:
                stop = "exhausted"
                break
            waves += 1
            desc = None if pbar_desc is None else f"{pbar_desc} (wave {waves}: {len(wave)} groups)"
            finished = await gather_trajectory_groups(
                wave, pbar_desc=desc, max_exceptions=max_exceptions, max_concurrency=max_concurrency
            )
            accepted = [self.keep(group) for group in finished]
            kept += [g for g, ok in zip(finished, accepted) if ok]
            dropped += [g for g, ok in zip(finished, accepted) if not ok]
            self.drawn += len(finished)
            self.kept += sum(accepted)
            if len(wave) < size:  # the source gave fewer than asked: it is dry
                stop = "exhausted" if len(kept) < groups else "full"
                break
        result = MixedGroups(kept, dropped, groups, waves, stop)
        if not kept and stop == "exhausted":
            raise NoMixedGroupsError(
                f"dynamic sampling: the source ran dry after {result.drawn} groups this step, none with mixed"
                " outcomes (every group's rollouts got the same reward): nothing to train on. Add items to the pool,"
                " or raise the sampling temperature or the group size so that outcomes differ."
            )
        return result


async def gather_mixed_groups(
    source: GroupSource,
    groups: int,
    *,
    config: DynamicSamplingConfig | None = None,
    keep: Callable[[TrajectoryGroup], bool] = has_reward_variance,
    pbar_desc: str | None = "dynamic sampling",
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
) -> MixedGroups:
    """One step's dynamic sampling with a fresh ``DynamicSampler`` (use one sampler across steps to size the waves
    from what earlier steps kept)."""
    sampler = DynamicSampler(config or DynamicSamplingConfig(), keep)
    return await sampler.draw(
        source, groups, pbar_desc=pbar_desc, max_exceptions=max_exceptions, max_concurrency=max_concurrency
    )
