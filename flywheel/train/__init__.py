"""RL and SFT training of LoRA adapters (or full weights) on the model the engine samples from."""

from flywheel.train.config import LoraSettings, SFTConfig, TrainConfig

__all__ = ["LoraSettings", "SFTConfig", "TrainConfig"]
