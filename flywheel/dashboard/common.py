"""What the dashboard's two APIs share (``api.py``: runs; ``loop_api.py``: the loop): their prefix, their page sizes
and how a number is sent (JSON has no NaN: a NaN or an infinity is null)."""

from __future__ import annotations

import math
from typing import Any

PREFIX = "/ui/api"
PAGE = 50  # items per page by default
MAX_PAGE = 500
Number = float | None
MAX_INT = 2**62  # the most an id, a step or an offset may be: within a database integer (a larger one: 422, not 500)


def finite(value: Any) -> float | None:
    """A finite number as a float; NaN, an infinity or anything else as None (JSON has no NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
