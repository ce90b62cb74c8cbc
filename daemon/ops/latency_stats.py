"""Per-task latency figures for `status`: time to first token and time per output token percentiles,
deadline misses, refusals and lateness. Plain numbers kept on the engine thread."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from kvpool.protocol.status import Histogram, LatencySummary, TaskStatus

WINDOW = 2048  # percentiles are over the most recent generations of each task
BUCKETS_MS = (10, 25, 50, 100, 200, 300, 500, 1000, 2000, 5000, 10000, 30000)  # histogram bounds (for metrics)


@dataclass
class Series:
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_MS) + 1))
    count: int = 0
    total: float = 0.0

    def add(self, ms: float) -> None:
        self.recent.append(ms)
        self.count += 1
        self.total += ms
        self.buckets[int(np.searchsorted(BUCKETS_MS, ms))] += 1

    def histogram(self) -> Histogram:
        """Counts per bucket of BUCKETS_MS (the last is beyond the largest bound), for Prometheus."""
        return Histogram(buckets=list(self.buckets), sum_ms=round(self.total, 3), count=self.count)

    def summary(self) -> LatencySummary:
        if not self.recent:
            return LatencySummary(count=0)
        p50, p95, p99 = np.percentile(np.fromiter(self.recent, float), [50, 95, 99])
        return LatencySummary(
            count=self.count,
            p50=round(float(p50), 2),
            p95=round(float(p95), 2),
            p99=round(float(p99), 2),
            mean=round(self.total / self.count, 2),
        )


@dataclass
class TaskStats:
    ttft_ms: Series = field(default_factory=Series)
    tpot_ms: Series = field(default_factory=Series)
    deadline_misses: int = 0  # first tokens later than the time-to-first-token budget
    late_tokens: int = 0  # later tokens that came later than the per-token budget
    lateness_ms: float = 0.0  # total time first tokens were late (best-effort work is counted, not refused)
    refusals: Counter[str] = field(default_factory=Counter)
    preemptions: int = 0

    def status(self, queue_depth: int, late_in_flight: int = 0) -> TaskStatus:
        """``late_in_flight``: late tokens of the task's answers still running (added to the count as they end)."""
        return TaskStatus(
            ttft_ms=self.ttft_ms.summary(),
            tpot_ms=self.tpot_ms.summary(),
            ttft_buckets=self.ttft_ms.histogram(),
            tpot_buckets=self.tpot_ms.histogram(),
            deadline_misses=self.deadline_misses,
            late_tokens=self.late_tokens + late_in_flight,
            lateness_ms=round(self.lateness_ms, 1),
            refusals=dict(self.refusals),
            preemptions=self.preemptions,
            queue_depth=queue_depth,
        )
