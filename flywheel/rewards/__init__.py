"""Rewards for tasks without a verifier: RULER, an LLM judge that scores a group of trajectories relative to each
other, with a disk cache of its answers and an offline calibration against human labels."""

from flywheel.rewards.cache import JudgeCache
from flywheel.rewards.ruler import (
    DEFAULT_RUBRIC,
    JudgeError,
    JudgeUsage,
    RetryPolicy,
    Score,
    ruler,
    ruler_score_group,
)

__all__ = [
    "DEFAULT_RUBRIC",
    "JudgeCache",
    "JudgeError",
    "JudgeUsage",
    "RetryPolicy",
    "Score",
    "ruler",
    "ruler_score_group",
]
