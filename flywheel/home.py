"""Where Flywheel keeps a project's data on this machine (light: an agent or runner process imports it cheaply)."""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    """Project data (checkpoints, logs): ``$FLYWHEEL_HOME`` or ``./.flywheel``."""
    return Path(os.environ.get("FLYWHEEL_HOME") or ".flywheel")
