"""The daemon's status as Prometheus text exposition: `kvpool_*` names, `_total` counters, base units (seconds,
bytes), per-task latency histograms. prometheus_client writes the format; this module only maps fields."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from kvpool.daemon.ops.latency_stats import BUCKETS_MS
from kvpool.protocol.status import DaemonStatus, Histogram, RemoteCounts


def _family(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    help_text: str,
    samples: Iterable[tuple[dict[str, str], float]],
) -> Metric:
    samples = list(samples)
    labels = sorted(samples[0][0]) if samples else []
    family = kind(name, help_text, labels=labels)
    for values, value in samples:
        family.add_metric([values[k] for k in labels], value)
    return family


def _histogram(name: str, help_text: str, by_task: dict[str, Histogram]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, help_text, labels=["task"])
    for task, hist in by_task.items():
        cumulative, buckets = 0, []
        for bound, count in zip((*BUCKETS_MS, None), hist.buckets, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound is None else repr(bound / 1000.0), cumulative))
        family.add_metric([task], buckets, hist.sum_ms / 1000.0)
    return family


def metrics(status: DaemonStatus, memory: dict[str, int]) -> Iterator[Metric]:
    counter, gauge = CounterMetricFamily, GaugeMetricFamily
    c, tasks, prefixes = status.counters, status.tasks, status.prefixes
    yield _family(gauge, "kvpool_up", "1 while the daemon answers.", [({}, 1)])
    yield _family(
        counter, "kvpool_generated_tokens", "Tokens generated and sent to clients.", [({}, c.generated_tokens)]
    )
    yield _family(
        counter,
        "kvpool_prompt_tokens",
        "Prompt tokens computed (tokens a shared prefix held are not).",
        [({}, c.prompt_tokens)],
    )
    yield _family(counter, "kvpool_decode_calls", "llama_decode calls (engine steps).", [({}, c.decode_calls)])
    yield _family(
        counter,
        "kvpool_draft_tokens",
        "Guessed tokens fed beside the decode tokens (drafted), those sampling took (accepted), and tokens a "
        "grammar forced that went in without a step of their own, guessed and taken or appended (jumped).",
        [
            ({"kind": "drafted"}, c.drafted_tokens),
            ({"kind": "accepted"}, c.accepted_tokens),
            ({"kind": "jumped"}, c.jumped_tokens),
        ],
    )
    yield _family(counter, "kvpool_engine_busy_seconds", "Wall time spent in engine steps.", [({}, c.busy_seconds)])
    yield _family(counter, "kvpool_requests", "Requests by operation.", [({"op": k}, n) for k, n in c.requests.items()])
    errors = dict(c.errors)
    for code, n in c.frame_errors.items():
        errors[code] = errors.get(code, 0) + n
    yield _family(counter, "kvpool_errors", "Error replies by code.", [({"code": k}, n) for k, n in errors.items()])
    yield _family(
        counter,
        "kvpool_generations_finished",
        "Generations by finish reason.",
        [({"reason": k}, n) for k, n in c.finished.items()],
    )
    yield _family(
        counter,
        "kvpool_client_events",
        "Generations paused for a client with unread replies, and stopped for one unresponsive or gone.",
        [
            ({"event": "paused"}, c.client_pauses),
            ({"event": "stopped_lost"}, c.clients_lost),
            ({"event": "stopped_not_reading"}, c.clients_not_reading),
        ],
    )
    yield _family(
        gauge,
        "kvpool_sessions",
        "Open sessions by tier.",
        [({"tier": k}, n) for k, n in status.sessions_by_tier.items()],
    )
    s, slots, kv, pool, spill = status.sessions, status.slots, status.kv, status.pool, status.spill
    yield _family(
        gauge,
        "kvpool_generations",
        "Generations running and waiting for a slot.",
        [({"state": "running"}, s.generating), ({"state": "waiting"}, s.waiting)],
    )
    yield _family(
        gauge,
        "kvpool_hot_slots",
        "Hot slots by state.",
        [({"state": "used"}, slots.used), ({"state": "free"}, slots.total - slots.used)],
    )
    yield _family(
        gauge,
        "kvpool_kv_cells",
        "Unified KV cells by state.",
        [({"state": "used"}, kv.cells_used), ({"state": "free"}, kv.cells_total - kv.cells_used)],
    )
    yield _family(
        gauge,
        "kvpool_pool_bytes",
        "Shared-memory pool bytes.",
        [
            ({"state": "used"}, pool.used_bytes),
            ({"state": "free"}, pool.free_bytes),
            ({"state": "largest_free_extent"}, pool.largest_free_extent_bytes),
        ],
    )
    yield _family(
        gauge,
        "kvpool_spill_bytes",
        "Spill directory bytes.",
        [({"state": "used"}, spill.used_bytes), ({"state": "max"}, spill.max_bytes)],
    )
    yield _family(
        gauge,
        "kvpool_tier_snapshot_bytes",
        "Session snapshot bytes per tier: as stored, and at the hot KV types (their ratio is the compression).",
        [
            ({"tier": name, "kind": kind}, value)
            for name, t in (("pool", pool), ("disk", spill))
            for kind, value in (("stored", t.snapshot_bytes), ("hot_types", t.snapshot_raw_bytes))
        ],
    )
    yield _family(
        gauge,
        "kvpool_tier_compressed_snapshots",
        "Session snapshots per tier stored at a smaller KV type than the hot one.",
        [({"tier": "pool"}, pool.compressed_snapshots), ({"tier": "disk"}, spill.compressed_snapshots)],
    )
    yield _family(counter, "kvpool_prefix_hits", "Sessions that started from a shared prefix.", [({}, prefixes.hits)])
    yield _family(
        counter,
        "kvpool_prefix_tokens_saved",
        "Prompt tokens not computed because a shared prefix held them.",
        [({}, prefixes.tokens_saved)],
    )
    yield _family(gauge, "kvpool_prefixes", "Shared prefixes kept (hot or in the pool).", [({}, prefixes.count)])
    yield _family(
        gauge,
        "kvpool_prefix_bytes",
        "Pool bytes of prefix snapshots (stored once), and snapshot bytes sessions did not store again.",
        [({"kind": "stored"}, prefixes.pool_bytes), ({"kind": "saved"}, prefixes.pool_bytes_saved)],
    )
    moves = msgspec.structs.asdict(status.moves)
    yield _family(
        counter,
        "kvpool_tier_moves",
        "Session moves between tiers.",
        [({"kind": k}, v) for k, v in moves.items() if not k.endswith(("seconds", "bytes"))],
    )
    yield _family(
        gauge,
        "kvpool_process_memory_bytes",
        "The daemon's own memory (psutil).",
        [({"kind": k}, v) for k, v in memory.items()],
    )
    yield _histogram(
        "kvpool_ttft_seconds", "Time to first token by task.", {k: t.ttft_buckets for k, t in tasks.items()}
    )
    yield _histogram(
        "kvpool_tpot_seconds", "Mean time per output token by task.", {k: t.tpot_buckets for k, t in tasks.items()}
    )
    yield _family(
        counter,
        "kvpool_deadline_misses",
        "First tokens later than the task's budget.",
        [({"task": k}, t.deadline_misses) for k, t in tasks.items()],
    )
    yield _family(
        counter,
        "kvpool_late_tokens",
        "Tokens later than the task's per-token budget.",
        [({"task": k}, t.late_tokens) for k, t in tasks.items()],
    )
    yield _family(
        counter,
        "kvpool_refusals",
        "Budget and queue refusals by task and code.",
        [({"task": k, "code": code}, n) for k, t in tasks.items() for code, n in t.refusals.items()],
    )
    yield _family(
        gauge,
        "kvpool_queue_depth",
        "Generations waiting for their first token, by task.",
        [({"task": k}, t.queue_depth) for k, t in tasks.items()],
    )
    if status.rpc_workers:  # a daemon split across rpc workers (docs/rpc.md)
        workers = status.rpc_workers
        yield _family(
            gauge,
            "kvpool_rpc_worker_layers",
            "Repeating layers placed on each rpc worker.",
            [({"endpoint": w.endpoint}, w.layers) for w in workers],
        )
        yield _family(
            gauge,
            "kvpool_rpc_worker_memory_free_bytes",
            "Free memory each rpc worker reported at its last check.",
            [({"endpoint": w.endpoint}, w.memory_free_bytes) for w in workers],
        )
        yield _family(
            gauge,
            "kvpool_rpc_worker_checked_seconds_ago",
            "Seconds since each rpc worker last answered (a check, or a step that went through it).",
            [({"endpoint": w.endpoint}, w.checked_s_ago) for w in workers],
        )
    yield from _remote_and_preload(status)
    yield from _media(status)
    yield from _cpu(status)


def _cpu(status: DaemonStatus) -> Iterator[Metric]:
    cpu = status.cpu
    if cpu is None:
        return
    counter, gauge = CounterMetricFamily, GaugeMetricFamily
    yield _family(gauge, "kvpool_decode_threads", "CPU threads the steps decode with now.", [({}, cpu.threads)])
    yield _family(gauge, "kvpool_decode_threads_max", "The most threads the steps may take.", [({}, cpu.most_threads)])
    if cpu.slowdown is not None:
        yield _family(
            gauge,
            "kvpool_step_slowdown",
            "The recent steps' time over their time at start (above 1: other processes take the CPU).",
            [({}, cpu.slowdown)],
        )
    if cpu.cores is not None:
        yield _family(
            gauge,
            "kvpool_step_cores",
            "The CPU the recent steps' threads got, in cores (below the thread count: they waited for a core).",
            [({}, cpu.cores)],
        )
    yield _family(
        counter,
        "kvpool_thread_count",
        "The thread count's events: probes (steps run at another count to measure it) and switches.",
        [({"event": "probe"}, cpu.probes), ({"event": "switch"}, cpu.switches)],
    )


def _media(status: DaemonStatus) -> Iterator[Metric]:
    counter, gauge = CounterMetricFamily, GaugeMetricFamily
    yield _family(
        counter,
        "kvpool_received_bytes",
        "Request bytes that crossed the socket (a frame through a frame area does not).",
        [({}, status.counters.received_bytes)],
    )
    m = status.media
    if m is None:
        return
    yield _family(
        counter,
        "kvpool_media",
        "Media by event: prepared (read and tokenized), encoded (projector passes), cache hits (found by content).",
        [
            ({"event": "prepared"}, m.prepared),
            ({"event": "encoded"}, m.encodes),
            ({"event": "cache_hit"}, m.cache_hits),
        ],
    )
    yield _family(
        counter, "kvpool_media_encode_seconds", "Time in the projector's encodes.", [({}, m.encode_ms_total / 1000.0)]
    )
    yield _family(gauge, "kvpool_media_cached_bytes", "Media embeddings kept by content.", [({}, m.cached_bytes)])
    yield _family(gauge, "kvpool_frame_areas", "Shared-memory frame areas given to connections.", [({}, m.frame_areas)])


def _remote_and_preload(status: DaemonStatus) -> Iterator[Metric]:
    counter, gauge = CounterMetricFamily, GaugeMetricFamily
    if status.remote is not None:
        r = status.remote
        events = {k: getattr(r, k) for k in RemoteCounts.__struct_fields__ if not k.endswith(("bytes", "seconds"))}
        yield _family(
            counter,
            "kvpool_remote_events",
            "Remote tier events: writes, dropped and failed writes, fetches, conflicts, corrupt values...",
            [({"kind": k}, v) for k, v in events.items()],
        )
        yield _family(
            counter,
            "kvpool_remote_bytes",
            "Bytes written to and fetched from the remote tier.",
            [({"direction": "write"}, r.write_bytes), ({"direction": "fetch"}, r.fetch_bytes)],
        )
        yield _family(gauge, "kvpool_remote_connected", "1 while Redis answers.", [({}, int(r.connected))])
        yield _family(
            gauge, "kvpool_remote_pending_bytes", "Checkpoint bytes waiting for Redis.", [({}, r.pending_bytes)]
        )
        yield _family(gauge, "kvpool_remote_leases", "Session leases this node holds.", [({}, r.leases_held)])
    if status.preload is not None:
        p = status.preload
        yield _family(
            counter,
            "kvpool_preloads",
            "Preloads by outcome: done (hinted or predicted), hits, wasted.",
            [
                ({"kind": "hinted"}, p.hinted),
                ({"kind": "predicted"}, p.predicted),
                ({"kind": "hits"}, p.hits),
                ({"kind": "wasted"}, p.wasted),
            ],
        )


class _Snapshot(Collector):
    def __init__(self, status: DaemonStatus, memory: dict[str, int]):
        self.status, self.memory = status, memory

    def collect(self) -> Iterator[Metric]:
        return metrics(self.status, self.memory)


def render(status: DaemonStatus, memory: dict[str, int]) -> str:
    """One scrape: the status and the process's memory as exposition text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(status, memory))
    return generate_latest(registry).decode("utf-8")
