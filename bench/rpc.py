"""The cost of splitting the model across an RPC worker (llama.cpp's RPC backend) on loopback.

Daemons run side by side on the same model and are measured alternately, round after round, so that both
see the same machine noise:
  local   the whole model on this machine
  split   half the repeating layers and the output layer on a `kvpool rpc-worker` on 127.0.0.1
          (rpc_layers = n_layer / 2 + 1), the rest local
For each: decode tokens/s with 1 and 4 concurrent streams (64 greedy tokens each, client side), time to first
token of a 512-token prompt (one session, fresh), and for split the bytes crossing the loopback per generated
token (sent + received on the worker's TCP connection: the kernel's tcp_info, `ss -ti`). Target: split >= 0.75 x
local. On one machine the worker competes with the daemon for the same cores: see the comment in main() for which
local run each split is compared with.

The worker's tensor cache (`--cache`) only changes how the weights reach the worker at load, so it is measured
as kvpoold's start time: no cache, cache cold (first start fills it), cache warm (second start sends hashes).

    python bench/rpc.py [--model PATH] [--repeat 5] [--threads N (default: one per core)]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client  # noqa: E402
from kvpool.daemon.llama.gguf_meta import read_metadata  # noqa: E402

MAX_TOKENS = 64
TIMEOUT_S = 600
PROMPT_512 = " ".join(f"item {i} is {'red' if i % 2 else 'blue'}." for i in range(100))  # ~512 Gemma tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rpc_worker(threads: int, cache_dir: str | None = None) -> Iterator[tuple[str, int]]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvpool.daemon.rpc.worker", "--port", str(port), "--threads", str(threads)]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the rpc worker did not start") from None
                time.sleep(0.1)  # polling interval of a bounded readiness wait
        yield f"127.0.0.1:{port}", port
    finally:
        proc.kill()
        proc.wait()


def tcp_bytes(port: int) -> int:
    """Bytes sent plus received on the worker's established TCP connections (the kernel's tcp_info, `ss -ti`)."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True, check=True
    ).stdout
    return sum(int(n) for n in re.findall(r"bytes_(?:sent|received):(\d+)", out))


def decode_tps(address: str, streams: int) -> tuple[float, int]:
    """Aggregate generated tokens/s of ``streams`` sessions generating at once; and the tokens generated."""
    barrier = threading.Barrier(streams + 1)
    results: list[tuple[float, float, int]] = []

    def one(i: int) -> None:
        with Client(address, timeout=TIMEOUT_S) as client, client.open_session() as session:
            barrier.wait()
            start = time.monotonic()
            out = session.complete(f"Story {i}: once upon a time,", max_tokens=MAX_TOKENS, temperature=0.0)
            results.append((start, time.monotonic(), out.usage.completion_tokens))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join(TIMEOUT_S)
    tokens = sum(r[2] for r in results)
    return tokens / (max(r[1] for r in results) - min(r[0] for r in results)), tokens


def ttft_512(address: str) -> float:
    with Client(address, timeout=TIMEOUT_S) as client, client.open_session() as session:
        start = time.monotonic()
        session.complete(PROMPT_512, max_tokens=1, temperature=0.0)
        return (time.monotonic() - start) * 1000.0


REPACK = ["--cpu-repack", "off"]  # set by main()


def daemon_args(threads: int, *extra: str) -> list[str]:
    return ["--hot-slots", "4", "--context-size", "4096", "--threads", str(threads), "--cache-pool-size", "64MiB",
            *REPACK, *extra]  # fmt: skip


def start_seconds(model: str, args: list[str]) -> float:
    start = time.monotonic()
    with private_daemon(model, *args):
        return time.monotonic() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="the all-local daemon's threads")
    ap.add_argument(
        "--cpu-repack",
        choices=["auto", "on", "off"],
        default="off",
        help="the daemons' weight repacking (default off: the worker's CPU backend never repacks, so off runs the "
        "same kernels everywhere and the comparison isolates the split)",
    )
    args = ap.parse_args()
    REPACK[1] = args.cpu_repack
    model = default_model(args.model)
    meta = read_metadata(Path(model))
    n_layer = int(meta[f"{meta['general.architecture']}.block_count"])
    rpc_layers = n_layer // 2 + 1
    os.environ["KVPOOL_CALIBRATE"] = "false"  # the cost model is not what is measured here
    threads = sorted({1, args.threads})
    # Each split is compared with the all-local daemon whose process has as many threads as each of the split's
    # two. A single stream decodes in series (the daemon's layers, then the worker's, then sampling), so
    # "split 1+1" does the work of "local 1" plus the RPC traffic: its ratio is the cost of the split itself.
    # "split N+N" on one machine also runs twice the threads of its cores (the worker competes with the daemon).
    configs = {f"local {t}": (t, 0) for t in threads} | {f"split {t}+{t}": (t, t) for t in threads}
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in configs}
    with contextlib.ExitStack() as stack:
        daemons: dict[str, tuple[str, int]] = {}
        for name, (daemon_threads, worker_threads) in configs.items():
            extra: list[str] = []
            port = 0
            if worker_threads:
                endpoint, port = stack.enter_context(rpc_worker(worker_threads))
                extra = ["--rpc-servers", endpoint, "--rpc-layers", str(rpc_layers)]
            daemons[name] = (
                stack.enter_context(private_daemon(model, *daemon_args(daemon_threads, *extra))).address,
                port,
            )
        for r in range(args.repeat):
            for name, (address, port) in daemons.items():
                row = runs[name]
                before = tcp_bytes(port) if port else 0
                generated = 0
                for streams in (1, 4):
                    tps, tokens = decode_tps(address, streams)
                    row.setdefault(f"decode{streams}", []).append(tps)
                    generated += tokens
                if port:
                    row.setdefault("bytes", []).append((tcp_bytes(port) - before) / generated)
                row.setdefault("ttft", []).append(ttft_512(address))
            print(f"round {r + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    starts = {"local": start_seconds(model, daemon_args(1))}
    cache = tempfile.mkdtemp(prefix="kvpool-rpc-cache-")
    try:
        for name, cache_dir in (("split", None), ("split, cache cold", cache), ("split, cache warm", cache)):
            with rpc_worker(1, cache_dir) as (endpoint, _):
                starts[name] = start_seconds(
                    model, daemon_args(1, "--rpc-servers", endpoint, "--rpc-layers", str(rpc_layers))
                )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print_table(runs, starts, args, n_layer, rpc_layers)
    return 0


def print_table(
    runs: dict[str, dict[str, list[float]]], starts: dict[str, float], args: argparse.Namespace, n_layer: int,
    rpc_layers: int,
) -> None:  # fmt: skip
    med = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in runs.items()}
    load = os.getloadavg()
    print(
        f"\nRPC split on loopback: {rpc_layers - 1} of {n_layer} layers + output on a worker; threads of the daemon"
        f" (+ the worker) as named, cpu_repack {args.cpu_repack}; ratios against local with the same threads per"
        f" process; median of "
        f"{args.repeat} alternating rounds (cpu: {os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f})"
    )
    head = (
        f"{'':<11} | {'decode 1 tok/s':>14} | {'decode 4 tok/s':>14} | {'TTFT 512 ms':>11} | {'bytes/token':>11} | "
        f"{'vs local: 1 / 4 / TTFT':>22}"
    )
    print(head)
    print("-" * len(head))
    for name, m in med.items():
        lo = med["local " + name.split()[1].split("+")[0]]
        per_token = f"{m['bytes']:>11.0f}" if "bytes" in m else f"{'-':>11}"
        ratios = " / ".join(f"{m[k] / lo[k]:.2f}x" for k in ("decode1", "decode4", "ttft"))
        print(
            f"{name:<11} | {m['decode1']:>14.1f} | {m['decode4']:>14.1f} | {m['ttft']:>11.0f} | {per_token} | "
            f"{ratios:>22}"
        )
    print("\nkvpoold start until ready (one run each): " + ", ".join(f"{k} {v:.1f} s" for k, v in starts.items()))


if __name__ == "__main__":
    sys.exit(main())
