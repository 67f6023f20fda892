"""Automatic intermediate rewards (AIR): small per-turn rewards read off the run itself.

Agent Lightning's paper describes AIR (rewards from tool-call status) but its code has none. Here each sampled
turn that calls tools gets, averaged over its calls (so parallel calls in one turn earn no more than one):

- ``well_formed``: the call names a known tool and its arguments fit the schema;
- ``executed``: the tool ran without error or timeout;
- ``repeated`` (a penalty): the call is identical (tool + canonical arguments) to an earlier call of the episode.

A turn without tool calls (the final answer) gets 0. The running total over the episode is clipped to
[-cap, cap], so calling tools more often cannot earn more than ``cap``: with outcome rewards that differ by at least
``outcome_gap``, ``2 * cap < outcome_gap`` guarantees that the better outcome always has the higher total, the
guard the seeds ask for against degenerate tool-spam policies. The rewards are stored on the turns
(``flywheel.train.credit.set_turn_rewards``) where the trainer's credit assignment reads them.
"""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.agents.cache import tool_call_key
from flywheel.agents.tools import TOOL_STATUSES, ToolStatus
from flywheel.train.credit import set_turn_rewards
from flywheel.types import History, Trajectory


class AIRConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    well_formed: float = Field(0.05, ge=0.0)
    executed: float = Field(0.05, ge=0.0)
    repeated: float = Field(0.05, ge=0.0)  # subtracted
    cap: float = Field(0.2, ge=0.0)  # bound on |sum of a trajectory's intermediate rewards|
    outcome_gap: float = Field(1.0, gt=0.0)  # smallest difference between two final rewards that must not flip

    @model_validator(mode="after")
    def _outcome_dominates(self) -> AIRConfig:
        if 2 * self.cap >= self.outcome_gap:
            raise ValueError(
                f"AIR cap={self.cap} lets intermediate rewards outweigh the outcome: two trajectories whose final "
                f"rewards differ by outcome_gap={self.outcome_gap} could swap order; use cap < {self.outcome_gap / 2}"
            )
        return self


def _inferred_status(name: str, raw: str, known: set[str], reply: dict[str, Any] | None) -> ToolStatus:
    """For a trajectory made by some other loop: what its messages show (replies starting with "Error" failed)."""
    if name not in known:
        return "unknown_tool"
    try:
        if not isinstance(json.loads(raw or "{}"), dict):
            return "bad_arguments"
    except json.JSONDecodeError:
        return "bad_arguments"
    content = (reply or {}).get("content")
    return "error" if reply is None or (isinstance(content, str) and content.lstrip().startswith("Error")) else "ok"


def _statuses(choice: Choice, history: History) -> list[ToolStatus]:
    calls = choice.message.tool_calls or []
    recorded = getattr(choice, TOOL_STATUSES, None)
    if isinstance(recorded, list) and len(recorded) == len(calls):
        return recorded
    known = {t.get("function", {}).get("name") for t in history.tools or []}
    replies = {
        m.get("tool_call_id"): m
        for m in history.messages_and_choices
        if isinstance(m, dict) and m.get("role") == "tool"
    }
    return [
        _inferred_status(c.function.name, c.function.arguments, known, replies.get(c.id))
        if c.type == "function"
        else "unknown_tool"
        for c in calls
    ]


def air_rewards(traj: Trajectory, config: AIRConfig | None = None) -> list[float]:
    """One intermediate reward per sampled turn (main history, then additional histories)."""
    config = config or AIRConfig()
    seen: set[str] = set()
    rewards: list[float] = []
    total = 0.0
    for history in [traj, *traj.additional_histories]:
        for item in history.messages_and_choices:
            if not isinstance(item, Choice):
                continue
            calls = item.message.tool_calls or []
            reward = 0.0
            if calls:
                statuses = _statuses(item, history)
                well_formed = sum(s not in ("unknown_tool", "bad_arguments") for s in statuses)
                executed = sum(s == "ok" for s in statuses)
                repeated = 0
                for call in calls:
                    key = tool_call_key(call)
                    repeated += key in seen
                    seen.add(key)
                reward = (
                    config.well_formed * well_formed + config.executed * executed - config.repeated * repeated
                ) / len(calls)
            clipped = min(max(total + reward, -config.cap), config.cap)
            rewards.append(clipped - total)
            total = clipped
    return rewards


def apply_air(traj: Trajectory, config: AIRConfig | None = None) -> list[float]:
    """Compute AIR, store it as the turns' intermediate rewards (replacing earlier ones), and record its sum in
    ``metrics["air_reward"]``."""
    rewards = air_rewards(traj, config)
    set_turn_rewards(traj, rewards)
    traj.metrics["air_reward"] = sum(rewards)
    return rewards
