"""What every benchmark needs: a private kvpoold on a private address, pool and spill dir, always cleaned up."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import posix_ipc

from kvpool.client import Client, DaemonUnavailable

if TYPE_CHECKING:
    from kvpool.daemon.llama.model import Model

READY_TIMEOUT_S = 120.0
PREFILL_CHUNK = 512  # tokens a decode takes when a bench fills a sequence in-process


def prefill(model: Model, seq: int, tokens: list[int]) -> None:
    """Sequence ``seq`` of an in-process model holds ``tokens`` (from position 0), computed in chunks, with the last
    token's logits."""
    model.forget_sequence(seq)
    for first in range(0, len(tokens), PREFILL_CHUNK):
        chunk = tokens[first : first + PREFILL_CHUNK]
        model.batch.clear()
        model.batch.add(seq, chunk, first, outputs=first + len(chunk) == len(tokens))
        assert model.decode() == 0


def timed_decode(model: Model, rows: list[tuple[int, list[int], int, int]]) -> float:
    """Seconds one in-process decode of ``rows`` takes: (sequence, tokens, first position, output rows) each. Their
    cells are forgotten after it, so the sequences hold what they held before and the next step can be measured."""
    model.batch.clear()
    for seq, tokens, position, outputs in rows:
        model.batch.add(seq, tokens, position, outputs)
    started = time.perf_counter()
    assert model.decode() == 0
    seconds = time.perf_counter() - started
    for seq, _, position, _ in rows:
        model.forget_from(seq, position)
    return seconds


@dataclass
class BenchDaemon:
    address: str
    pool_name: str
    workdir: str
    proc: subprocess.Popen[bytes]


@contextlib.contextmanager
def private_daemon(
    model: str, *args: str, python: str = sys.executable, env: dict[str, str] | None = None
) -> Iterator[BenchDaemon]:
    """kvpoold run by ``python`` (its install's kvpool), on a private address, pool and spill directory; ``env``
    adds environment variables."""
    workdir = tempfile.mkdtemp(prefix="kvpool-bench-")
    address = f"ipc://{workdir}/kvpoold.sock"
    pool_name = f"/kvpool-bench-{workdir.rsplit('-', 1)[-1]}"
    cmd = [
        python,
        "-m",
        "kvpool.daemon.main",
        "--model",
        model,
        "--address",
        address,
        "--pool-name",
        pool_name,
        "--spill-dir",
        f"{workdir}/spill",
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, **env} if env else None)
    daemon = BenchDaemon(address, pool_name, workdir, proc)
    try:
        wait_ready(daemon)
        yield daemon
    finally:
        proc.terminate()
        proc.wait(60)
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(pool_name)
        shutil.rmtree(workdir, ignore_errors=True)


def wait_ready(daemon: BenchDaemon) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            raise SystemExit(f"kvpoold exited with {daemon.proc.returncode}")
        try:
            with Client(daemon.address, connect_timeout=0.5):
                return
        except DaemonUnavailable:
            time.sleep(0.1)  # polling interval of a bounded readiness wait
    raise SystemExit("kvpoold did not start")


def default_model(path: str | None) -> str:
    from kvpool.daemon.llama.default_model import resolve_model_path

    return str(resolve_model_path(path or ""))


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server (Debian's package) on a free 127.0.0.1 port, no persistence; its URL. Always killed."""
    import socket

    import redis

    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: apt-get install redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvpool-bench-redis-")
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*cmd, "--dir", workdir, "--logfile", f"{workdir}/redis.log"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)  # polling interval of a bounded readiness wait
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(20)
        shutil.rmtree(workdir, ignore_errors=True)
