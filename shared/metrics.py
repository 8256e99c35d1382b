"""Prometheus histogram buckets (SGLang's, so its dashboards read ours), and a small thread-safe
histogram for a process that ships its observations over the bus instead of serving them: the
scheduler puts `BucketCounts.snapshot()` on its heartbeat and the gateway renders it at `/metrics`."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

# SGLang's TokenizerMetricsCollector defaults (seconds)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
               1800, 2400)  # fmt: skip
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
               0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)  # fmt: skip
# SGLang's SchedulerMetricsCollector.grammar_compilation_time (seconds)
GRAMMAR_COMPILE_BUCKETS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 240)


class BucketCounts:
    """Observations counted into `bounds` (Prometheus `le` semantics: a value lands in the first
    bucket whose bound is >= it; past the last bound, only +Inf). Observed from any thread."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        assert list(self.bounds) == sorted(set(self.bounds)), "bounds must increase"
        self._counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready: the bounds, the cumulative count at each bound, the sum and the count."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, n = [], 0
        for c in counts[:-1]:
            n += c
            cumulative.append(n)
        return {"le": list(self.bounds), "cumulative": cumulative, "sum": total, "count": n + counts[-1]}
