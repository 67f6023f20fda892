"""``from art.local.backend import LocalBackend``: the same class as ``flywheel.LocalBackend``."""

from flywheel.backend import LocalBackend

__all__ = ["LocalBackend"]
