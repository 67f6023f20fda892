"""Repeated looks at one question, and the level each look decides at.

The loop asks the same question many times: is this candidate better than production on the held-out set (every
``candidate_every`` steps), is this canary (or shadow) no worse than production (every iteration, as episodes
arrive). A test at 2.5% repeated 25 times on independent evaluations promotes a candidate that is no better in
about half the loops (47%). Two rules keep the error over a loop's lifetime bounded, each valid whatever the looks'
correlation (a union bound):

- the gate spends ``lifetime_alpha`` over its looks since production last changed (``look_budget``): an even share
  over ``planned_looks``, and a reserve spread over any later looks so that the total never exceeds it;
- the canary and the shadow decide only at a few numbers of episodes (``schedule``: the minimum, doubling up to the
  maximum), each at an equal share of their ``alpha``, on the first that many episodes: looking again between two of
  those numbers looks at the same evidence.
"""

from __future__ import annotations

RESERVE = 0.2  # the share of the gate's lifetime error kept for looks past the planned ones


def look_budget(lifetime_alpha: float, planned_looks: int, look: int) -> float:
    """The error the gate's ``look``-th look (1 for the first since production changed) may spend: the looks' budgets
    sum to ``lifetime_alpha`` at most, however many there are."""
    if look < 1:
        raise ValueError(f"looks are counted from 1, got {look}")
    if look <= planned_looks:
        return (1 - RESERVE) * lifetime_alpha / planned_looks
    # planned / ((k - 1) k) sums to 1 over k > planned: later looks share the reserve, each less than the one before
    return RESERVE * lifetime_alpha * planned_looks / ((look - 1) * look)


def schedule(first: int, last: int) -> list[int]:
    """The numbers of episodes at which a verdict is decided: ``first``, doubling, and ``last``."""
    if not 1 <= first <= last:
        raise ValueError(f"need 1 <= first <= last, got first={first}, last={last}")
    points = [first]
    while points[-1] * 2 < last:
        points.append(points[-1] * 2)
    return points if points[-1] == last else [*points, last]


def non_inferior(points: list[int], n: int, low: float, high: float, max_drop: float) -> tuple[bool | None, str]:
    """A look's verdict at ``n`` (a point of ``points``) on the interval (``low``, ``high``) of new - production:
    True (not worse by ``max_drop``), False (clearly worse: ``high`` below 0, or undecided at the last look) or None
    (wait for the next point); and why."""
    if low > -max_drop:
        return True, f"not worse by {max_drop:g}"
    if high < 0:
        return False, "worse than production"
    if n == points[-1]:
        return False, f"not shown within {max_drop:g} of production by its last look"
    return None, f"undecided until {points[points.index(n) + 1]}"


def reached(points: list[int], count: int) -> int | None:
    """The last point of ``points`` that ``count`` episodes reach (None before the first)."""
    done = [n for n in points if n <= count]
    return done[-1] if done else None
