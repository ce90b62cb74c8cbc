"""The daemon's status, as it travels in a `status` reply: typed, so the CLI, the HTTP listener, the Prometheus
renderer and the tests read fields, not string keys. Encoded as msgpack maps with these field names."""

from __future__ import annotations

from collections import Counter

from msgspec import Struct, field

# A daemon whose engine loop has not passed for this long is unhealthy (kvpool health, /health of the daemon's
# HTTP listener and of the gateway).
MAX_ENGINE_SILENCE_S = 10.0


class MemoryStatus(Struct, kw_only=True):
    rss_bytes: int
    high_water_bytes: int  # memory_high_water (0: none)
    over_high_water: bool  # new sessions are refused while true


class ModelStatus(Struct, kw_only=True):
    path: str
    description: str
    fingerprint: str  # identifies the weights; pools written with another are refused
    n_vocab: int
    n_params: int
    size_bytes: int
    context_size: int
    context_size_train: int
    sliding_window: int  # 0: every layer attends to the whole context
    cpu_repack: bool = True  # llama.cpp's weight repacking (docs/build.md)
    deterministic: bool = False  # a session's logits depend on its tokens alone (docs/determinism.md)
    # The hot KV's types and flash attention (docs/kv-compression.md).
    kv_type_k: str = "f16"
    kv_type_v: str = "f16"
    flash_attn: bool = True
    # The GGUF's chat template (tokenizer.chat_template; "" when it has none) and the texts of its BOS and EOS
    # tokens, which templates write as bos_token / eos_token.
    chat_template: str = ""
    architecture: str = ""  # general.architecture, e.g. gemma3: picks a chat template when the GGUF has none
    bos_token: str = ""
    eos_token: str = ""


class SlotStatus(Struct, kw_only=True):
    total: int
    used: int


class KvStatus(Struct, kw_only=True):
    cells_total: int
    cells_used: int  # shared prefix cells count once, however many sessions share them


class SessionCounts(Struct, kw_only=True):
    open: int
    max: int
    generating: int
    waiting: int
    evicted: int  # remembered so their owners get SESSION_EVICTED


class Counters(Struct, kw_only=True):
    """What the engine counts (it keeps one of these and updates it in place)."""

    decode_calls: int = 0  # engine steps whose decode succeeded (a step may run as several llama_decode calls)
    batch_tokens: int = 0  # tokens fed through those calls (prompt chunks + decode tokens)
    prompt_tokens: int = 0  # prompt tokens computed (system prompts included; tokens a shared prefix held are not)
    generated_tokens: int = 0  # tokens sampled and sent to clients
    drafted_tokens: int = 0  # guessed tokens fed beside the decode tokens (engine/drafts.py)
    accepted_tokens: int = 0  # of those, the ones sampling took (each saved a step)
    # Tokens a grammar forced that went in without a step of their own (engine/jumps.py): guessed and taken (also
    # counted in accepted_tokens), or appended without sampling.
    jumped_tokens: int = 0
    busy_seconds: float = 0.0  # wall time spent inside engine steps that decoded something
    kv_full_events: int = 0  # llama_decode found no room in the unified KV
    # Generations stopped (CLIENT_UNRESPONSIVE) because their client's connection closed or it sent nothing for
    # client_patience; because it read nothing for client_patience.
    clients_lost: int = 0
    clients_not_reading: int = 0
    client_pauses: int = 0  # times a generation paused because its client had replies it had not read yet
    requests: dict[str, int] = field(default_factory=Counter)  # by op
    errors: dict[str, int] = field(default_factory=Counter)  # error replies by code
    finished: dict[str, int] = field(default_factory=Counter)  # generations by finish reason
    frame_errors: dict[str, int] = field(default_factory=Counter)  # frames the I/O thread refused, by code
    received_bytes: int = 0  # request frames' bytes that crossed the socket (a frame through a frame area does not)


class CostFit(Struct, kw_only=True):
    fixed_ms: float
    per_token_ms: float
    per_output_ms: float
    per_10k_attention_ms: float
    several_outputs_ms: float = 0.0  # a step with more than one logits row (a matrix kernel) costs this once more
    odd_outputs_ms: float = 0.0  # ... and this with an odd number of them (a tile of two's last row, a pass alone)
    outputs_past_fours_ms: float = 0.0  # ... and this with 1-3 past a multiple of four (a tile of four's, likewise)
    extra_decode_ms: float = 0.0  # each decode a step runs as past its first costs this (engine/cost_model.py)
    recent: float = 1.0  # the last few steps' time over the fit's: multiplies its predictions (a fast change)


class CalibrationPoint(Struct, kw_only=True):
    context: int
    tokens: int
    ms: float


class CostModelStatus(Struct, kw_only=True):
    small_steps: CostFit
    large_steps: CostFit
    small_step_tokens: int
    updates: int
    calibration: list[CalibrationPoint]


class SchedulerStatus(Struct, kw_only=True):
    policy: str  # budgets or fcfs
    step_cap_ms: float | None  # the longest a step may take now (None: no budget in force)
    cost_model: CostModelStatus


class LatencySummary(Struct, kw_only=True):
    """Over the task's most recent generations; the percentiles are None until there is one."""

    count: int = 0
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None


class Histogram(Struct, kw_only=True):
    buckets: list[int]  # counts per bucket of BUCKETS_MS; the last is beyond the largest bound
    sum_ms: float
    count: int


class TaskStatus(Struct, kw_only=True):
    ttft_ms: LatencySummary
    tpot_ms: LatencySummary
    ttft_buckets: Histogram
    tpot_buckets: Histogram
    deadline_misses: int
    late_tokens: int
    lateness_ms: float
    refusals: dict[str, int]
    preemptions: int
    queue_depth: int


class TierSnapshots(Struct, kw_only=True):
    """The session snapshots a tier holds, and KV compression there: the type it may store them at ("same": the
    hot types; "profile: q5_1/q4_0h by layer": the model's precision profile and what it stores), and their bytes
    as stored and at the hot types."""

    kv_type: str = "same"
    snapshots: int = 0
    compressed_snapshots: int = 0
    snapshot_bytes: int = 0
    snapshot_raw_bytes: int = 0

    @property
    def compression_ratio(self) -> float:
        """Hot-type bytes per stored byte of the session snapshots held (1.0 when none)."""
        return self.snapshot_raw_bytes / self.snapshot_bytes if self.snapshot_bytes else 1.0


class PoolStatus(TierSnapshots, kw_only=True):
    name: str
    size_bytes: int
    area_bytes: int
    used_bytes: int
    free_bytes: int
    largest_free_extent_bytes: int
    entries: int
    entries_used: int
    prefix_entries: int
    kv_policy: str = "when_full"  # when the pool compresses: "when_full" or "always"


class SpillStatus(TierSnapshots, kw_only=True):
    dir: str
    used_bytes: int
    max_bytes: int


class MoveCounts(Struct, kw_only=True):
    """Moves between the tiers (the KV tiers keep one of these, with their timings, and update it in place)."""

    hibernations: int = 0
    restores_pool: int = 0
    restores_disk: int = 0
    checkpoints: int = 0
    spills: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    spill_failures: int = 0  # spill-directory reads and writes that failed (not for lack of room)
    restores_without_room: int = 0  # llama.cpp had no cells for a restore: idle sessions made room
    compressions: int = 0  # snapshots written at a smaller KV type (pool or spill, docs/kv-compression.md)
    restores_decompressed: int = 0  # restores that wrote a compressed snapshot back at the hot types
    # Deterministic decoding: the KV laid out again (every hot sequence contiguous, the graveyard emptied).
    compactions: int = 0


class Moves(MoveCounts, kw_only=True):
    """The moves, and the time and bytes of pool checkpoints and restores (apart for snapshots of 1 MiB and
    more, whose time is the copy rather than fixed costs)."""

    checkpoint_seconds: float = 0.0
    checkpoint_bytes: int = 0
    restore_pool_seconds: float = 0.0
    restore_pool_bytes: int = 0
    checkpoint_large_seconds: float = 0.0
    checkpoint_large_bytes: int = 0
    checkpoint_large_count: int = 0
    restore_pool_large_seconds: float = 0.0
    restore_pool_large_bytes: int = 0
    restore_pool_large_count: int = 0


class PrefixInfo(Struct, kw_only=True):
    id: str
    task: str
    tokens: int
    hot: bool
    pool_bytes: int
    users: int
    hot_users: int
    hits: int


class PrefixCounts(Struct, kw_only=True):
    """What prefix sharing counts (the prefix cache keeps one of these and updates it in place)."""

    hits: int = 0  # sessions that started from a shared prefix
    tokens_saved: int = 0  # prompt tokens those sessions did not compute
    made: int = 0
    hot_evictions: int = 0
    dropped: int = 0
    restores: int = 0


class PrefixStatus(PrefixCounts, kw_only=True):
    enabled: bool
    count: int
    hot: int
    max: int
    block_tokens: int
    pool_bytes: int
    users: int
    hot_users: int
    shared_cells: int
    each: list[PrefixInfo] = field(name="list")  # one line per prefix, most recently used first
    pool_bytes_saved: int  # snapshot bytes sessions did not store again because they build on a prefix


class RpcWorkerStatus(Struct, kw_only=True):
    """One RPC worker the model is split across (docs/rpc.md)."""

    endpoint: str  # HOST:PORT
    device: str  # llama.cpp's name for it, e.g. RPC0
    layers: int  # repeating layers placed on it
    output: bool  # whether the output layer runs there
    state: str  # "connected": it answered its last check (a lost worker ends the daemon; it does not linger)
    memory_free_bytes: int  # as the worker reported at its last check
    memory_total_bytes: int
    checked_s_ago: float  # since that check (made every few seconds while the engine is idle)


class RemoteCounts(Struct, kw_only=True):
    """What the remote tier counts (docs/remote.md); its writer and fetchers update one in place."""

    writes: int = 0  # checkpoints written to Redis
    write_bytes: int = 0
    write_seconds: float = 0.0  # read + check + encode + the round trip, summed over writes
    write_failures: int = 0  # writes that failed because Redis was down or slow (retried)
    dropped: int = 0  # writes given up: more than remote_queue_bytes were pending
    stale: int = 0  # queued checkpoints whose bytes had changed before they were read (the newer one went)
    fenced: int = 0  # writes refused because another node owns the session's lease
    disconnects: int = 0  # times Redis became unreachable
    leases_lost: int = 0
    fetches: int = 0  # sessions taken from the remote tier (roaming resumes, prefetches)
    fetch_bytes: int = 0
    fetch_failures: int = 0  # fetches that failed because Redis was down or slow
    conflicts: int = 0  # resumes refused because another node owns the session
    corrupt: int = 0  # remote values that failed a check (SESSION_CORRUPT)
    migrations: int = 0  # sessions handed over by `migrate`


class RemoteStatus(RemoteCounts, kw_only=True):
    url: str  # without its password
    node: str  # this daemon's name in leases
    connected: bool
    pending: int  # queued writes
    pending_bytes: int
    leases_held: int


class PreloadStatus(Struct, kw_only=True):
    mode: str  # off, hints or predict
    preloads: int = 0  # sessions moved up a tier ahead of their turn (hints and predictions)
    hinted: int = 0  # of those, asked for by a client (prefetch)
    predicted: int = 0  # of those, chosen by the predictor
    hits: int = 0  # turns that found their session hot or warm because of a preload
    wasted: int = 0  # preloaded sessions that left again (or were closed) before their next turn


class MediaStatus(Struct, kw_only=True):
    """Images and audio (a daemon with a projector, mmproj)."""

    projector: str  # the projector's file name
    vision: bool
    audio: bool
    audio_sample_rate: int = 0  # what pcm_f32 audio must be sampled at
    encode: str = "inline"  # where the projector encodes: "beside" the decode steps, or "inline" (media_encode)
    prepared: int = 0  # media read and tokenized (each new content once while cached)
    encodes: int = 0  # projector passes
    cache_hits: int = 0  # media found by their content: no read, no encode if encoded
    encode_ms_total: float = 0.0
    expected_encode_ms: dict[str, float] = field(default_factory=dict)  # by kind, what scheduling expects
    cached: int = 0
    cached_bytes: int = 0
    cache_max_bytes: int = 0
    frame_areas: int = 0  # shared-memory areas given to connections


class CpuStatus(Struct, kw_only=True):
    """The decode's CPU threads: fewer while other processes take cores (adapt_threads; docs/operations.md)."""

    threads: int  # what the steps decode with now
    most_threads: int  # the ceiling: the threads setting, or the cores the daemon may use
    adaptive: bool
    fixed_because: str = ""  # why the count does not adapt, when it does not
    slowdown: float | None = None  # the recent steps' time over their time at start (None: no step yet)
    cores: float | None = None  # the CPU the recent steps' threads got, in cores (below threads: they waited)
    probes: int = 0  # steps run at another count to measure it
    switches: int = 0  # times the count changed


class DraftStatus(Struct, kw_only=True):
    """Draftless speculation (draft_tokens; docs/speculative.md): guesses from each session's own tokens."""

    most_tokens: int  # guessed tokens a session may feed a step (0: off)
    least_tokens: int = 0  # fed whenever a guess has them, paying or not (draft_min_tokens)
    ngram: int  # the longest n-gram a guess is matched by (what they gave: Counters.drafted/accepted_tokens)
    jump_forward: str = "off"  # what a grammar forces: "guess"ed, "append"ed unsampled, "off" (Counters.jumped_tokens)


class DaemonStatus(Struct, kw_only=True):
    daemon_version: str
    protocol_version: int
    pid: int
    uptime_s: float
    engine_idle_s: float  # since the engine loop last passed (a hung engine grows it)
    memory: MemoryStatus
    model: ModelStatus
    slots: SlotStatus
    kv: KvStatus
    sessions: SessionCounts
    batch_size: int
    checkpoint: str
    counters: Counters
    scheduler: SchedulerStatus
    tasks: dict[str, TaskStatus]
    pool: PoolStatus
    spill: SpillStatus
    sessions_by_tier: dict[str, int]
    moves: Moves
    prefixes: PrefixStatus
    rpc_workers: list[RpcWorkerStatus] = field(default_factory=list)

    remote: RemoteStatus | None = None  # None: no remote tier configured
    preload: PreloadStatus | None = None
    media: MediaStatus | None = None  # None: no projector, text only
    cpu: CpuStatus | None = None
    drafts: DraftStatus | None = None

    def stepping(self, max_silence: float = MAX_ENGINE_SILENCE_S) -> bool:
        """The engine loop passed within ``max_silence`` seconds: the daemon is healthy."""
        return self.engine_idle_s < max_silence
