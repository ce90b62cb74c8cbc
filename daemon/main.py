"""`kvpoold`: parse the configuration, load the model, serve until SIGTERM/SIGINT, stop gracefully."""

from __future__ import annotations

import argparse
import faulthandler
import grp
import hashlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from kvpool.client import __version__
from kvpool.client.address import default_address
from kvpool.daemon.config import Config, ConfigError, load_config
from kvpool.daemon.engine.loop import Engine
from kvpool.daemon.engine.remote_requests import attach as attach_tiers
from kvpool.daemon.kv.codec.kv_types import STORE_TYPES
from kvpool.daemon.kv.pool.segment import Pool, PoolError
from kvpool.daemon.kv.recovery import recover
from kvpool.daemon.kv.sessions import SessionTable
from kvpool.daemon.kv.spill import SpillDir, SpillError
from kvpool.daemon.kv.tiers import Tiers
from kvpool.daemon.llama.cpu_probe import CpuUnsupported, choose_repack
from kvpool.daemon.llama.default_model import ModelNotFound, resolve_model_path
from kvpool.daemon.llama.gguf_meta import GgufError
from kvpool.daemon.llama.kv_settings import KvSettingsError, resolve_kv_settings
from kvpool.daemon.llama.memory_plan import model_shape, plan_memory
from kvpool.daemon.llama.model import Model, ModelLoadError, Placement
from kvpool.daemon.ops.logs import setup_logging
from kvpool.daemon.rpc.connect import WorkersUnavailable, connect_workers
from kvpool.daemon.rpc.faults import WorkerWatch
from kvpool.daemon.rpc.workers import Workers
from kvpool.daemon.serve.http import HttpListener
from kvpool.daemon.serve.notify import Notifier
from kvpool.daemon.serve.zmq_server import AddressUnavailable, Server

log = logging.getLogger("kvpool.daemon")

# CLI flags that override config keys of the same name (dashes for underscores).
OVERRIDES = (
    "model",
    "address",
    "hot_slots",
    "context_size",
    "max_sessions",
    "session_timeout",
    "threads",
    "cpu_repack",
    "batch_size",
    "log_level",
    "cache_pool_size",
    "pool_name",
    "checkpoint",
    "spill_dir",
    "spill_max_bytes",
    "scheduling",
    "memory_limit",
    "http",
    "log_format",
    "log_file",
    "cache_type_k",
    "cache_type_v",
    "flash_attn",
    "pool_kv_type",
    "spill_kv_type",
    "rpc_servers",
    "rpc_layers",
    "remote",
    "preload",
    "deterministic",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvpoold", description="Serve one llama.cpp model to local task processes.")
    ap.add_argument("--config", help="TOML config file (see configs/default.toml); flags override it")
    ap.add_argument("--model", help="GGUF file to serve (default: the embedded Gemma 3 270M Q4_K_M)")
    ap.add_argument(
        "--address",
        help="ipc:// address to serve (default: $RUNTIME_DIRECTORY, "
        "$XDG_RUNTIME_DIR/kvpool or /tmp/kvpool-$UID, socket kvpoold.sock)",
    )
    ap.add_argument("--hot-slots", type=int, help="sequences decoded together (each open session holds one)")
    ap.add_argument("--context-size", type=int, help="KV cells shared by all hot slots")
    ap.add_argument("--max-sessions", type=int, help="most sessions open at once")
    ap.add_argument("--session-timeout", type=float, help="seconds of inactivity before a session is closed")
    ap.add_argument("--threads", type=int, help="CPU threads for decoding (0: one per core)")
    ap.add_argument(
        "--cpu-repack",
        choices=["auto", "on", "off"],
        help="llama.cpp's weight repacking (auto: on unless a probe shows this CPU's AMX cannot run it)",
    )
    ap.add_argument("--batch-size", type=int, help="most tokens one engine step decodes")
    ap.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--cache-pool-size", help="bytes of the shared-memory pool, e.g. 512MiB or 2GiB")
    ap.add_argument("--pool-name", help="name of the pool in /dev/shm (default: derived from the address)")
    ap.add_argument(
        "--reset-pool",
        action="store_true",
        help="discard an existing pool that does not match (other model, layout or corrupt)",
    )
    ap.add_argument("--checkpoint", choices=["after_generate", "on_evict"], help="when sessions are snapshotted")
    ap.add_argument("--spill-dir", help="directory for snapshots evicted from the pool")
    ap.add_argument("--scheduling", choices=["budgets", "fcfs"], help="latency budgets, or first come first served")
    ap.add_argument("--spill-max-bytes", help="cap of the spill directory, e.g. 1GiB (0 disables it)")
    ap.add_argument("--memory-limit", help="refuse to start when the memory plan exceeds this, e.g. 1.5GiB")
    ap.add_argument("--http", help="serve /health and /metrics on 127.0.0.1:PORT")
    ap.add_argument("--log-format", choices=["text", "json"])
    ap.add_argument("--cache-type-k", help="the hot KV's K type: f16 (default), q8_0, q5_1, q5_0, q4_1, q4_0, ...")
    ap.add_argument("--cache-type-v", help="the hot KV's V type (a quantized V turns flash attention on)")
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], help="llama.cpp's flash attention (auto: on)")
    ap.add_argument("--pool-kv-type", choices=STORE_TYPES, help="the type pool snapshots may be kept at")
    ap.add_argument("--spill-kv-type", choices=STORE_TYPES, help="the type spilled snapshots are stored")
    ap.add_argument("--log-file", help="also log to this file (size-rotated)")
    ap.add_argument("--remote", help="the cross-node tier: redis://[:password@]host:6379/0 (docs/remote.md)")
    ap.add_argument("--preload", choices=["off", "hints", "predict"], help="move sessions up ahead of their turn")
    ap.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a session's answer depends on its tokens alone, whoever else runs (docs/determinism.md)",
    )
    ap.add_argument(
        "--rpc-servers",
        type=lambda text: [item.strip() for item in text.split(",") if item.strip()],
        help="kvpool rpc-worker endpoints to split the model across, HOST:PORT[,HOST:PORT...] (docs/rpc.md)",
    )
    ap.add_argument("--rpc-layers", type=int, help="layers on the rpc workers, counted from the output end (-1: all)")
    ap.add_argument(
        "--check-config",
        action="store_true",
        help="validate the configuration, print the memory plan and exit (nothing is loaded)",
    )
    ap.add_argument("--version", action="version", version=f"kvpoold {__version__}")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, {k: getattr(args, k) for k in OVERRIDES}, dict(os.environ))
        setup_logging(config.log_level, config.log_format, config.log_file, config.log_max_bytes)
        model_path = resolve_model_path(config.model)
        plan = plan_memory(model_path, config)
        shape = model_shape(model_path)
        kv, kv_why = resolve_kv_settings(
            config.cache_type_k, config.cache_type_v, config.flash_attn, shape.head_k, shape.head_v
        )
        # Deterministic decoding turns repacking off: see config._check_deterministic.
        repack = choose_repack("off" if config.deterministic else config.cpu_repack, model_path)
    except (ConfigError, ModelNotFound, GgufError, CpuUnsupported, KvSettingsError, OSError) as exc:
        print(f"kvpoold: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        print(f"kvpoold: {repack.describe()}", file=sys.stderr)
        print(f"kvpoold: {kv.describe()}; {kv_why}", file=sys.stderr)
    if args.check_config or not plan.fits:
        print(f"kvpoold: memory plan for {model_path.name}:\n{plan.table()}", file=sys.stderr)
    if not plan.fits:
        print(
            f"kvpoold: the plan needs {plan.total / 2**20:.0f} MiB but memory_limit is "
            f"{plan.limit / 2**20:.0f} MiB; lower cache_pool_size, context_size, hot_slots or batch_size, "
            "or raise memory_limit.",
            file=sys.stderr,
        )
        return 2
    if args.check_config:
        print("kvpoold: the configuration is valid and fits its memory_limit.", file=sys.stderr)
        return 0
    log.info("%s", repack.describe())
    log.info("%s; %s", kv.describe(), kv_why)
    watch = WorkerWatch(config.rpc_servers)
    placement = None
    if config.rpc_servers:
        try:
            devices, shares, plan = connect_workers(config, model_path, watch)
        except WorkersUnavailable as exc:
            print(f"kvpoold: {exc}", file=sys.stderr)
            return exc.exit_code
        placement = Placement(devices, config.rpc_layers, shares)
        if not plan.fits:  # planned again with the layers where the workers' free memory puts them
            print(f"kvpoold: memory plan for {model_path.name}:\n{plan.table()}", file=sys.stderr)
            print(
                f"kvpoold: the local part of the plan needs {plan.total / 2**20:.0f} MiB but memory_limit is "
                f"{plan.limit / 2**20:.0f} MiB; put more layers on the workers (rpc_layers, tensor_split), or "
                "lower cache_pool_size, context_size, hot_slots or batch_size.",
                file=sys.stderr,
            )
            return 2
    log.info(
        "memory plan: %.0f MiB (weights %.0f, hot KV %.0f, compute %.0f, pool %.0f, runtime %.0f)",
        plan.total / 2**20,
        plan.weights / 2**20,
        plan.hot_kv / 2**20,
        plan.compute / 2**20,
        plan.pool / 2**20,
        plan.runtime / 2**20,
    )
    for part in plan.remote:
        log.info(
            "memory plan on rpc worker %s: %.0f MiB (%d layers%s: weights %.0f, hot KV %.0f, compute %.0f)",
            part.endpoint,
            part.total / 2**20,
            part.layers,
            " + output" if part.output else "",
            part.weights / 2**20,
            part.hot_kv / 2**20,
            part.compute / 2**20,
        )

    address = config.address or default_address()
    try:
        client_gid = group_id(config.client_group)
    except KeyError:
        print(
            f"kvpoold: client_group {config.client_group!r} does not exist; create it or fix the setting.",
            file=sys.stderr,
        )
        return 2
    server = Server(address, config.socket_dir_mode, client_gid, config.max_message_bytes)
    try:
        server.bind(config.curve_secret_file, config.curve_clients_dir)  # before the model: a clash fails at once
    except AddressUnavailable as exc:
        print(f"kvpoold: {exc}", file=sys.stderr)
        server.close()
        return 1
    if config.deterministic:
        # llama.cpp's tiled K-quant matmul serves batches of 8 rows and more, vec_dot fewer: another sum order.
        # ggml reads this once, at the first decode of the process.
        os.environ["GGML_CPU_TILED_MM"] = "0"
        log.info("deterministic decoding: repacking and the tiled matmul off, steps of at most 63 tokens")
    try:
        threads = config.threads or os.cpu_count() or 1
        model = Model(
            model_path,
            context_size=config.context_size,
            hot_slots=config.hot_slots,
            batch_size=config.batch_size,
            threads=threads,
            prefix_slots=config.prefix_slots,
            repack=repack.enabled,
            kv=kv,
            placement=placement,
            deterministic=config.deterministic,
        )
    except ModelLoadError as exc:
        print(f"kvpoold: {exc}", file=sys.stderr)
        server.close()
        return 1

    try:
        tiers = open_tiers(config, model, address, reset=args.reset_pool)
    except (PoolError, SpillError) as exc:
        print(f"kvpoold: {exc}", file=sys.stderr)
        model.close()
        server.close()
        return 1
    engine = Engine(
        model,
        config,
        tiers,
        server.send,
        __version__,
        frame_errors=server.frame_errors,
        last_heard=server.last_heard,
        lagging=server.lagging,
        workers=Workers(placement.devices, plan.remote) if placement else None,
    )
    watch.attach(lambda: [(g.client, g.request.id) for g in engine.scheduler.generations()], server.send)
    if config.rpc_servers:
        watch.watch_stalls(lambda: engine.heartbeat, engine.stopping, config.rpc_timeout)
    try:
        remote = attach_tiers(engine, config, address)
    except ImportError as exc:
        print(f"kvpoold: `remote` needs {exc.name}: pip install 'kvpool[remote]'.", file=sys.stderr)
        tiers.close()
        model.close()
        server.close()
        return 2
    engine_done = threading.Event()

    def run_engine() -> None:
        try:
            engine.run()
        finally:
            server.close_sender()
            engine_done.set()

    notifier = Notifier()

    def request_stop(signum: int, _frame: object) -> None:
        log.info("received %s: finishing in-flight generations and stopping", signal.Signals(signum).name)
        notifier.stopping()
        engine.stopping.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints every thread's stack
    engine_thread = threading.Thread(target=run_engine, name="engine")
    io_thread = threading.Thread(target=server.serve, args=(engine.submit, engine_done), name="io")
    engine_thread.start()
    io_thread.start()
    http = None
    if config.http:
        try:
            http = HttpListener(config.http, address)
            http.start()
            log.info("serving /health and /metrics on http://%s", config.http)
        except (OSError, ValueError) as exc:
            log.error("no HTTP listener on %s: %s", config.http, exc)
    # Ready only now: the socket is bound, the model loaded, the sessions recovered, the engine running.
    notifier.ready(engine.summary())
    notifier.start_watchdog(lambda: engine.heartbeat, engine.summary)
    log.info(
        "kvpoold %s ready on %s: %s, %d hot slots, %d KV cells, %d threads",
        __version__,
        address,
        model.description,
        config.hot_slots,
        model.context_size,
        threads,
    )
    while engine_thread.is_alive():
        engine_thread.join(0.5)  # a timed join keeps the main thread responsive to signals
    io_thread.join()
    notifier.close()
    if http is not None:
        http.close()
    if remote is not None:
        remote.close()  # pending writes first (bounded), then the pool they read from
    tiers.close()
    model.close()
    server.close()
    log.info("kvpoold stopped")
    return 0


def group_id(group: str) -> int | None:
    """The gid of ``group`` (a name or a number); None for no group."""
    if not group:
        return None
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def default_pool_name(address: str) -> str:
    return "/kvpool-" + hashlib.sha256(address.encode()).hexdigest()[:16]


def spill_dir_for(configured: str, pool_name: str) -> Path:
    """The spill directory of one pool: the configured (or default) base plus the pool's name, so daemons
    sharing a base never touch each other's files."""
    if configured:
        base = Path(configured)
    elif state := os.environ.get("STATE_DIRECTORY"):
        base = Path(state.split(":")[0]) / "spill"
    else:
        base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "kvpool" / "spill"
    return base / pool_name.lstrip("/")


def open_tiers(config: Config, model: Model, address: str, reset: bool) -> Tiers:
    """Attach to (or create) the pool, open the spill directory, and recover the sessions they hold."""
    name = config.pool_name or default_pool_name(address)
    pool = Pool.open(
        name,
        config.cache_pool_size,
        config.max_sessions + config.max_prefixes,
        model.fingerprint,
        model.kv_layout,
        mode=0o640 if config.client_group else config.pool_mode,
        reset=reset,
        gid=group_id(config.client_group),
    )
    try:
        spill = SpillDir(
            spill_dir_for(config.spill_dir, name), config.spill_max_bytes, model.fingerprint, model.kv_layout
        )
    except SpillError:
        pool.close()
        raise
    tiers = Tiers(model, pool, spill, SessionTable(config, model.context_size), config)
    try:
        recovered = recover(tiers)
    except PoolError:
        tiers.close()
        raise
    usage = pool.usage()
    log.info(
        "pool %s %s: %d bytes, %d sessions recovered, %d bytes in use; spill dir %s",
        name,
        "created" if pool.created else "attached",
        pool.size,
        recovered,
        usage.used_bytes,
        spill.path,
    )
    return tiers


if __name__ == "__main__":
    sys.exit(main())
