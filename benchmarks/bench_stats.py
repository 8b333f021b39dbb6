"""Statistics for benchmarks/bench.py: trial order, percentiles, medians and bootstrap intervals.

Pure functions, no I/O; tests/unit/test_bench_stats.py checks them on known data.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def trial_order(trials: int) -> list[str]:
    """The order of 2 x ``trials`` trials of servers "A" and "B": A B B A A B B A ...

    Every pair holds one trial of each server and the pairs alternate which goes first,
    so a slow drift in the machine's state hits both servers alike."""
    return [server for i in range(trials) for server in (("A", "B") if i % 2 == 0 else ("B", "A"))]


def rotation(servers: Sequence[str], rounds: int) -> list[str]:
    """The order of ``rounds`` rounds over any number of servers, each round running every
    server once: every other round runs them in reverse, and each round starts one place further
    on, so no server always runs first, or always right after the same one."""
    order: list[str] = []
    for r in range(rounds):
        base = list(servers) if r % 2 == 0 else list(servers)[::-1]
        shift = r % len(base)
        order += base[shift:] + base[:shift]
    return order


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated between the nearest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def bootstrap_ratio(a: Sequence[float], b: Sequence[float], resamples: int = 2000, confidence: float = 0.9,
                    seed: int = 0) -> tuple[float, float, float]:
    """median(a) / median(b) and its bootstrap ``confidence`` interval: (ratio, low, high).

    Each resample draws len(a) values of ``a`` and len(b) values of ``b`` with replacement
    (the two servers' trials independently) and takes the ratio of their medians; the interval
    is the percentile interval of those ratios. All values must be positive."""
    if not a or not b or min(a) <= 0 or min(b) <= 0:
        raise ValueError("bootstrap_ratio needs non-empty samples of positive values")
    rng = random.Random(seed)
    ratios = [statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
              for _ in range(resamples)]
    tail = (1 - confidence) / 2
    return statistics.median(a) / statistics.median(b), percentile(ratios, tail), percentile(ratios, 1 - tail)
