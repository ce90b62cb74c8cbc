"""The engine's status: what `status`, `kvpool status`, `kvpool top` and /metrics show."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import psutil

from kvpool import protocol as p

if TYPE_CHECKING:
    from kvpool.daemon.engine.loop import Engine


def status_of(engine: Engine) -> dict[str, Any]:
    return {
        "daemon_version": engine.daemon_version,
        "protocol_version": p.PROTOCOL_VERSION,
        "pid": os.getpid(),
        "uptime_s": round(time.monotonic() - engine.started, 3),
        "engine_idle_s": round(time.monotonic() - engine.heartbeat, 3),
        "memory": {
            "rss_bytes": psutil.Process().memory_info().rss,
            "high_water_bytes": engine.config.memory_high_water,
            "over_high_water": engine.over_memory,
        },
        "model": engine.model.info(),
        "slots": {"total": engine.model.hot_slots, "used": len(engine.tiers.resident)},
        "kv": {
            "cells_total": engine.model.context_size,
            # shared prefix cells count once, however many sessions share them
            "cells_used": sum(s.n_kv - s.prefix_len * s.shares_hot for s in engine.tiers.resident.values())
            + engine.tiers.prefixes.hot_cells(),
        },
        "sessions": {
            "open": len(engine.sessions.by_id),
            "max": engine.config.max_sessions,
            "generating": len(engine.running),
            "waiting": len(engine.waiting),
            "evicted": len(engine.sessions.evicted),
        },
        "batch_size": engine.model.batch.capacity,
        "checkpoint": engine.config.checkpoint,
        "counters": engine.counters.as_dict() | {"frame_errors": dict(engine.frame_errors)},
        "scheduler": {
            "policy": engine.config.scheduling,
            "step_cap_ms": round(cap * 1000.0, 2) if (cap := engine.step_time_cap()) else None,
            "cost_model": engine.cost.as_dict(),
        },
        "tasks": {task: engine.task_stats[task].as_dict(engine.queue_depth(task)) for task in engine.config.tasks},
    } | engine.tiers.usage()
