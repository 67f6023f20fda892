"""ART's ``art.dev`` settings, accepted as they are written for ART.

ART configures its engine (Unsloth, vLLM, a Hugging Face trainer) with typed dicts: ``InternalModelConfig``
(``TrainableModel(_internal_config=...)``), its ``init_args``, ``engine_args``, ``peft_args`` and ``trainer_args``,
and ``TrainConfig`` (``model.train(_config=...)``, or the same names as keyword arguments of ``backend.train``).
Here they are the same typed dicts. What has a meaning on Flywheel's engine is mapped onto its settings (the LoRA
adapter's shape, full fine-tuning, the clip range, the importance-sampling cap...); the rest has none (GPU memory,
vLLM's scheduler, 4-bit loading) and is ignored with a one-line warning naming it, once per name per process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, TypedDict

from flywheel.train.config import TrainConfig as RLConfig
from flywheel.train.config import TrainedWeights, warn_once


class InitArgs(TypedDict, total=False):
    """How ART loads its base model (Unsloth's ``FastLanguageModel``); ``full_finetuning`` is mapped."""

    model_name: str
    max_seq_length: int
    dtype: str | None
    load_in_4bit: bool
    load_in_8bit: bool
    full_finetuning: bool
    fast_inference: bool
    gpu_memory_utilization: float
    max_lora_rank: int
    enable_prefix_caching: bool
    use_gradient_checkpointing: str
    random_state: int


class EngineArgs(TypedDict, total=False):
    """ART's vLLM engine arguments (vLLM is not used here: none of them is mapped)."""

    model: str
    dtype: str
    seed: int
    max_model_len: int | None
    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_num_seqs: int | None
    enable_prefix_caching: bool | None
    enforce_eager: bool | None
    enable_sleep_mode: bool
    num_scheduler_steps: int
    max_lora_rank: int
    generation_config: str | None
    disable_log_requests: bool
    disable_log_stats: bool


class PeftArgs(TypedDict, total=False):
    """The LoRA adapter: ``r``, ``lora_alpha``, ``lora_dropout`` and ``target_modules`` are mapped."""

    r: int
    target_modules: list[str]
    lora_alpha: int
    lora_dropout: float
    bias: str
    use_rslora: bool
    use_gradient_checkpointing: bool | str
    random_state: int


class TrainerArgs(TypedDict, total=False):
    """ART's Hugging Face trainer arguments (this trainer takes its settings from ``TrainConfig``)."""

    learning_rate: float
    adam_beta1: float
    adam_beta2: float
    weight_decay: float
    max_grad_norm: float
    lr_scheduler_type: str
    optim: str
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_generations: int
    output_dir: str | None
    logging_steps: float
    save_strategy: str
    disable_tqdm: bool | None
    report_to: str | list[str] | None


class InternalModelConfig(TypedDict, total=False):
    """``TrainableModel(_internal_config=...)``: ART's unstable engine settings."""

    init_args: InitArgs
    engine_args: EngineArgs
    peft_args: PeftArgs
    trainer_args: TrainerArgs


class TrainConfig(TypedDict, total=False):
    """``model.train(_config=...)``; also the keyword arguments of ``backend.train`` (with ``TrainOptions``)."""

    advantage_balance: float
    allow_training_without_logprobs: bool
    epsilon: float
    epsilon_high: float | None
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"]
    kimi_k2_tau: float | None
    kl_penalty_coef: float
    logprob_calculation_chunk_size: int
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float
    num_trajectories_learning_rate_multiplier_power: float
    plot_tensors: bool
    ppo: bool
    precalculate_logprobs: bool
    scale_learning_rate_by_reward_std_dev: bool
    scale_rewards: bool
    truncated_importance_sampling: float | None


class TrainOptions(TrainConfig, total=False):
    """ART's ``backend.train(model, groups, **options)`` keyword arguments."""

    learning_rate: float
    beta: float
    kl_penalty_reference_step: int | None
    kl_ref_adapter_path: str | None


def _importance_sampling_level(level: str) -> dict[str, Any] | None:
    # ART's sequence-level importance ratios are GSPO's; its token-level ones are every other loss's here
    return {"loss": "gspo"} if level == "sequence" else {} if level == "token" else None


# ART option -> the Flywheel TrainConfig fields it sets, or None where that value has no effect here
_TRAIN_MAPPING: dict[str, Callable[[Any], dict[str, Any] | None]] = {
    "learning_rate": lambda v: {"learning_rate": v},
    "beta": lambda v: {"beta": v},
    "epsilon": lambda v: {"epsilon": v},
    "epsilon_high": lambda v: {"epsilon_high": v},
    "scale_rewards": lambda v: {"scale_rewards": v},
    "truncated_importance_sampling": lambda v: {"importance_sampling_cap": v},
    "importance_sampling_level": _importance_sampling_level,
    # a hand-built turn (no log-probs) always trains here, as ART does with this option on
    "allow_training_without_logprobs": lambda v: {} if v else None,
    # ART's defaults, which are what this trainer does
    "kl_penalty_coef": lambda v: {} if v == 0 else None,
    "advantage_balance": lambda v: {} if v == 0 else None,
}


def _ignored(where: str, key: str, value: Any) -> None:
    warn_once(f"{where}.{key}", f"{where}: {key}={value!r} has no effect on Flywheel's engine and is ignored.")


def train_config(config: RLConfig | None, options: Mapping[str, Any]) -> RLConfig:
    """Flywheel's ``TrainConfig``: ``config`` (ART's public one, which is ours; default: ART's defaults) with
    ART's ``_config`` / ``backend.train`` options mapped onto it; an option with no effect here is ignored, saying
    so."""
    config = config or RLConfig()
    updates: dict[str, Any] = {}
    for key, value in options.items():
        mapped = _TRAIN_MAPPING[key](value) if key in _TRAIN_MAPPING else None
        if mapped is None:
            _ignored("train", key, value)
        else:
            updates |= mapped
    if not updates:
        return config
    return RLConfig.model_validate(config.model_dump(exclude_unset=True) | updates)


def trained_weights(internal: InternalModelConfig, weights: TrainedWeights) -> TrainedWeights:
    """What trains, given ART's ``_internal_config``: its LoRA shape (``peft_args``) and ``full_finetuning``."""
    updates: dict[str, Any] = {}
    peft_names = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "targets"}
    for section, args in internal.items():
        for key, value in dict(args).items():  # type: ignore[call-overload]
            if section == "peft_args" and key in peft_names:
                updates[peft_names[key]] = value
            elif section == "init_args" and key == "full_finetuning":
                updates["mode"] = "full" if value else "lora"
            elif section == "init_args" and key == "model_name":
                continue  # ART's loader name for base_model, which the model already names
            else:
                _ignored(f"_internal_config.{section}", key, value)
    if not updates:
        return weights
    return TrainedWeights.model_validate(weights.model_dump(exclude_unset=True) | updates)


__all__ = [
    "EngineArgs",
    "InitArgs",
    "InternalModelConfig",
    "PeftArgs",
    "TrainConfig",
    "TrainOptions",
    "TrainerArgs",
    "train_config",
    "trained_weights",
]
