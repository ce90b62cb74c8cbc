"""The engine's status: what `status`, `kvpool status`, `kvpool top` and /metrics show."""

from __future__ import annotations

import os
import time
from collections import Counter

import msgspec
import psutil

from kvpool import protocol as p
from kvpool.daemon.config import Config
from kvpool.daemon.engine.scheduler import Scheduler
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.llama.model import Model
from kvpool.protocol.status import (
    Counters,
    DaemonStatus,
    KvStatus,
    MemoryStatus,
    RpcWorkerStatus,
    SchedulerStatus,
    SessionCounts,
    SlotStatus,
)


def status_of(
    *,
    daemon_version: str,
    started: float,
    heartbeat: float,
    config: Config,
    model: Model,
    kv: KvManager,
    scheduler: Scheduler,
    counters: Counters,
    frame_errors: Counter[str],
    rpc_workers: list[RpcWorkerStatus] | None = None,
) -> DaemonStatus:
    cap = scheduler.step_time_cap()
    return DaemonStatus(
        daemon_version=daemon_version,
        protocol_version=p.PROTOCOL_VERSION,
        pid=os.getpid(),
        uptime_s=round(time.monotonic() - started, 3),
        engine_idle_s=round(time.monotonic() - heartbeat, 3),
        memory=MemoryStatus(
            rss_bytes=psutil.Process().memory_info().rss,
            high_water_bytes=config.memory_high_water,
            over_high_water=scheduler.over_memory,
        ),
        model=model.info(),
        slots=SlotStatus(total=model.hot_slots, used=len(kv.resident)),
        kv=KvStatus(
            cells_total=model.context_size,
            cells_used=kv.cells_used(),  # shared prefix cells count once, however many sessions share them
        ),
        sessions=SessionCounts(
            open=len(kv.sessions.by_id),
            max=config.max_sessions,
            generating=len(scheduler.running),
            waiting=len(scheduler.waiting),
            evicted=len(kv.sessions.evicted),
        ),
        batch_size=model.batch.capacity,
        checkpoint=config.checkpoint,
        # copies: the engine thread goes on counting while the reply is encoded on the I/O thread
        counters=msgspec.structs.replace(
            counters,
            requests=dict(counters.requests),
            errors=dict(counters.errors),
            finished=dict(counters.finished),
            frame_errors=dict(frame_errors),
        ),
        scheduler=SchedulerStatus(
            policy=config.scheduling,
            step_cap_ms=round(cap * 1000.0, 2) if cap else None,
            cost_model=scheduler.cost.status(),
        ),
        tasks={
            task: scheduler.task_stats[task].status(
                scheduler.queue_depth(task),
                sum(g.late_tokens for g in scheduler.generations() if g.session.task == task),
            )
            for task in config.tasks
        },
        pool=kv.pool_status(),
        spill=kv.spill_status(),
        sessions_by_tier=kv.sessions_by_tier(),
        moves=kv.counts.status(),
        prefixes=kv.prefix_status(),
        rpc_workers=rpc_workers or [],
    )
