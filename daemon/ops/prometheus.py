"""Render the daemon's status as Prometheus text exposition (version 0.0.4): `kvpool_*` names, `_total`
counters, base units (seconds, bytes), per-task latency histograms."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvpool.daemon.ops.latency_stats import BUCKETS_MS


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, Any], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.sample(name, labels, value)

    def sample(self, name: str, labels: dict[str, Any], value: float) -> None:
        if labels:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{inner}}} {float(value)!r}")
        else:
            self.lines.append(f"{name} {float(value)!r}")


def render(status: dict[str, Any], memory: dict[str, int]) -> str:
    t = _Text()
    c = status["counters"]
    t.metric("kvpool_up", "gauge", "1 while the daemon answers.", [({}, 1)])
    t.metric(
        "kvpool_generated_tokens_total",
        "counter",
        "Tokens generated and sent to clients.",
        [({}, c["generated_tokens"])],
    )
    t.metric(
        "kvpool_prompt_tokens_total",
        "counter",
        "Prompt tokens computed (tokens a shared prefix held are not).",
        [({}, c["prompt_tokens"])],
    )
    t.metric("kvpool_decode_calls_total", "counter", "llama_decode calls (engine steps).", [({}, c["decode_calls"])])
    t.metric(
        "kvpool_engine_busy_seconds_total", "counter", "Wall time spent in engine steps.", [({}, c["busy_seconds"])]
    )
    t.metric(
        "kvpool_requests_total",
        "counter",
        "Requests by operation.",
        [({"op": op}, n) for op, n in sorted(c["requests"].items())],
    )
    errors: dict[str, int] = dict(c["errors"])
    for code, n in c["frame_errors"].items():
        errors[code] = errors.get(code, 0) + n
    t.metric(
        "kvpool_errors_total",
        "counter",
        "Error replies by code.",
        [({"code": code}, n) for code, n in sorted(errors.items())],
    )
    t.metric(
        "kvpool_generations_finished_total",
        "counter",
        "Generations by finish reason.",
        [({"reason": r}, n) for r, n in sorted(c["finished"].items())],
    )
    t.metric(
        "kvpool_sessions",
        "gauge",
        "Open sessions by tier.",
        [({"tier": tier}, n) for tier, n in sorted(status["sessions_by_tier"].items())],
    )
    t.metric(
        "kvpool_generations",
        "gauge",
        "Generations running and waiting for a slot.",
        [
            ({"state": "running"}, status["sessions"]["generating"]),
            ({"state": "waiting"}, status["sessions"]["waiting"]),
        ],
    )
    t.metric(
        "kvpool_hot_slots",
        "gauge",
        "Hot slots by state.",
        [
            ({"state": "used"}, status["slots"]["used"]),
            ({"state": "free"}, status["slots"]["total"] - status["slots"]["used"]),
        ],
    )
    t.metric(
        "kvpool_kv_cells",
        "gauge",
        "Unified KV cells by state.",
        [
            ({"state": "used"}, status["kv"]["cells_used"]),
            ({"state": "free"}, status["kv"]["cells_total"] - status["kv"]["cells_used"]),
        ],
    )
    pool = status["pool"]
    t.metric(
        "kvpool_pool_bytes",
        "gauge",
        "Shared-memory pool bytes.",
        [
            ({"state": "used"}, pool["used_bytes"]),
            ({"state": "free"}, pool["free_bytes"]),
            ({"state": "largest_free_extent"}, pool["largest_free_extent_bytes"]),
        ],
    )
    t.metric(
        "kvpool_spill_bytes",
        "gauge",
        "Spill directory bytes.",
        [({"state": "used"}, status["spill"]["used_bytes"]), ({"state": "max"}, status["spill"]["max_bytes"])],
    )
    prefixes = status["prefixes"]
    t.metric(
        "kvpool_prefix_hits_total", "counter", "Sessions that started from a shared prefix.", [({}, prefixes["hits"])]
    )
    t.metric(
        "kvpool_prefix_tokens_saved_total",
        "counter",
        "Prompt tokens not computed because a shared prefix held them.",
        [({}, prefixes["tokens_saved"])],
    )
    t.metric("kvpool_prefixes", "gauge", "Shared prefixes kept (hot or in the pool).", [({}, prefixes["count"])])
    t.metric(
        "kvpool_prefix_bytes",
        "gauge",
        "Pool bytes of prefix snapshots (stored once), and snapshot bytes sessions did not store again.",
        [({"kind": "stored"}, prefixes["pool_bytes"]), ({"kind": "saved"}, prefixes["pool_bytes_saved"])],
    )
    t.metric(
        "kvpool_tier_moves_total",
        "counter",
        "Session moves between tiers.",
        [({"kind": k}, v) for k, v in sorted(status["moves"].items()) if not k.endswith(("seconds", "bytes"))],
    )
    t.metric(
        "kvpool_process_memory_bytes",
        "gauge",
        "The daemon's own memory (psutil).",
        [({"kind": k}, v) for k, v in sorted(memory.items())],
    )
    tasks = status["tasks"]
    for name, key, help_text in (
        ("kvpool_ttft_seconds", "ttft_buckets", "Time to first token by task."),
        ("kvpool_tpot_seconds", "tpot_buckets", "Mean time per output token by task."),
    ):
        t.lines.append(f"# HELP {name} {help_text}")
        t.lines.append(f"# TYPE {name} histogram")
        for task, stats in tasks.items():
            hist = stats[key]
            running = 0
            for bound, count in zip((*BUCKETS_MS, None), hist["buckets"], strict=True):
                running += count
                le = "+Inf" if bound is None else repr(bound / 1000.0)
                t.sample(f"{name}_bucket", {"task": task, "le": le}, running)
            t.sample(f"{name}_sum", {"task": task}, hist["sum_ms"] / 1000.0)
            t.sample(f"{name}_count", {"task": task}, hist["count"])
    t.metric(
        "kvpool_deadline_misses_total",
        "counter",
        "First tokens later than the task's budget.",
        [({"task": task}, s["deadline_misses"]) for task, s in tasks.items()],
    )
    t.metric(
        "kvpool_late_tokens_total",
        "counter",
        "Tokens later than the task's per-token budget.",
        [({"task": task}, s["late_tokens"]) for task, s in tasks.items()],
    )
    t.metric(
        "kvpool_refusals_total",
        "counter",
        "Budget and queue refusals by task and code.",
        [({"task": task, "code": code}, n) for task, s in tasks.items() for code, n in s["refusals"].items()],
    )
    t.metric(
        "kvpool_queue_depth",
        "gauge",
        "Generations waiting for their first token, by task.",
        [({"task": task}, s["queue_depth"]) for task, s in tasks.items()],
    )
    return "\n".join(t.lines) + "\n"
