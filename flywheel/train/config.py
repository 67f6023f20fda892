"""Training configuration (pydantic: validated at the boundary, saved with every checkpoint).

``TrainConfig`` is also ``art.TrainConfig``: it takes ART's fields with ART's defaults (``learning_rate`` 5e-6,
``beta`` 0). A field it does not use (one of ART's that has no meaning here, or a name it does not know) is
dropped with a warning naming it, once per field name per process: never silently, never an error.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

Loss = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
Estimator = Literal["grpo", "rloo", "reinforce_pp"]
Credit = Literal["uniform", "turn"]  # how a trajectory's rewards reach its turns: flywheel/train/credit.py
Attention = Literal["padded", "flex"]  # the trainer's packed attention: flywheel/inference/kv_attention.py

# (epsilon low, epsilon high) when not given: PPO's 0.2; DAPO's clip-higher; GSPO's sequence-level ratios sit
# much closer to 1 (paper: 3e-4 / 4e-4); CISPO only bounds the importance weight from above (1 + 4.0, as ART).
DEFAULT_CLIP: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "cispo": (1.0, 4.0),
}


class TrainedWeights(BaseModel):
    """What trains: ``mode="lora"`` (default) a LoRA adapter on ``targets``, ``mode="full"`` every weight of the
    model (optimizer state ~12 bytes per parameter). ``rank``, ``alpha``, ``dropout`` and ``targets`` shape the
    adapter: used in lora mode only."""

    mode: Literal["lora", "full"] = "lora"
    rank: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """A ``UserWarning`` the first time ``key`` is seen in this process (an accepted setting that does nothing
    here): said once, not at every step of a training loop."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=2)


# ART's TrainConfig fields with no counterpart here: (ART's default, which is what happens here; why another value
# is ignored). Our KL term is ``beta``, on the loss.
ART_ONLY_FIELDS: dict[str, tuple[Any, str]] = {
    "kl_penalty_coef": (0.0, "ART's KL-penalised advantages are not implemented; use beta (a KL term in the loss)"),
    "kl_penalty_source": ("current_learner", "ART's KL-penalised advantages are not implemented"),
}


class TrainConfig(BaseModel):
    learning_rate: float = Field(5e-6, gt=0)  # ART's default
    loss: Loss = "grpo"
    advantage: Estimator = "grpo"
    scale_rewards: bool = True  # divide group advantages by the group's std (GRPO); Dr. GRPO turns it off
    epsilon: float | None = None  # clip range below 1; None -> DEFAULT_CLIP[loss]
    epsilon_high: float | None = None  # clip range above 1
    beta: float = Field(0.0, ge=0.0)  # KL to the reference policy, k3 estimator
    # the KL reference: None, the base model (LoRA: the adapter switched off); or the weights of this model's
    # checkpoint at that step (e.g. the end of an SFT warm start)
    kl_reference_step: int | None = Field(None, ge=0)
    # truncated importance sampling (TIS): tokens whose sampler log-probs are known train with
    # min(pi_old / pi_sampler, cap), correcting for other weights (stale rollouts, name@k) and the sampler's own
    # numerics; None turns it off
    importance_sampling_cap: float | None = Field(2.0, gt=0)
    # bounded staleness (train/staleness.py): a group with a rollout answered by weights more than this many steps
    # before the ones being trained (or by a step a restore abandoned) is dropped whole, counted in stale_groups;
    # None: no bound (staleness_mean / staleness_max are reported either way)
    max_staleness_steps: int | None = Field(None, ge=0)
    # the learning rate's schedule over RL steps (transformers' / TRL's names): warm-up, then constant or decay
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    max_steps: int | None = Field(None, ge=1)  # where linear / cosine reach 0
    epochs: int = Field(1, ge=1)  # passes over the batch; >1 makes later passes off-policy (ratios matter)
    micro_batch_tokens: int = Field(2048, ge=64)  # packed tokens per forward/backward (bounds activation memory)
    # the packed rows' attention: a few padded SDPA calls, or one FlexAttention call with a block mask (a fused,
    # compiled kernel: GPUs only, it has no backward on CPU)
    attention: Attention = "padded"
    gradient_checkpointing: bool = False  # recompute each layer's activations in backward: less memory, more time
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    dr_grpo_max_tokens: int = Field(1024, ge=1)  # Dr. GRPO's constant normaliser: the generation budget
    credit: Credit = "uniform"  # uniform: one advantage per trajectory; turn: per-turn returns (see credit.py)
    gamma: float = Field(1.0, ge=0.0, le=1.0)  # discount of per-turn returns (credit="turn")
    turn_norm: Literal["index", "all"] = "index"  # turn baseline: same turn index, or all turns of the group

    @model_validator(mode="before")
    @classmethod
    def _drop_unused_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.keys() <= cls.model_fields.keys():
            return data
        for key in sorted(data.keys() - cls.model_fields.keys()):
            default, why = ART_ONLY_FIELDS.get(key, (None, "it is not a Flywheel training setting"))
            if key not in ART_ONLY_FIELDS or data[key] != default:
                warn_once(f"TrainConfig.{key}", f"TrainConfig({key}={data[key]!r}) is ignored: {why}.")
        return {k: v for k, v in data.items() if k in cls.model_fields}

    @property
    def clip(self) -> tuple[float, float]:
        low, high = DEFAULT_CLIP[self.loss]
        return (
            self.epsilon if self.epsilon is not None else low,
            self.epsilon_high if self.epsilon_high is not None else high,
        )

    @model_validator(mode="after")
    def _dr_grpo_has_no_std(self) -> TrainConfig:
        if self.loss == "dr_grpo" and "scale_rewards" not in self.model_fields_set:
            self.scale_rewards = False
        return self

    @model_validator(mode="after")
    def _decay_needs_an_end(self) -> TrainConfig:
        if self.lr_scheduler_type != "constant" and self.max_steps is None:
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r} decays to 0 at max_steps: set max_steps")
        if self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) is longer than max_steps ({self.max_steps})")
        return self

    @model_validator(mode="after")
    def _turn_credit_uses_group_baselines(self) -> TrainConfig:
        if self.credit == "turn" and self.advantage != "grpo":
            raise ValueError(
                f"credit='turn' computes its own per-turn group baselines; it cannot be combined with "
                f"advantage={self.advantage!r} (use advantage='grpo', with scale_rewards to choose std scaling)"
            )
        return self


class SFTConfig(BaseModel):
    learning_rate: float = Field(2e-4, gt=0)
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(8, ge=1)  # trajectories per optimizer step
    micro_batch_tokens: int = Field(2048, ge=64)
    attention: Attention = "padded"  # as TrainConfig's
    gradient_checkpointing: bool = False
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
