"""The daemon's configuration: a schema (msgspec Structs), a TOML loader and CLI overrides.

Precedence: built-in defaults < TOML file < command-line flags. A field with a ``Flag`` has a command-line flag
of its name (kvpool.client.flags derives it). Unknown keys and bad values are refused
at start with the key, the value and why, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from kvpool.client.flags import Choices, Flag
from kvpool.daemon.kv.codec.kv_types import KV_TYPES, PROFILE, STORE_TYPES
from kvpool.daemon.llama.deterministic_mode import Determinism
from kvpool.daemon.rpc.endpoints import ENDPOINT_PATTERN

TASK_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
Positive = Annotated[int, Meta(ge=1)]
NonNegative = Annotated[int, Meta(ge=0)]


Millis = Annotated[float, Meta(ge=0, le=3_600_000)]
ENDPOINT_WORDS = "must be HOST:PORT, e.g. 127.0.0.1:50052"


DRAFT_TOKENS_MAX = 64  # guessed tokens per session and step
REMOTE_URL = 'must be a redis:// or rediss:// URL, e.g. "redis://:password@10.0.0.2:6379/0" (or be empty)'


def one_of(*values: str) -> Any:
    """A string key that takes one of ``values``; its error names them."""
    words = ", ".join(f'"{v}"' for v in values)
    return Annotated[
        str,
        Meta(pattern=f"^({'|'.join(map(re.escape, values))})$", description=f"must be one of {words}"),
        Choices(values),
    ]


MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ


def sequence_count(hot_slots: int, prefix_slots: int, extra: int = 0) -> int:
    """llama.cpp sequence ids the daemon uses: the hot slots, one per shared prefix, one scratch sequence when
    sharing is on, and the pad row's and the graveyard's of deterministic decoding (docs/determinism.md). The model
    sizes its context with it, and the memory plan too (every sequence id widens the sliding-window cache)."""
    return hot_slots + prefix_slots + (1 if prefix_slots else 0) + extra


class TaskProfile(Struct, forbid_unknown_fields=True, kw_only=True):
    """Budgets and limits for the sessions of one task (``[tasks.NAME]``); 0 means none."""

    # Higher runs first when deadlines tie.
    priority: Annotated[int, Meta(ge=-100, le=100)] = 0
    # Time-to-first-token and time-per-output-token budgets in milliseconds (0 = none).
    ttft_ms: Millis = 0.0
    tpot_ms: Millis = 0.0
    # Best-effort work is never refused for its budget (it is queued and its lateness counted), yields to
    # deadline-bound work first, and may be preempted (hibernated, then resumed exactly).
    best_effort: bool = False
    # Most generations of this task queued or running at once (OVERLOADED beyond); 0 = no limit.
    max_queue: NonNegative = 0
    max_sessions: NonNegative = 0
    max_context_tokens: NonNegative = 0
    # Most bytes of snapshots (pool and spill) the task's sessions may hold; sizes accept "64MiB" etc.
    pool_quota: NonNegative = 0
    # Text every session of this task starts with unless it is opened with its own: computed once and shared
    # by all of them (prefix sharing). Empty: none.
    system_prompt: Annotated[str, Meta(max_length=1 << 20)] = ""


def _default_tasks() -> dict[str, TaskProfile]:
    return {"default": TaskProfile()}


class Config(Struct, forbid_unknown_fields=True, kw_only=True):
    # The GGUF to serve; empty means the embedded default (Gemma 3 270M Q4_K_M from the `model` extra).
    model: Annotated[str, Flag("GGUF file to serve (default: the embedded Gemma 3 270M Q4_K_M)")] = ""
    # A projector GGUF (mmproj) for the model: sessions take images and audio (docs/multimodal.md). Empty: text only.
    mmproj: Annotated[str, Flag("projector GGUF (mmproj) for images and audio in sessions (docs/multimodal.md)")] = ""
    # Encoded media kept by content, so that the same image is encoded once (bytes of embeddings; LRU).
    media_cache_size: Annotated[
        int, Meta(ge=0), Flag("bytes of media embeddings kept by content, e.g. 64MiB (0: none kept)", parse=str)
    ] = 64 << 20
    # Where the projector encodes: "beside" the decode steps, on a thread of its own with one CPU thread while the
    # steps take the others (a voice turn is not held behind a vision encode); "inline": on the engine thread, as a
    # step of its own with every thread (deterministic decoding, and a daemon with one thread, encode inline).
    media_encode: Annotated[
        one_of("beside", "inline"), Flag("encode media beside the decode steps, or inline as steps of their own")
    ] = "beside"
    # The most bytes one medium may have (a frame, a file, PCM), and the frame area one connection may ask for.
    max_media_bytes: Annotated[int, Meta(ge=1 << 10, le=1 << 28)] = 32 << 20
    # ZeroMQ address; empty means ipc://<runtime dir>/kvpoold.sock (see kvpool.client.address).
    address: Annotated[
        str,
        Flag(
            "ipc:// address to serve (default: $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/kvpool or /tmp/kvpool-$UID, "
            "socket kvpoold.sock)"
        ),
    ] = ""
    # Mode of the socket's directory when the daemon creates it.
    socket_dir_mode: Annotated[int, Meta(ge=0, le=0o777)] = 0o700
    # A group whose members may connect: the socket directory becomes 0750 and the socket 0660 in that group
    # (and the pool segment 0640). Empty: only the daemon's own user.
    client_group: Annotated[str, Meta(max_length=64)] = ""
    # tcp:// is served only with CURVE: the daemon's key file (from zmq.auth.create_certificates) and a
    # directory holding the public key files of the clients allowed in.
    curve_secret_file: str = ""
    curve_clients_dir: str = ""
    # Limits: the largest frame a client may send, the longest prompt, generations in flight per connection.
    max_message_bytes: Annotated[int, Meta(ge=1 << 12, le=1 << 30)] = 4 << 20
    max_prompt_tokens: NonNegative = 0  # 0 = the session's context limit
    max_inflight_per_client: Annotated[int, Meta(ge=1, le=1 << 16)] = 16
    # A connection that multiplexes many users (the HTTP gateway says so in its hello) may have this many.
    max_inflight_per_multiplexer: Annotated[int, Meta(ge=1, le=1 << 16)] = 256
    # Hot slots: llama.cpp sequences decoded together (n_seq_max); each open session holds one.
    hot_slots: Annotated[int, Meta(ge=1, le=256), Flag("sequences decoded together (each open session holds one)")] = 4
    # KV cells shared by all hot slots (unified KV); also the most context one session can hold.
    context_size: Annotated[int, Meta(ge=64, le=1 << 20), Flag("KV cells shared by all hot slots")] = 4096
    # Most tokens one engine step decodes (prefill chunks + one token per generating session).
    batch_size: Annotated[int, Meta(ge=8, le=1 << 16), Flag("most tokens one engine step decodes")] = 512
    max_sessions: Annotated[int, Meta(ge=1, le=1 << 16), Flag("most sessions open at once")] = 64
    # Prefix sharing: llama.cpp sequences kept for shared prefixes (system prompts) in the unified KV, whose
    # cells sessions share through llama_memory_seq_cp; 0 turns sharing off. Prefix snapshots in the pool (so
    # sharing survives restarts) are capped at max_prefixes; the prefix index hashes blocks of this many tokens.
    prefix_slots: Annotated[int, Meta(ge=0, le=64)] = 2
    max_prefixes: Annotated[int, Meta(ge=0, le=1024)] = 8
    prefix_block_tokens: Annotated[int, Meta(ge=1, le=4096)] = 16
    # The warm tier: a POSIX shared-memory segment of this many bytes ("512MiB", "2GiB" or a number).
    cache_pool_size: Annotated[
        int, Meta(ge=1 << 20), Flag("bytes of the shared-memory pool, e.g. 512MiB or 2GiB", parse=str)
    ] = 256 << 20
    # Its name in /dev/shm; empty means one derived from the address, so daemons never share by accident.
    pool_name: Annotated[
        str,
        Meta(
            pattern=r"^(/[A-Za-z0-9_.-]{1,200})?$",
            description="must start with '/' followed by up to 200 letters, digits, '_', '.' or '-', "
            "e.g. /kvpool-main (or be empty)",
        ),
        Flag("name of the pool in /dev/shm (default: derived from the address)"),
    ] = ""
    pool_mode: Annotated[int, Meta(ge=0, le=0o777)] = 0o600
    # When sessions are snapshotted: after every completed generation (a crash loses no completed turn), or
    # only when they leave their hot slot (cheaper; a crash loses what was never hibernated).
    checkpoint: Annotated[one_of("after_generate", "on_evict"), Flag("when sessions are snapshotted")] = (
        "after_generate"
    )
    # "budgets": earliest deadline first, chunked prefill, admission control, preemption of best-effort work.
    # "fcfs": first come first served with whole-batch prefill chunks and no admission control (to compare).
    scheduling: Annotated[one_of("budgets", "fcfs"), Flag("latency budgets, or first come first served")] = "budgets"
    # A step of several sessions whose rows llama.cpp's flash attention would tile across them (a prompt chunk beside
    # decoding sessions, or 64 and more decode and guessed rows, llama/decode_groups.py) runs in parts, one decode
    # each: "auto" where the cost model predicts that faster, "always" wherever the step has such parts (to
    # measure), "off" never.
    step_parts: Annotated[
        one_of("auto", "always", "off"),
        Flag("decode a prompt chunk apart from other sessions' rows: where predicted faster, always, or never"),
    ] = "auto"
    # Time a few synthetic steps at start to fit the cost model that budgets and admission use (about 3 s with
    # Gemma 3 270M on 2 cores). false starts from a cautious prior that every step then refines: for tests and
    # for daemons whose tasks have no latency budgets.
    calibrate: bool = True
    # The memory plan (weights + hot KV + compute + pool + runtime) may not exceed this; 0 = no limit.
    memory_limit: Annotated[
        NonNegative, Flag("refuse to start when the memory plan exceeds this, e.g. 1.5GiB", parse=str)
    ] = 0
    # Above this resident memory (psutil), new sessions are refused with OVERLOADED; 0 = never.
    memory_high_water: NonNegative = 0
    # "127.0.0.1:PORT" serves /health and /metrics on the loopback; empty = no HTTP listener.
    http: Annotated[
        str,
        Meta(
            pattern=r"^((127\.0\.0\.1|localhost|\[::1\]):"
            r"(6553[0-5]|655[0-2]\d|65[0-4]\d{2}|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3}))?$",
            description="must be a loopback address and a port from 1 to 65535, e.g. 127.0.0.1:9101 (or be empty)",
        ),
        Flag("serve /health and /metrics on 127.0.0.1:PORT"),
    ] = ""
    log_format: Annotated[one_of("text", "json"), Flag("")] = "text"
    # Also log to this file, rotated at log_max_bytes (3 old files kept); empty = stderr only.
    log_file: Annotated[str, Flag("also log to this file (size-rotated)")] = ""
    log_max_bytes: Annotated[int, Meta(ge=1 << 16)] = 10 << 20
    # The cold tier: snapshots evicted from the pool; empty means $STATE_DIRECTORY/spill (systemd), else
    # $XDG_STATE_HOME/kvpool/spill, else ~/.local/state/kvpool/spill, plus the pool's name.
    spill_dir: Annotated[str, Flag("directory for snapshots evicted from the pool")] = ""
    spill_max_bytes: Annotated[
        NonNegative, Flag("cap of the spill directory, e.g. 1GiB (0 disables it)", parse=str)
    ] = 1 << 30
    # The hot KV's types (llama.cpp's --cache-type-k/-v): f16, or a quantized q8_0, q5_1, q5_0, q4_1, q4_0 (or
    # f32, bf16). A quantized V needs flash attention; "auto" turns it on (it is on for f16 too).
    cache_type_k: Annotated[one_of(*KV_TYPES), Flag("the hot KV's K type (default f16)")] = "f16"
    cache_type_v: Annotated[one_of(*KV_TYPES), Flag("the hot KV's V type (a quantized V turns flash attention on)")] = (
        "f16"
    )
    flash_attn: Annotated[one_of("auto", "on", "off"), Flag("llama.cpp's flash attention (auto: on)")] = "auto"
    # KV compression per tier (docs/kv-compression.md): the type the pool and the spill directory may store
    # snapshots at ("same": the hot types, bytes untouched). pool_kv_policy "when_full" keeps new snapshots at
    # the hot types and compresses the least recently used ones when the pool is full, before spilling any;
    # "always" compresses every snapshot as it is written.
    # "profile": the model's precision profile (kvpool-kv-profile's file: K layers the answers need at codings of
    # their own), found at kv_profile, else beside the model, else among the profiles kvpool ships; refused for
    # another model.
    pool_kv_type: Annotated[one_of(*STORE_TYPES, PROFILE), Flag("the type pool snapshots may be kept at")] = "same"
    pool_kv_policy: one_of("when_full", "always") = "when_full"
    spill_kv_type: Annotated[one_of(*STORE_TYPES, PROFILE), Flag("the type spilled snapshots are stored")] = "same"
    kv_profile: Annotated[str, Flag("the precision profile file for a tier whose type is profile")] = ""
    # Seconds a client may send nothing (not even heartbeats) or read nothing while it has a generation running
    # before the daemon stops that generation (CLIENT_UNRESPONSIVE). Until then its replies wait (up to 16 MiB per
    # connection) and its generations pause, holding their hot slots: a task process that is not scheduled for a
    # few seconds loses nothing. A client whose connection closes (its process died) is stopped at once.
    client_patience: Annotated[
        float,
        Meta(ge=1, le=3600),
        Flag("seconds a client may send or read nothing while it generates before its generation is stopped"),
    ] = 10.0
    # Seconds of inactivity after which a session is closed; 0 keeps sessions until closed.
    session_timeout: Annotated[float, Meta(ge=0), Flag("seconds of inactivity before a session is closed")] = 3600.0
    # llama.cpp's weight repacking for faster CPU kernels (its extra buffer types): "auto" uses it unless this CPU
    # advertises AMX that a probe decode in a child process shows it cannot run; "on" / "off" force it.
    cpu_repack: Annotated[
        one_of("auto", "on", "off"),
        Flag("llama.cpp's weight repacking (auto: on unless a probe shows this CPU's AMX cannot run it)"),
    ] = "auto"
    # CPU threads for decoding; 0 means one per core this process may use (its CPU affinity, capped by a cgroup
    # CPU quota: systemd's CPUAffinity= and CPUQuota=).
    threads: Annotated[
        int, Meta(ge=0, le=1024), Flag("CPU threads for decoding (0: one per core the daemon may use)")
    ] = 0
    # Decode with fewer threads while other processes take cores, and with all of them again when they are free
    # (engine/thread_count.py measures which count is faster now; docs/operations.md). Off: always `threads`.
    # Deterministic decoding and rpc workers keep the count fixed.
    adapt_threads: Annotated[
        bool, Flag("decode with fewer threads while other processes take cores (docs/operations.md)")
    ] = True
    # A session's tokens and logits, bit for bit, whatever else runs beside it, wherever its cells sit and however
    # its prompt was chunked (docs/determinism.md): one kernel per matrix whatever a batch's row count (no weight
    # repacking, no tiled K-quant matmul), batches of 2 to 63 tokens and never one output row (a pad row), and a KV
    # that keeps every sequence's cells in position order. Costs throughput (docs/determinism.md).
    deterministic: Annotated[
        bool, Flag("a session's answer depends on its tokens alone, whoever else runs (docs/determinism.md)")
    ] = False
    # Draftless speculation (docs/speculative.md): a decoding session may feed up to this many guessed tokens
    # beside its own each step, taken from where its context last had the same draft_ngram tokens (its prompt,
    # earlier turns, its answer so far); sampling keeps those it would have given anyway, one per row, so greedy
    # answers and seeded draws stay what they are. How many a guess gets follows its measured acceptance against
    # the step cost model (none when it does not pay). 0: off (bench/speculative.py, docs/speculative.md).
    draft_tokens: Annotated[
        int, Meta(ge=0, le=DRAFT_TOKENS_MAX), Flag("guessed tokens a decoding session may feed a step (0: off)")
    ] = 16
    # Guessed tokens a step feeds whenever a guess has them, paying or not (llama-server's --draft-min): for
    # measuring what guesses cost, and for tests that must see guesses verified and refused whatever the step
    # times. A deadline's step cap still bounds them, and a step that computes a budgeted first token's prompt
    # feeds none. At most draft_tokens.
    draft_min_tokens: Annotated[
        int, Meta(ge=0, le=DRAFT_TOKENS_MAX), Flag("guessed tokens fed whenever a guess has them, paying or not")
    ] = 0
    # The longest run of a context's last tokens looked for earlier in it (down to one token); the longest match
    # wins, so a line being copied is told from another that shares its last few tokens.
    draft_ngram: Annotated[int, Meta(ge=1, le=16), Flag("the longest n-gram a guess is matched by")] = 8
    # Guessed rows one step may hold, all sessions together: llama.cpp reserves a logits row for each at start
    # (n_vocab floats: 1 MiB for Gemma 3), counted in the memory plan.
    draft_step_rows: Annotated[
        int, Meta(ge=1, le=256), Flag("guessed rows one step may hold, all sessions together")
    ] = 16
    # Grammar jump-forward (docs/speculative.md): where a constrained answer's grammar lets one text only come next
    # (a JSON record's keys and separators, a tool envelope's fixed words), "guess" feeds its tokens as the
    # generation's guess (with draft_tokens > 0), which sampling verifies, so every token stays the one sampling
    # gives; "append" appends them (the tokenizer's) without sampling, computed in the next step like a prompt
    # chunk, which a model that splits the text otherwise would not have written; "off": neither. An answer that
    # reports log-probabilities is guessed for, never appended to (a forced token has no logits).
    jump_forward: Annotated[
        one_of("guess", "append", "off"),
        Flag("what a constrained answer's grammar forces: guessed, appended unsampled, or sampled (off)"),
    ] = "guess"
    log_level: Annotated[one_of("debug", "info", "warning", "error"), Flag("")] = "info"
    # A file each engine step appends one JSON line to: its time, the cost model's prediction, and per sequence the
    # tokens fed, guessed and sampled (engine/step_log.py). For tracing where a workload's time goes; empty: none.
    step_log: Annotated[str, Flag("append one JSON line per engine step to this file, for tracing")] = ""
    # Workers (`kvpool rpc-worker`) that lend their memory and CPU through llama.cpp's RPC backend, "HOST:PORT"
    # each; empty: the whole model on this machine. Unauthenticated: loopback or a private link (docs/rpc.md).
    rpc_servers: Annotated[
        list[Annotated[str, Meta(pattern=ENDPOINT_PATTERN, description=ENDPOINT_WORDS)]],
        Flag("kvpool rpc-worker endpoints to split the model across, HOST:PORT[,HOST:PORT...] (docs/rpc.md)"),
    ] = msgspec.field(default_factory=list)
    # Layers on the workers, counted from the end with the output layer as one (llama.cpp's n_gpu_layers);
    # -1: every layer. The rest (and always the input embeddings) stay on this machine's CPU.
    rpc_layers: Annotated[
        int, Meta(ge=-1), Flag("layers on the rpc workers, counted from the output end (-1: all)")
    ] = -1
    # How the offloaded layers are shared among the workers' devices, one proportion each (llama.cpp's
    # tensor_split); empty: by the memory each worker reports free.
    tensor_split: list[Annotated[float, Meta(ge=0)]] = msgspec.field(default_factory=list)
    # Seconds a worker may take to accept kvpoold's connection and answer its handshake at start.
    rpc_connect_timeout: Annotated[float, Meta(gt=0, le=600)] = 10.0
    # Seconds one engine step may wait for the workers (ggml-rpc itself waits for ever) before the daemon ends
    # as if a worker were lost. Above the longest step a slow link needs (a batch_size prompt chunk).
    rpc_timeout: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    # The cross-node tier (docs/remote.md): a Redis or Valkey URL, "redis://[:password@]host:6379/0" ("rediss://"
    # for TLS). Every committed checkpoint is also written there, off the engine thread, and any daemon of the same
    # model resumes a session it does not hold from there. Empty: off.
    remote: Annotated[
        str,
        Meta(pattern=r"^((redis|rediss|unix)://.*)?$", description=REMOTE_URL),
        Flag("the cross-node tier: redis://[:password@]host:6379/0 (docs/remote.md)"),
    ] = ""
    # Seconds a session's remote copy lives after its last write (0: until it is closed).
    remote_ttl: Annotated[float, Meta(ge=0)] = 7 * 86400.0
    # A node owns a session through a lease it renews every third of this; a dead node's sessions can move after it.
    remote_lease_ms: Annotated[int, Meta(ge=100, le=3_600_000)] = 10_000
    # Each Redis call's bound: slower counts as down (writes retried, resumes from remote refused).
    remote_timeout_ms: Annotated[int, Meta(ge=10, le=60_000)] = 2_000
    # Most checkpoint bytes waiting for Redis; beyond, the oldest pending write is dropped and counted.
    remote_queue_bytes: Annotated[int, Meta(ge=1 << 20)] = 256 << 20
    # The first part of every key (then the model's fingerprint and KV layout), e.g. one per fleet.
    remote_prefix: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "kvpool"
    # This daemon's name in leases (a CONFLICT names the owner by it); empty: host name and address.
    remote_node: Annotated[str, Meta(max_length=200)] = ""
    # Moving sessions up the tiers ahead of their turn: "off"; "hints" (a client's prefetch); "predict" (hints, and
    # sessions whose own history says they are due within preload_horizon_s). Never evicts anything for a guess.
    preload: Annotated[one_of("off", "hints", "predict"), Flag("move sessions up ahead of their turn")] = "hints"
    preload_horizon_s: Annotated[float, Meta(ge=0.1, le=3600)] = 2.0
    tasks: dict[str, TaskProfile] = msgspec.field(default_factory=_default_tasks)

    @property
    def determinism(self) -> Determinism:
        """What ``deterministic`` takes (llama/deterministic_mode.py): decided here, read by the rest."""
        return Determinism(self.deterministic)

    @property
    def draft_rows(self) -> int:
        """Output rows a step may have beyond one per sequence, for guesses (0 with draft_tokens = 0): llama.cpp
        reserves its logits buffer for them."""
        return min(self.draft_step_rows, self.draft_tokens * self.hot_slots)

    @property
    def threads_fixed_because(self) -> str:
        """Why the decode's thread count does not follow the free cores ("" when it does)."""
        if self.deterministic:
            return "deterministic decoding"  # a reduction's order follows the thread count
        if self.rpc_servers:
            return "rpc workers"
        return "" if self.adapt_threads else "adapt_threads = false"


class ConfigError(Exception):
    """A configuration the daemon refuses to start with; the message names the key, the value and why."""


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None
) -> Config:
    """Defaults < the TOML file at ``path`` < ``KVPOOL_*`` variables in ``environ`` < ``overrides`` (CLI flags)."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"Config file {path} does not exist; pass an existing file to --config.") from None
        except UnicodeDecodeError:
            raise ConfigError(f"Config file {path} is not UTF-8 text; save it as UTF-8 TOML.") from None
        except OSError as exc:
            raise ConfigError(f"Config file {path} cannot be read ({exc.strerror}); pass a readable file.") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"Config file {path} is not valid TOML: {exc}.") from None
    from_env = _from_environment(environ or {})
    flagged = {key: value for key, value in (overrides or {}).items() if value is not None}
    try:  # (each layer's sizes apart, so that a bad one is blamed on where it was written)
        where = source
        _parse_sizes(raw, SIZE_KEYS, "")
        for key in SIZE_KEYS:
            where = f"{ENV_PREFIX}{key.upper()}"
            _parse_sizes(from_env, (key,), "")
            where = f"--{key.replace('_', '-')}"
            _parse_sizes(flagged, (key,), "")
        raw.update(from_env)
        raw.update(flagged)
        where = source
        tasks_raw = raw.pop("tasks", {"default": {}})
        for name, table in tasks_raw.items() if isinstance(tasks_raw, dict) else ():
            if isinstance(table, dict):
                _parse_sizes(table, ("pool_quota",), f"tasks.{name}.")
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:
        config = msgspec.convert(raw | {"tasks": {}}, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, raw, "", source, flagged, from_env)) from None
    if not isinstance(tasks_raw, dict):
        raise ConfigError(f"{source}: `tasks` must be a table of [tasks.NAME] profiles.")
    tasks: dict[str, TaskProfile] = {}
    for name, table in tasks_raw.items():
        # Profiles are converted one by one so an error can name the task (msgspec hides dict keys).
        if not TASK_NAME.match(name):
            raise ConfigError(f"{source}: task name {name!r} may use only letters, digits, `_`, `.` and `-`.")
        try:
            tasks[name] = msgspec.convert(table, TaskProfile)
        except msgspec.ValidationError as exc:
            raise ConfigError(_explain(exc, table, f"tasks.{name}", source, {}, {})) from None
    if "default" not in tasks:
        raise ConfigError(f"{source}: [tasks] must define a `default` profile; sessions opened without a task use it.")

    def origin(*keys: str) -> str:
        return _origin(keys, source, flagged, from_env)

    _check_deterministic(config, origin)
    profiled = [key for key in ("pool_kv_type", "spill_kv_type") if getattr(config, key) == PROFILE]
    if profiled and (config.cache_type_k, config.cache_type_v) != ("f16", "f16"):
        raise ConfigError(
            f'{source}: {profiled[0]} = "profile" goes with the f16 hot KV the profile was measured on, not '
            f"cache_type_k = {config.cache_type_k!r} / cache_type_v = {config.cache_type_v!r}; choose a store type "
            "smaller than the hot types (docs/kv-compression.md), or the f16 hot KV."
        )
    sequences = sequence_count(config.hot_slots, config.prefix_slots, config.determinism.extra_sequences)
    if sequences > MAX_SEQUENCES:
        raise ConfigError(
            f"{origin('hot_slots', 'prefix_slots')}: hot_slots = {config.hot_slots} and prefix_slots = "
            f"{config.prefix_slots} take {sequences} of "
            f"llama.cpp's sequences (the hot slots, one per shared prefix, one scratch sequence while sharing is "
            f"on, two more in deterministic mode), more than its {MAX_SEQUENCES}; lower one of them."
        )
    if config.draft_min_tokens > config.draft_tokens:
        raise ConfigError(
            f"{source}: draft_min_tokens = {config.draft_min_tokens} is more than draft_tokens = "
            f"{config.draft_tokens}, the most a guess may feed; lower it or raise draft_tokens."
        )
    if not config.rpc_servers and (config.rpc_layers != -1 or config.tensor_split):
        key = "rpc_layers" if config.rpc_layers != -1 else "tensor_split"
        raise ConfigError(
            f"{origin(key)}: {key} is set but rpc_servers is empty: with no rpc workers the whole model runs here and "
            f"{key} would be ignored; set rpc_servers, or leave {key} out."
        )
    if config.kv_profile and not profiled:
        raise ConfigError(
            f"{source}: kv_profile = {config.kv_profile!r} is set, but no tier stores by it; set pool_kv_type or "
            'spill_kv_type = "profile", or leave kv_profile out.'
        )
    return msgspec.structs.replace(config, tasks=tasks)


def _origin(keys: Sequence[str], source: str, flagged: dict[str, Any], from_env: dict[str, Any]) -> str:
    """Where these settings were written: a flag, a variable, or the file (the first key that one of them set; a flag
    before a variable, as its value is the one kept)."""
    for key in keys:
        if key in flagged:
            return f"--{key.replace('_', '-')}"
        if key in from_env:
            return f"{ENV_PREFIX}{key.upper()}"
    return source


def _check_deterministic(config: Config, origin: Callable[..., str]) -> None:
    """Deterministic decoding rules out what would pick a kernel by a batch's shape (docs/determinism.md)."""
    if not config.deterministic:
        return
    refusals = {
        "cpu_repack": (config.cpu_repack == "on", "repacked weights take one kernel for a lone row and another "
                       'for groups of four; leave cpu_repack = "auto" (off in deterministic mode) or set "off"'),
        "flash_attn": (config.flash_attn == "off", "without flash attention a row's sums follow absolute cell "
                       'indices; use flash_attn = "auto" or "on"'),
        "rpc_servers": (bool(config.rpc_servers), "layers on rpc workers run their own build and threads; "
                        "run the whole model here"),
    }  # fmt: skip
    for key, (refused, why) in refusals.items():
        if refused:
            value = getattr(config, key)
            raise ConfigError(
                f"{origin(key, 'deterministic')}: deterministic = true does not go with {key} = {value!r}: {why}."
            )


SIZE_KEYS = (
    "cache_pool_size",
    "media_cache_size",
    "max_media_bytes",
    "spill_max_bytes",
    "memory_limit",
    "memory_high_water",
    "log_max_bytes",
    "max_message_bytes",
    "remote_queue_bytes",
)
ENV_PREFIX = "KVPOOL_"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _from_environment(environ: dict[str, str]) -> dict[str, Any]:
    """KVPOOL_HOT_SLOTS=8 -> {"hot_slots": 8}: values are read as TOML values, else taken as strings."""
    values: dict[str, Any] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "KVPOOL_ADDRESS":  # KVPOOL_ADDRESS is the clients' too
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in Config.__struct_fields__ or key == "tasks":
            continue
        try:
            values[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = text
    return values


# KVPOOL_* variables that are not the daemon's settings: the clients', the gateway's, the build's, the tests'.
OTHERS_VARIABLES = (
    "KVPOOL_ADDRESS",
    "KVPOOL_CURVE_",
    "KVPOOL_GATEWAY_",
    "KVPOOL_WHEELHOUSE",
    "KVPOOL_FIND_ONLY",
    "KVPOOL_REQUIRE_ALL",
)


def unknown_environment(environ: dict[str, str]) -> list[str]:
    """KVPOOL_* variables that name no setting (a typo such as KVPOOL_HOT_SLOT), nor another part's variable."""
    return sorted(
        name
        for name in environ
        if name.startswith(ENV_PREFIX)
        and not name.startswith(OTHERS_VARIABLES)
        and (name[len(ENV_PREFIX) :].lower() not in Config.__struct_fields__ or name == "KVPOOL_TASKS")
    )


def parse_size(text: str) -> int:
    """ "512MiB", "2GiB", "1.5G", "4096" -> bytes (binary units; "MB" is read as MiB too)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size; write e.g. 512MiB, 2GiB or a number of bytes")
    number, unit = match.groups()
    scale = _UNITS[(unit or "")[:1].upper()]
    if scale == 1 and "." in number:
        raise ValueError(f"{text!r} is not a whole number of bytes; write e.g. 512MiB or 1.5GiB")
    return int(float(number) * scale)


def _parse_sizes(table: dict[str, Any], keys: tuple[str, ...], prefix: str) -> None:
    for key in keys:
        if isinstance(table.get(key), str):
            try:
                table[key] = parse_size(table[key])
            except ValueError as exc:
                raise ValueError(f"`{prefix}{key}`: {exc}") from None


def _explain(
    exc: msgspec.ValidationError,
    raw: Any,
    prefix: str,
    source: str,
    flagged: dict[str, Any],
    from_env: dict[str, Any],
) -> str:
    """Turn msgspec's "Expected `int` >= 1 - at `$.hot_slots`" into "`hot_slots` = 0 is not allowed: ..."."""
    why, sep, where = str(exc).partition(" - at `$")
    # `$.rpc_servers[0]` -> ["rpc_servers", 0]: names, and the indices of list items
    keys: list[Any] = [
        int(part[1:-1]) if part.startswith("[") else part
        for part in re.findall(r"[^.\[\]]+|\[\d+\]", where.rstrip("`") if sep else "")
    ]
    if why.startswith("Object contains unknown field"):
        bad = why.split("`")[1]
        table = ".".join([prefix, *keys]).strip(".")
        where_text = f"[{table}]" if table else "the top level"
        return f"{source}: unknown key `{bad}` in {where_text}; check its spelling against docs/config.md."
    value: Any = raw
    for k in keys:
        if isinstance(k, int):
            value = value[k] if isinstance(value, list) and k < len(value) else None
        else:
            value = value.get(k) if isinstance(value, dict) else None
    key = prefix
    for k in keys:
        key = f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}" if key else k
    origin = _origin(keys[:1], source, flagged, from_env)
    return f"{origin}: `{key}` = {value!r} is not allowed: {_in_words(why, TaskProfile if prefix else Config, keys)}."


_KINDS = {"int": "a whole number", "float": "a number", "str": "text", "bool": "true or false", "object": "a table"}
_BOUNDS = {">=": "at least", "<=": "at most", ">": "more than", "<": "less than"}


def _in_words(why: str, struct: type, keys: list[Any]) -> str:
    """msgspec's "Expected `int` >= 1" as a sentence: "it must be a whole number of at least 1"."""
    if why.startswith("Expected `str` matching regex") and (words := _described(struct, keys)):
        return f"it {words}"
    if bound := re.fullmatch(r"Expected `(\w+)` (>=|<=|>|<) (\S+)", why):
        kind, op, limit = bound.groups()
        return f"it must be {_KINDS.get(kind, kind)} of {_BOUNDS[op]} {limit}"
    if wrong := re.fullmatch(r"Expected `(\w+)`, got `(\w+)`", why):
        want, got = wrong.groups()
        return f"it must be {_KINDS.get(want, want)}, not {_KINDS.get(got, got)}"
    return why


def _described(struct: type, keys: list[Any]) -> str:
    """The sentence a key's schema gives for its values (Meta description), or "" when it has none; for a list's
    item (``keys`` a name, then an index), its items'."""
    if not keys or any(not isinstance(k, int) for k in keys[1:]) or len(keys) > 2:
        return ""
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        if field.name != keys[0]:
            continue
        kind = field.type
        if len(keys) == 2:
            while isinstance(kind, msgspec.inspect.Metadata):
                kind = kind.type
            kind = kind.item_type if isinstance(kind, msgspec.inspect.ListType) else None
        if isinstance(kind, msgspec.inspect.Metadata):
            return str((kind.extra_json_schema or {}).get("description", ""))
    return ""
