"""Credit assignment: the advantage each sampled turn of a trajectory trains with.

A turn's intermediate reward (automatic, from ``flywheel.agents.air``, or your own) is kept on its ``Choice`` as
the extra field ``intermediate_reward``, so it travels with the turn through JSON, exports and training.
Turns are the trajectory's ``Choice`` objects in the order the trainer reads them: main history, then
``additional_histories``. r_t is turn t's intermediate reward, plus the final reward at the last turn.

- ``uniform`` (LightningRL in practice, Agent Lightning issues #282/#390): every turn gets the trajectory's
  advantage, computed by the configured estimator on total rewards (final + intermediate). Without intermediate
  rewards the total is exactly ``reward``: today's GRPO.
- ``turn``: discounted returns G_t = sum_{k>=t} gamma^(k-t) r_k (REINFORCE's reward-to-go), minus a group
  baseline, as in turn-level GRPO variants (MT-GRPO, Zeng et al. 2025; GiGPO's step groups, Feng et al. 2025):
  ``turn_norm="index"`` subtracts the mean return of the group's trajectories at the same turn index (a per-step
  value estimate: a turn is credited for doing better than others did at that point), ``"all"`` the mean over every
  turn of the group (REINFORCE++-style whitening, Hu 2025, within the group). With ``scale_rewards`` the residuals
  are divided by their std over the whole group, never per index: a per-index std would blow a 0.05 AIR difference
  between two trajectories up to a full unit of advantage. With gamma=1, no intermediate rewards and equal
  lengths, both reduce to GRPO.
"""

from __future__ import annotations

import math

from openai.types.chat.chat_completion import Choice

from flywheel.train.config import TrainConfig
from flywheel.types import Trajectory, TrajectoryGroup, intermediate_reward, set_intermediate_reward


def sampled_turns(traj: Trajectory) -> list[Choice]:
    return [c for h in [traj, *traj.additional_histories] for c in h.messages_and_choices if isinstance(c, Choice)]


def turn_rewards(traj: Trajectory) -> list[float]:
    """Intermediate reward of each sampled turn (0.0 where none was set)."""
    return [intermediate_reward(c) or 0.0 for c in sampled_turns(traj)]


def set_turn_rewards(traj: Trajectory, rewards: list[float]) -> None:
    """Store one intermediate reward per sampled turn (replacing any set before)."""
    turns = sampled_turns(traj)
    if len(rewards) != len(turns):
        raise ValueError(
            f"trajectory {traj.id} has {len(turns)} sampled turns but {len(rewards)} turn rewards were given"
        )
    for t, (choice, r) in enumerate(zip(turns, rewards)):
        if not math.isfinite(r):
            raise ValueError(f"turn reward {t} of trajectory {traj.id} was {r}; rewards must be finite")
        set_intermediate_reward(choice, r)


def total_reward(traj: Trajectory) -> float:
    extra = sum(turn_rewards(traj))
    return traj.reward + extra if extra else traj.reward  # exactly ``reward`` when there is nothing to add


def has_reward_variance(group: TrajectoryGroup) -> bool:
    """At least two finished rollouts whose total rewards (final plus per-turn) differ: a group GRPO can learn
    from with uniform credit (and dynamic sampling's default keep rule)."""
    return len({total_reward(t) for t in group.trajectories}) > 1


def step_rewards(traj: Trajectory) -> list[float]:
    """r_t: each turn's intermediate reward, with the final reward added at the last turn."""
    rewards = turn_rewards(traj)
    if rewards:
        rewards[-1] += traj.reward
    return rewards


def turn_returns(traj: Trajectory, gamma: float = 1.0) -> list[float]:
    """G_t = r_t + gamma * G_{t+1}."""
    returns, g = [], 0.0
    for r in reversed(step_rewards(traj)):
        g = r + gamma * g
        returns.append(g)
    return returns[::-1]


def turn_advantages(trajectories: list[Trajectory], gamma: float, norm: str, scale: bool) -> list[list[float]]:
    """Per-turn advantages of one group's trajectories (``credit="turn"``)."""
    returns = [turn_returns(t, gamma) for t in trajectories]
    depth = max(map(len, returns), default=0)
    if norm == "index":
        at = [[g[i] for g in returns if len(g) > i] for i in range(depth)]
        baseline = [sum(values) / len(values) for values in at]
    else:
        flat = [x for g in returns for x in g]
        baseline = [sum(flat) / len(flat) if flat else 0.0] * depth
    residuals = [[x - baseline[i] for i, x in enumerate(g)] for g in returns]
    if scale:
        flat = [x for g in residuals for x in g]  # mean zero by construction
        std = math.sqrt(sum(x * x for x in flat) / len(flat)) if flat else 0.0
        residuals = [[x / (std + 1e-6) for x in g] for g in residuals]
    return residuals


def credit_advantages(groups: list[TrajectoryGroup], config: TrainConfig) -> list[list[float | list[float]]]:
    """For each group, each trajectory's advantage: one number (uniform) or one per sampled turn (turn)."""
    from flywheel.train.loss import advantages  # torch: not for the agents and exports that use the rest of this module

    if config.credit == "uniform":
        return advantages(
            [[total_reward(t) for t in g.trajectories] for g in groups], config.advantage, config.scale_rewards
        )
    return [turn_advantages(g.trajectories, config.gamma, config.turn_norm, config.scale_rewards) for g in groups]


def has_signal(advantage: float | list[float]) -> bool:
    return any(advantage) if isinstance(advantage, list) else advantage != 0.0
