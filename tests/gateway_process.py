"""Start and stop a real kvpool-gateway process on a free loopback port, with bounded waits."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from .daemon_process import free_port

START_TIMEOUT_S = 30.0
WAIT_S = 30.0  # per request of a test


class GatewayProcess:
    def __init__(self, workdir: Path, daemon_address: str, *args: str, port: int | None = None):
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_file = workdir / "conversations.json"
        self.log_path = workdir / "gateway.log"
        self.cmd = [
            sys.executable,
            "-m",
            "kvpool.gateway.main",
            "--port",
            str(self.port),
            "--daemon",
            daemon_address,
            "--state-file",
            str(self.state_file),
            *args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_for: str = "/metrics") -> GatewayProcess:
        """Start it and wait until ``wait_for`` answers (any status: the gateway is up, not the daemon)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpool-gateway exited with {self.proc.returncode}:\n{self.log()}")
            try:
                httpx.get(self.url + wait_for, timeout=1.0)
                return self
            except httpx.TransportError:
                time.sleep(0.05)  # polling interval of a bounded readiness wait
        raise TimeoutError(f"kvpool-gateway did not answer within {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def client_of(gateway: GatewayProcess, api_key: str = "none") -> openai.OpenAI:
    """The real openai client, pointed at the gateway (no retries: a test sees every answer as it is)."""
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=api_key, max_retries=0, timeout=WAIT_S)


def metric(gateway: GatewayProcess, name: str) -> float:
    """A series of the gateway's /metrics (one without labels)."""
    text = httpx.get(gateway.url + "/metrics", timeout=WAIT_S).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} is not in /metrics"
    return float(found.group(1))
