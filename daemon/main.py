"""`kvpoold`: the assembly of the daemon. The start is planned first (startup.py: configuration, memory plan, KV
settings), then the parts are built in order, each closed in reverse by one ExitStack: the socket, the model, the
pool and the spill directory, the remote tier (with `remote`), the tiers with the sessions recovered from the pool,
the preloader, the engine. Then it serves until SIGTERM/SIGINT and stops gracefully."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.client import __version__
from kvpool.client.address import default_address
from kvpool.client.flags import add_flags, given
from kvpool.daemon.config import Config
from kvpool.daemon.engine.cpu_share import usable_cores
from kvpool.daemon.engine.loop import Engine
from kvpool.daemon.engine.step_log import StepLog
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.pool.segment import PoolError
from kvpool.daemon.kv.recovery import recover
from kvpool.daemon.kv.sessions import Session, SessionTable
from kvpool.daemon.kv.spill_dir import SpillDir, SpillError
from kvpool.daemon.llama.model import Model, ModelLoadError, Placement
from kvpool.daemon.locations import default_pool_name, group_id, spill_dir_for
from kvpool.daemon.media.frame_areas import FrameAreas
from kvpool.daemon.media.media_cache import MediaCache
from kvpool.daemon.preload.preloader import Preloader
from kvpool.daemon.rpc.faults import WorkerWatch
from kvpool.daemon.rpc.workers import Workers
from kvpool.daemon.serve.http import HttpListener
from kvpool.daemon.serve.notify import Notifier
from kvpool.daemon.serve.zmq_server import AddressUnavailable, Server
from kvpool.daemon.startup import StartFailed, StartPlan, log_plan, place_layers, plan_start

if TYPE_CHECKING:
    from kvpool.daemon.remote.tier import RemoteTier

MAX_FRAME_AREAS = 64  # connections with a frame area at once (a device's task processes, and the gateway)
THREADS_STOP_S = 60.0  # the bound on the engine and I/O threads' orderly end (systemd's TimeoutStopSec is the same)
log = logging.getLogger("kvpool.daemon")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvpoold", description="Serve one llama.cpp model to local task processes.")
    ap.add_argument("--config", help="TOML config file (see configs/default.toml); flags override it")
    ap.add_argument(
        "--reset-pool",
        action="store_true",
        help="discard the pool segment and every session in it (their spill files too) before starting: for a pool "
        "that is refused (another model, layout or size, or damaged); never leave it on a service's command line",
    )
    config_flags = add_flags(ap, Config)
    ap.add_argument(
        "--check-config",
        action="store_true",
        help="validate the configuration, print the memory plan and exit (nothing is loaded)",
    )
    ap.add_argument("--version", action="version", version=f"kvpoold {__version__}")
    args = ap.parse_args(argv)
    args.config_flags = config_flags  # the settings that have flags: each overrides its config key when given
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        overrides = given(args, args.config_flags)
        plan = plan_start(args.config, overrides, check_only=args.check_config)
        signal.signal(signal.SIGHUP, refuse_reload)  # (from here: logging is set up, and the start may take minutes)
        if args.check_config:
            print("kvpoold: the configuration is valid and fits its memory_limit.", file=sys.stderr)
            return 0
        with contextlib.ExitStack() as stack:
            serve(assemble(plan, args.reset_pool, stack), stack)
    except StartFailed as exc:
        print(f"kvpoold: {exc}", file=sys.stderr)
        return exc.exit_code
    log.info("kvpoold stopped")
    return 0


def refuse_reload(signum: int, _frame: object) -> None:
    # (Python's default for SIGHUP ends the process at once: no cut said to the answers in flight, and no
    # checkpoint; systemd would even count it a clean exit and not restart it.)
    log.warning("received SIGHUP: ignored, kvpoold reads its settings at start only; restart it to apply new ones")


def open_step_log(path: str) -> StepLog | None:
    if not path:
        return None
    try:
        return StepLog(path)
    except OSError as exc:
        raise StartFailed(
            f"step_log: cannot open {path} to append to ({exc.strerror}); give a writable file, or none.", 1
        ) from None


@dataclass
class Daemon:
    """The assembled parts that serving needs."""

    config: Config
    address: str
    server: Server
    model: Model
    engine: Engine


def assemble(plan: StartPlan, reset_pool: bool, stack: contextlib.ExitStack) -> Daemon:
    """Build the daemon's parts in order; ``stack`` closes each one (in reverse) when serving ends or a later part
    fails to start."""
    config = plan.config
    watch = WorkerWatch(config.rpc_servers)
    placement = place_layers(plan, watch)
    log_plan(plan)
    address = config.address or default_address()
    server = bind_server(config, address, stack)  # before the model: a clash fails at once
    os.environ.update(plan.determinism.environment)  # what ggml must find before the model loads
    if plan.determinism.on:
        log.info("%s", plan.determinism.describe())
    model = load_model(plan, placement)
    stack.callback(model.close)
    pool_name = config.pool_name or default_pool_name(address)
    pool = open_pool(config, model, pool_name, reset_pool)
    stack.callback(pool.close)
    try:
        spill = SpillDir(
            spill_dir_for(config.spill_dir, pool_name), config.spill_max_bytes, model.fingerprint, model.kv_layout
        )
    except SpillError as exc:
        raise StartFailed(str(exc), 1) from None
    remote = open_remote(config, model, pool, spill, address)
    if remote is not None:
        stack.callback(remote.close)  # pending writes first (bounded), then the pool they read from
    profile = plan.kv_profile.store_type() if plan.kv_profile is not None else None
    kv = KvManager(model, pool, spill, SessionTable(config, model.context_size), config, mirror=remote, profile=profile)
    recover_sessions(kv)
    media = MediaCache(model.media, config.media_cache_size, beside=encodes_beside(config)) if model.media else None
    if media is not None:
        stack.callback(media.close)
    # Frame areas are shared memory: for local connections only (a tcp:// client sends its media as bytes).
    frame_areas = (
        FrameAreas(config.max_media_bytes, MAX_FRAME_AREAS, group_id(config.client_group))
        if media is not None and address.startswith("ipc://")
        else None
    )
    if frame_areas is not None:
        stack.callback(frame_areas.close)
    step_log = open_step_log(config.step_log)
    if step_log is not None:
        stack.callback(step_log.close)
    engine = Engine(
        model,
        config,
        kv,
        server.send,
        __version__,
        frame_errors=server.frame_errors,
        liveness=server.liveness,
        workers=Workers(placement.devices, plan.memory.remote) if placement else None,
        remote=remote,
        preloader=Preloader(kv, config.preload, config.preload_horizon_s),
        media=media,
        frame_areas=frame_areas,
        received_bytes=lambda: server.received_bytes,
        step_log=step_log,
    )
    watch.attach(
        lambda: [(g.client, g.request.id, saved_tokens(g.session)) for g in engine.scheduler.generations()],
        server.send,
    )
    if config.rpc_servers:
        watch.watch_stalls(lambda: engine.heartbeat, engine.stopping, config.rpc_timeout)
    if remote is not None:
        remote.start(list(kv.sessions.by_id.values()))  # recovered sessions: their leases, their newest state
    return Daemon(config, address, server, model, engine)


def saved_tokens(s: Session) -> int:
    """The tokens a restarted daemon recovers for ``s``: its last checkpoint's (read from the thread that reports a
    lost worker, while the engine thread waits inside llama.cpp)."""
    snapshot = s.snapshot
    return snapshot.n_tokens if snapshot is not None else 0


def bind_server(config: Config, address: str, stack: contextlib.ExitStack) -> Server:
    try:
        client_gid = group_id(config.client_group)
    except KeyError:
        raise StartFailed(
            f"client_group {config.client_group!r} does not exist; create it or fix the setting.", 2
        ) from None
    server = Server(address, config.socket_dir_mode, client_gid, config.max_message_bytes)
    stack.callback(server.close)
    try:
        server.bind(config.curve_secret_file, config.curve_clients_dir)
    except AddressUnavailable as exc:
        raise StartFailed(str(exc), 1) from None
    return server


def load_model(plan: StartPlan, placement: Placement | None) -> Model:
    config = plan.config
    try:
        return Model(
            plan.model_path,
            context_size=config.context_size,
            hot_slots=config.hot_slots,
            batch_size=config.batch_size,
            threads=decode_threads(config),
            prefix_slots=config.prefix_slots,
            repack=plan.repack.enabled,
            kv=plan.kv,
            placement=placement,
            determinism=plan.determinism,
            mmproj=plan.projector.path if plan.projector is not None else None,
            media_threads=1 if encodes_beside(config) else 0,
            draft_rows=config.draft_rows,
        )
    except ModelLoadError as exc:
        raise StartFailed(str(exc), 1) from None


def decode_threads(config: Config) -> int:
    """The threads setting, or one per core this process may use (affinity and cgroup quota)."""
    return config.threads or usable_cores()


def encodes_beside(config: Config) -> bool:
    """Whether the projector encodes on a thread of its own (media_encode = "beside", with a thread to spare, and
    not deterministic: the decode's thread count changes while it runs)."""
    threads = decode_threads(config)
    return config.media_encode == "beside" and threads >= 2 and not config.deterministic


def open_pool(config: Config, model: Model, name: str, reset: bool) -> Pool:
    """Attach to (or create) the pool."""
    try:
        return Pool.open(
            name,
            config.cache_pool_size,
            config.max_sessions + config.max_prefixes,
            model.fingerprint,
            model.kv_layout,
            mode=0o640 if config.client_group else config.pool_mode,
            reset=reset,
            gid=group_id(config.client_group),
        )
    except PoolError as exc:
        raise StartFailed(str(exc), 1) from None


def open_remote(config: Config, model: Model, pool: Pool, spill: SpillDir, address: str) -> RemoteTier | None:
    """The cross-node tier when `remote` is set (not started yet: it first takes the recovered sessions)."""
    if not config.remote:
        return None
    try:
        from kvpool.daemon.remote.tier import RemoteTier, node_name  # redis-py: the `remote` extra
    except ImportError as exc:
        raise StartFailed(f"`remote` needs {exc.name}: pip install 'kvpool[remote]'.", 2) from None
    return RemoteTier(config, model.fingerprint, model.kv_layout, pool, spill, node_name(config, address))


def recover_sessions(kv: KvManager) -> None:
    """Rebuild the sessions the pool (and the spill directory) hold."""
    try:
        recovered = recover(kv)
    except PoolError as exc:
        raise StartFailed(str(exc), 1) from None
    pool = kv.pool
    log.info(
        "pool %s %s: %d bytes, %d sessions recovered, %d bytes in use; spill dir %s",
        pool.name,
        "created" if pool.created else "attached",
        pool.size,
        recovered,
        pool.usage().used_bytes,
        kv.spill.path,
    )


def serve(d: Daemon, stack: contextlib.ExitStack) -> None:
    """Run the engine and I/O threads until SIGTERM/SIGINT, with /health and /metrics and systemd's notifications
    alongside; return once both threads have ended (``stack`` then closes the rest)."""
    engine, server, config = d.engine, d.server, d.config
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
    if config.http:  # (bound before the threads start: nothing below may unwind the stack under them)
        try:
            http = HttpListener(config.http, d.address)
            http.start()
            stack.callback(http.close)
            log.info("serving /health and /metrics on http://%s", config.http)
        except (OSError, ValueError, OverflowError) as exc:
            log.error("no HTTP listener on %s: %s", config.http, exc)
    stack.callback(notifier.close)
    engine_thread = threading.Thread(target=run_engine, name="engine")
    io_thread = threading.Thread(target=server.serve, args=(engine.submit, engine_done), name="io")
    engine_thread.start()
    io_thread.start()
    try:
        # Ready only now: the socket is bound, the model loaded, the sessions recovered, the engine running.
        notifier.ready(engine.summary())
        notifier.start_watchdog(lambda: engine.heartbeat, engine.summary)
        log.info(
            "kvpoold %s ready on %s: %s, %d hot slots, %d KV cells, %d threads",
            __version__,
            d.address,
            d.model.description,
            config.hot_slots,
            d.model.context_size,
            decode_threads(config),
        )
        while engine_thread.is_alive():
            engine_thread.join(0.5)  # a timed join keeps the main thread responsive to signals
    finally:
        # Whatever ends this (a stop, or an error here), the threads end before the stack closes their sockets
        # and the model under them.
        engine.stopping.set()
        deadline = time.monotonic() + THREADS_STOP_S
        engine_thread.join(THREADS_STOP_S)
        io_thread.join(max(0.0, deadline - time.monotonic()))


if __name__ == "__main__":
    sys.exit(main())
