"""Start and stop a real kvpoold process for integration tests, with bounded waits and full cleanup."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import posix_ipc

from kvpool.client import Client, DaemonUnavailable

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


class DaemonProcess:
    def __init__(self, workdir: Path, model: Path | None, *args: str, config: str | None = None):
        self.workdir = workdir
        self.address = f"ipc://{workdir / 'kvpoold.sock'}"
        self.log_path = workdir / "kvpoold.log"
        self.args = list(args)
        self.model = model
        self.config = config
        # Each test daemon gets its own pool segment and spill dir, removed by cleanup() even on failure.
        self.pool_name = f"/kvpool-test-{secrets.token_hex(6)}"
        self.spill_base = workdir / "spill"
        self.spill_dir = self.spill_base / self.pool_name.lstrip("/")  # the daemon adds the pool's name
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        # A small pool by default: posix_fallocate reserves all of it in /dev/shm for the daemon's lifetime.
        cmd = [
            sys.executable,
            "-m",
            "kvpool.daemon.main",
            "--address",
            self.address,
            "--pool-name",
            self.pool_name,
            "--spill-dir",
            str(self.spill_base),
            "--cache-pool-size",
            "16MiB",
        ]
        if self.model is not None:
            cmd += ["--model", str(self.model)]
        if self.config is not None:
            path = self.workdir / "kvpoold.toml"
            path.write_text(self.config)
            cmd += ["--config", str(path)]
        return cmd + self.args

    def start(self, wait: bool = True) -> DaemonProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll until the daemon answers hello; fail with its log if it exits or the deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"kvpoold exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with Client(self.address, connect_timeout=0.5):
                    return
            except DaemonUnavailable:
                time.sleep(0.05)  # polling interval of a bounded readiness wait, not synchronisation
        raise TimeoutError(f"kvpoold did not become ready within {timeout} s:\n{self.log()}")

    def client(self, **kwargs: object) -> Client:
        return Client(self.address, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Stop the daemon (SIGTERM, then SIGKILL after a bound); return its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.pool_name)
        for leftover in (self.workdir / "kvpoold.sock", self.workdir / "kvpoold.sock.lock"):
            if leftover.exists():
                os.unlink(leftover)


def wait_until(check: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Poll ``check`` until it is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling interval of a bounded wait


T = TypeVar("T")


def poll(read: Callable[[], T], until: Callable[[T], bool], timeout: float = 60.0) -> T:
    """Read until ``until`` holds of the value or ``timeout`` seconds pass; the last value read, for the caller to
    assert on."""
    deadline = time.monotonic() + timeout
    value = read()
    while not until(value) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling interval of a bounded wait
        value = read()
    return value


def kvpoold_command(model: Path, address: str, *args: str) -> list[str]:
    """The command line of a daemon started by hand (one that is expected to refuse, or to exit at once)."""
    return [sys.executable, "-m", "kvpool.daemon.main", "--model", str(model), "--address", address, *args]


def run_until_exit(cmd: list[str], timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run a command that must end by itself (e.g. a daemon that refuses to start)."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(STOP_TIMEOUT_S)


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick; another process could take it before the server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
