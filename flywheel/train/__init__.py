"""RL and SFT training of LoRA adapters (or full weights) on the model the engine samples from."""

from flywheel.train.config import SFTConfig, TrainConfig, TrainedWeights

__all__ = ["SFTConfig", "TrainConfig", "TrainedWeights"]
