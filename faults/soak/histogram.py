"""A latency histogram with bounded memory: logarithmic buckets, 1 % relative precision.

A soak run records hundreds of thousands of latencies per path; keeping them all would grow with
the run. Each value falls into the bucket ``floor(log(v / LOWEST) / log(1 + PRECISION))``, so a
percentile read back is within 1 % of the true one, and a histogram holds at most a few thousand
counters whatever the run's length (1 µs to one hour: 2,200 buckets). It is HdrHistogram's idea
in its smallest form, with no dependency.
"""

from __future__ import annotations

import math
from collections import Counter

#: The smallest latency told apart (seconds): anything below counts as this.
LOWEST = 1e-6
#: Relative width of a bucket: a percentile is read back within this fraction.
PRECISION = 0.01
_LOG_STEP = math.log1p(PRECISION)


class LogHistogram:
    """Counts of latencies (seconds) in logarithmic buckets; percentiles, merging."""

    def __init__(self) -> None:
        self.buckets: Counter[int] = Counter()
        self.count = 0
        self.max = 0.0

    def record(self, seconds: float) -> None:
        value = max(seconds, LOWEST)
        self.buckets[int(math.log(value / LOWEST) / _LOG_STEP)] += 1
        self.count += 1
        self.max = max(self.max, value)

    def merge(self, other: LogHistogram) -> None:
        self.buckets.update(other.buckets)
        self.count += other.count
        self.max = max(self.max, other.max)

    def percentile(self, p: float) -> float | None:
        """The ``p``-th percentile (0-100), the upper edge of its bucket; None when empty."""
        if not self.count:
            return None
        rank = math.ceil(self.count * p / 100)
        seen = 0
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if seen >= rank:
                return min(self.max, LOWEST * math.exp((index + 1) * _LOG_STEP))
        return self.max
