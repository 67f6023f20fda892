"""A checkpoint in memory: what ``Trainer.checkpoint`` snapshots and ``Trainer.load`` applies, and its state
(``trainer_state.json``). Writing it to a model's directory, and reading it back, is ``flywheel.checkpoints``'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, model_validator

from flywheel.train.config import TrainedWeights

if TYPE_CHECKING:
    import torch


class CheckpointState(BaseModel):
    """``trainer_state.json``: what the checkpoint is and what it commits."""

    step: int = Field(ge=0)
    rl_steps: int = Field(0, ge=0)  # of them, RL steps: the learning-rate schedule's clock
    trained_weights: TrainedWeights  # what the run trains: a LoRA adapter and its shape, or every weight
    last_split: str | None = None  # "train" or "sft": the phase that wrote it
    last_config: dict[str, Any] = {}  # that phase's TrainConfig / SFTConfig
    extra: dict[str, Any] = {}  # the caller's own state, e.g. its data position; back on resume
    rows: list[dict[str, Any]] = []  # the history rows this checkpoint commits (appended once it is durable)

    @model_validator(mode="before")
    @classmethod
    def _read_the_old_form(cls, data: Any) -> Any:
        # states written before TrainedWeights was named so hold it as "lora", with "full_finetune": bool for mode
        if isinstance(data, dict) and "lora" in data and "trained_weights" not in data:
            data = dict(data)
            weights = dict(data.pop("lora"))
            weights["mode"] = "full" if weights.pop("full_finetune", False) else "lora"
            data["trained_weights"] = weights
        return data


@dataclass
class Checkpoint:
    """A checkpoint in memory: what ``Trainer.checkpoint`` snapshots and ``Trainer.load`` applies."""

    state: CheckpointState
    weights: dict[str, torch.Tensor]  # fp32 masters: keyed as peft's adapter file, or as the model's parameters
    optimizer: dict[str, Any] | None = None  # the optimizer's state_dict
    rng: dict[str, Any] | None = None  # torch / python / numpy (/ CUDA) generator states
    adapter_config: dict[str, Any] | None = None  # peft's adapter_config.json (LoRA only)
