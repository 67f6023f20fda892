"""``from art.local import LocalBackend`` as ART scripts write it: Flywheel's ``LocalBackend`` (the engine, trainer
and HTTP server in this process). Importing this package loads the engine's modules (torch)."""

from flywheel.local.backend import LocalBackend

__all__ = ["LocalBackend"]
