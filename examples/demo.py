"""The main job: kvpoold with the default model serving the voice and vision example tasks side by side.

Starts a daemon on a private address (or uses --address of one already running), runs both task processes
at the same time, shows their output and latency summaries, then stops the daemon it started.

    python examples/demo.py              # default model (Gemma 3 270M, from the `model` extra)
    python examples/demo.py --model PATH # any GGUF
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import posix_ipc

from kvpool.client import Client, DaemonUnavailable

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_S = 120.0


def wait_ready(address: str, daemon: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"kvpoold exited with {daemon.returncode}; see the messages above")
        try:
            with Client(address, connect_timeout=0.5) as client:
                print(f"[demo] kvpoold is serving {client.model} at {address}", flush=True)
                return
        except DaemonUnavailable:
            time.sleep(0.1)
    raise SystemExit(f"kvpoold did not answer within {READY_TIMEOUT_S:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF to serve (default: the embedded Gemma 3 270M)")
    ap.add_argument("--address", help="use a daemon that is already running at this address")
    args = ap.parse_args()

    daemon = None
    workdir = tempfile.mkdtemp(prefix="kvpool-demo-")
    address = args.address or f"ipc://{workdir}/kvpoold.sock"
    pool_name = f"/kvpool-demo-{os.getpid()}"
    if args.address is None:
        # A private pool and spill dir: the demo's sessions are not worth keeping after it ends.
        cmd = [
            sys.executable,
            "-m",
            "kvpool.daemon.main",
            "--address",
            address,
            "--pool-name",
            pool_name,
            "--spill-dir",
            f"{workdir}/spill",
            "--config",
            str(HERE.parent / "configs" / "default.toml"),
        ]
        if args.model:
            cmd += ["--model", args.model]
        daemon = subprocess.Popen(cmd)
    try:
        if daemon is not None:
            wait_ready(address, daemon)
        env = os.environ | {"KVPOOL_ADDRESS": address}
        tasks = [
            [sys.executable, str(HERE / "voice_assistant.py"), "--script", str(HERE / "data" / "voice_turns.txt")],
            [sys.executable, str(HERE / "vision_captioner.py"), "--scenes", str(HERE / "data" / "scenes.jsonl")],
        ]
        procs = [subprocess.Popen(cmd, env=env) for cmd in tasks]
        codes = [proc.wait(timeout=600) for proc in procs]
        subprocess.run(
            [sys.executable, "-m", "kvpool.client.cli", "--address", address, "status"], check=False, timeout=60
        )
        return max(codes)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=60)
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(pool_name)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
