"""``from art.local import LocalBackend`` as ART scripts write it: Flywheel's ``LocalBackend`` (the engine, trainer
and HTTP server in this process; ``backend.py``, with its Weights & Biases logging in ``wandb_log.py``). Importing
this package loads the engine's modules (torch)."""

from flywheel.local.backend import LocalBackend

__all__ = ["LocalBackend"]
