"""The anchors bench/ compares the gateway with: kvpool-gateway in front of a private kvpoold, and llama.cpp's own
llama-server (built by scripts/build-llama-server.sh from the llama.cpp our binding vendors, same CMake arguments)
with the same slots, both on loopback and always stopped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from tests.daemon_process import free_port  # noqa: E402
from tests.gateway_process import GatewayProcess  # noqa: E402

LLAMA_CPP_VERSION = "0.3.36"
READY_S = 180.0


def llama_server_binary(path: str | None) -> str | None:
    """The llama-server to compare with: the given path, else one scripts/build-llama-server.sh built (found in its
    cache, never built here: that takes ~10 minutes), else None (the benchmark says so and runs without it)."""
    if path:
        return path
    args_file = Path(sys.prefix) / ".llama-cmake-args"
    if not args_file.is_file():
        return None
    script = ROOT / "scripts" / "build-llama-server.sh"
    env = {**os.environ, "KVPOOL_FIND_ONLY": "1"}
    done = subprocess.run(
        ["bash", str(script), LLAMA_CPP_VERSION, args_file.read_text().strip()],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    found = done.stdout.strip()
    return found if done.returncode == 0 and found and Path(found).is_file() else None


@contextlib.contextmanager
def gateway(daemon_address: str, workdir: Path, *args: str) -> Iterator[str]:
    """kvpool-gateway in front of ``daemon_address``; yields its base URL."""
    process = GatewayProcess(workdir, daemon_address, *args).start()
    try:
        yield process.url
    finally:
        process.stop()


@contextlib.contextmanager
def llama_server(binary: str, model: str, slots: int, context_per_slot: int, *args: str) -> Iterator[str]:
    """llama-server with ``slots`` parallel slots on loopback; yields its base URL."""
    port = free_port()
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * context_per_slot), "-t", "2", "--no-webui", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("llama-server did not become ready")
            time.sleep(0.2)  # polling interval of a bounded readiness wait
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
