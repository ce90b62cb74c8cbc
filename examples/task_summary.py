"""A small latency summary the example tasks print when they finish."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(task: str, ttft_ms: list[float], tokens: int, seconds: float) -> str:
    if not ttft_ms:
        return f"[{task}] no requests"
    return (
        f"[{task}] {len(ttft_ms)} requests, {tokens} tokens in {seconds:.1f} s; "
        f"time to first token p50 {statistics.median(ttft_ms):.0f} ms, p95 {percentile(ttft_ms, 95):.0f} ms, "
        f"max {max(ttft_ms):.0f} ms"
    )
