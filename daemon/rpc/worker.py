"""`kvpool rpc-worker`: lend this machine's memory and CPU to a kvpoold elsewhere, through llama.cpp's own RPC
server (ggml_backend_rpc_start_server from the ggml-rpc library llama-cpp-python ships). This is llama.cpp's
server loop, not a kvpool protocol: it serves one master at a time, and it is unauthenticated (docs/rpc.md).

Exit codes: 0 never (it serves until stopped by a signal); 1 it could not serve (port taken, address not
local, no RPC backend in this build); 2 bad usage.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvpool.daemon.engine.cpu_share import usable_cores
from kvpool.daemon.llama.default_model import model_cache_dir
from kvpool.daemon.llama.ggml_rpc import RpcUnavailable, serve
from kvpool.daemon.rpc.endpoints import is_private, parse_endpoint

DEFAULT_PORT = 50052


def default_cache_dir() -> Path:
    """Where the worker keeps tensors it has received, so a restarted master sends hashes instead of weights:
    $CACHE_DIRECTORY/rpc (systemd), else $XDG_CACHE_HOME/kvpool/rpc, else ~/.cache/kvpool/rpc."""
    return model_cache_dir() / "rpc"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kvpool rpc-worker",
        description="Serve this machine's CPU and memory to a kvpoold over llama.cpp's RPC protocol "
        "(unauthenticated: bind it to loopback or a private link, see docs/rpc.md).",
    )
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default: {DEFAULT_PORT})")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for the layers it runs (0: one per core)")
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument("--cache", action="store_true", help=f"keep received tensors on disk (in {default_cache_dir()})")
    cache.add_argument("--cache-dir", help="keep received tensors on disk in this directory")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        endpoint = parse_endpoint(f"{args.host}:{args.port}")
    except ValueError as exc:
        print(f"kvpool rpc-worker: {exc}", file=sys.stderr)
        return 2
    if not is_private(endpoint):
        print(
            f"kvpool rpc-worker: WARNING: {endpoint.host} is not a loopback or private address. llama.cpp's RPC "
            "protocol has no authentication or encryption: anyone who reaches this port can read and change the "
            "memory it serves. Listen on loopback and reach it through an SSH or WireGuard tunnel (docs/rpc.md).",
            file=sys.stderr,
        )
    threads = args.threads or usable_cores()
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir() if args.cache else None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    print(
        f"kvpool rpc-worker: serving this CPU ({threads} threads) on {endpoint} with llama.cpp's RPC server"
        + (f", tensor cache {cache_dir}" if cache_dir else ""),
        file=sys.stderr,
        flush=True,
    )
    # The server loop runs inside one C call: Python's SIGINT handler would never get to run, so Ctrl-C and
    # SIGTERM keep their default action (end the process; the worker holds nothing that needs saving).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        serve(str(endpoint), str(cache_dir) if cache_dir else None, threads)
    except RpcUnavailable as exc:
        print(f"kvpool rpc-worker: {exc}", file=sys.stderr)
        return 1
    print(
        f"kvpool rpc-worker: could not serve on {endpoint}: the port is taken or the address is not one of this "
        "machine's (llama.cpp's message above says which).",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
