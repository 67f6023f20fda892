"""The alarm on the served/trained log-prob gap: is the policy that sampled a step's tokens the one that trains?

Each RL step reports ``sampler_logprob_gap``, the mean absolute difference between the log-probs the sampler recorded
and the trainer's for the same tokens (of the rollouts the live weights answered only). It sits near zero when one
engine samples and trains in fp32, and at a steady small value under bf16 or another engine's kernels (vLLM). A jump
means the served policy is not the trained one: an adapter not synced (the peers' silent bug: rollouts from the
base model for months), a sampler of another base model or other settings. ``GapAlarm`` raises it per model: a gap
above ``FLOOR`` nats per token and ``FACTOR`` times the median of the last ``WINDOW`` steps (before enough steps:
above ``ABSOLUTE``)."""

from __future__ import annotations

import statistics
import warnings
from collections import deque

FLOOR = 0.05  # nats/token: below it, a gap is rounding (bf16 against fp32 sits near 0.01-0.03)
FACTOR = 4.0  # times the recent median: a jump
ABSOLUTE = 0.3  # nats/token: an alarm whatever came before (a stale adapter after an update sits near 1)
WINDOW = 8  # steps the median is taken over
SETTLED = 3  # steps seen before the median counts


class GapAlarm:
    """The recent gaps of each model; ``check`` says whether a step's gap is an alarm, and warns if so."""

    def __init__(self) -> None:
        self._recent: dict[tuple[str, str], deque[float]] = {}

    def check(self, key: tuple[str, str], step: int, gap: float) -> bool:
        recent = self._recent.setdefault(key, deque(maxlen=WINDOW))
        median = statistics.median(recent) if len(recent) >= SETTLED else None
        alarm = gap > ABSOLUTE or (median is not None and gap > max(FLOOR, FACTOR * median))
        if alarm:
            before = f"the median of the last {len(recent)} steps: {median:.3g}" if median is not None else "no history"
            warnings.warn(
                f"Model '{key[1]}' step {step}: the sampler's log-probs sit {gap:.3g} nats per token from the "
                f"trainer's ({before}): the policy that sampled this step may not be the one that trains (an adapter "
                "not loaded into the sampler, a sampler serving another base model, precision or settings that "
                "differ). The step trained anyway, its tokens reweighted by importance sampling; its history row has "
                "sampler_gap_alarm = 1.",
                stacklevel=3,
            )
        else:
            recent.append(gap)  # an alarm's gap does not become the norm
        return alarm

    def forget(self, key: tuple[str, str]) -> None:
        self._recent.pop(key, None)
