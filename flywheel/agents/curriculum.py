"""A curriculum over scenarios: track each scenario's success across steps and sample the informative ones.

GRPO learns only from groups whose outcomes differ: a scenario the policy always solves, or never does, gives a
zero-variance group that trains nothing. DAPO's dynamic sampling draws more prompts and drops those groups; this
pool does it ahead of time. Each scenario's success rate p is estimated from its recent attempts with a uniform
prior ((successes + 1) / (attempts + 2)), and scenarios are drawn with weight p (1 - p): highest for mixed outcomes
and for scenarios never tried, lowest for the settled ones. A scenario whose last ``window`` groups were all solved
(every attempt) or all failed is retired; with ``retry_after`` it comes back that many steps later, since the policy
may have learnt to solve it, or forgotten how.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Generic, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, Field

from flywheel.types import TrajectoryGroup

S = TypeVar("S")


class CurriculumConfig(BaseModel):
    success_threshold: float = 1.0  # an attempt succeeded when its reward is at least this
    window: int = Field(3, ge=1)  # recent groups of a scenario that count (for its estimate and for retiring it)
    retry_after: int | None = Field(None, ge=1)  # steps until a retired scenario returns; None: never
    seed: int = 0


def mixed_outcome_weight(successes: float, attempts: int) -> float:
    """The sampling weight p (1 - p), p the success rate's posterior mean under a uniform prior ((successes + 1) /
    (attempts + 2): 0.5 with no attempts, never exactly 0 or 1): 0.25 untried, highest for mixed outcomes."""
    p = (successes + 1) / (attempts + 2)
    return p * (1 - p)


class ScenarioStats(BaseModel):
    groups: list[tuple[int, int]] = []  # (successes, attempts) of each recent group, oldest first
    last_step: int | None = None
    retired: Literal["solved", "unsolved"] | None = None
    retired_at: int | None = None

    @property
    def weight(self) -> float:
        """``mixed_outcome_weight`` of the recent groups' successes and attempts."""
        return mixed_outcome_weight(sum(s for s, _ in self.groups), sum(n for _, n in self.groups))


class PoolState(BaseModel):
    config: CurriculumConfig
    step: int = 0
    stats: dict[str, ScenarioStats]


class ScenarioPool(Generic[S]):
    """Scenarios (any objects; ``key`` gives each a unique id, by default its ``id`` attribute)."""

    def __init__(
        self,
        scenarios: Iterable[S],
        config: CurriculumConfig | None = None,
        *,
        key: Callable[[S], str] = operator.attrgetter("id"),
    ) -> None:
        self.config = config or CurriculumConfig()
        self.key = key
        self.scenarios: dict[str, S] = {}
        for scenario in scenarios:
            k = key(scenario)
            if k in self.scenarios:
                raise ValueError(f"two scenarios share the id {k!r}; the pool tracks scenarios by id")
            self.scenarios[k] = scenario
        if not self.scenarios:
            raise ValueError("a scenario pool needs at least one scenario")
        self.stats = {k: ScenarioStats() for k in self.scenarios}
        self.step = 0
        self._rng = np.random.default_rng(self.config.seed)

    def active(self) -> list[str]:
        return [k for k, s in self.stats.items() if s.retired is None]

    def sample(self, n: int) -> list[S]:
        """Up to ``n`` distinct active scenarios, favouring mixed outcomes (fewer when fewer are active)."""
        self._bring_back()
        ids = self.active()
        if not ids:
            return []
        weights = np.array([self.stats[k].weight for k in ids])
        chosen = self._rng.choice(len(ids), size=min(n, len(ids)), replace=False, p=weights / weights.sum())
        return [self.scenarios[ids[i]] for i in chosen]

    def record(self, scenario: S | str, rewards: Sequence[float], step: int | None = None) -> None:
        """Outcomes of one group of attempts at ``scenario`` (its object or id), at ``step`` (default: latest)."""
        k = scenario if isinstance(scenario, str) else self.key(scenario)
        if k not in self.stats:
            raise KeyError(f"scenario {k!r} is not in this pool")
        if not rewards:
            return
        self.step = max(self.step, step if step is not None else self.step)
        stats = self.stats[k]
        successes = sum(r >= self.config.success_threshold for r in rewards)
        stats.groups = [*stats.groups, (successes, len(rewards))][-self.config.window :]
        stats.last_step = self.step
        if stats.retired is None and len(stats.groups) == self.config.window:
            if all(s == n for s, n in stats.groups):
                stats.retired, stats.retired_at = "solved", self.step
            elif all(s == 0 for s, _ in stats.groups):
                stats.retired, stats.retired_at = "unsolved", self.step

    def record_groups(self, scenarios: Sequence[S | str], groups: Sequence[TrajectoryGroup], step: int) -> None:
        """``record`` for each (scenario, group) pair, e.g. the scenarios sampled and the groups they gave."""
        if len(scenarios) != len(groups):
            raise ValueError(f"{len(scenarios)} scenarios but {len(groups)} groups; they must pair up")
        for scenario, group in zip(scenarios, groups):
            self.record(scenario, [t.reward for t in group.trajectories], step)

    def _bring_back(self) -> None:
        if self.config.retry_after is None:
            return
        for stats in self.stats.values():
            if stats.retired is not None and self.step - (stats.retired_at or 0) >= self.config.retry_after:
                stats.retired, stats.retired_at, stats.groups = None, None, []

    def metrics(self) -> dict[str, float]:
        """The pool at a glance, ``pool/...``: sizes, and the mean success and mixed share of the tried ones."""
        active = [self.stats[k] for k in self.active()]
        tried = [s for s in active if s.groups]
        mixed = [s for s in tried if 0 < s.groups[-1][0] < s.groups[-1][1]]
        return {
            "pool/active": len(active),
            "pool/unseen": len(active) - len(tried),
            "pool/retired_solved": sum(s.retired == "solved" for s in self.stats.values()),
            "pool/retired_unsolved": sum(s.retired == "unsolved" for s in self.stats.values()),
            "pool/mixed_fraction": len(mixed) / len(tried) if tried else 0.0,
            "pool/success_mean": (
                sum(sum(a for a, _ in s.groups) / sum(n for _, n in s.groups) for s in tried) / len(tried)
                if tried
                else 0.0
            ),
        }

    def save(self, path: str | Path) -> None:
        """Write the tracking state (not the scenarios) as JSON, atomically, to resume a run with ``load``."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(PoolState(config=self.config, step=self.step, stats=self.stats).model_dump_json(indent=1))
        tmp.replace(path)

    def load(self, path: str | Path) -> None:
        """Restore state written by ``save``; scenarios it tracked that this pool lacks are an error."""
        state = PoolState.model_validate_json(Path(path).read_text())
        unknown = sorted(set(state.stats) - set(self.scenarios))
        if unknown:
            raise ValueError(f"{path}: tracks {len(unknown)} scenarios this pool does not have, e.g. {unknown[:3]}")
        self.config, self.step = state.config, state.step
        self.stats.update(state.stats)
        self._rng = np.random.default_rng([self.config.seed, self.step])
