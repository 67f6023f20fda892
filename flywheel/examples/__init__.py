"""Runnable examples shipped with the package; the CLI runs them (``flywheel train``, ``flywheel demo``)."""
