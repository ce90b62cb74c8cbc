"""Start and stop real RPC workers (llama.cpp's server, through `kvpool-rpc-worker`) on 127.0.0.1 for tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvpool.daemon.rpc.endpoints import parse_endpoint, unreachable

from .daemon_process import STOP_TIMEOUT_S, free_port, wait_until


class RpcWorker:
    def __init__(self, workdir: Path, port: int | None = None, *args: str):
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log_path = workdir / f"rpc-worker-{self.port}.log"
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RpcWorker:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            command = [sys.executable, "-m", "kvpool.daemon.rpc.worker", "--port", str(self.port), "--threads", "1"]
            self.proc = subprocess.Popen(
                [*command, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        endpoint = parse_endpoint(self.endpoint)
        # The server accepts this probe connection and closes it when it reads nothing: harmless to it.
        wait_until(lambda: self._exited() or not unreachable(endpoint, 0.5), f"rpc worker on {self.endpoint}", 30)
        if self._exited():
            raise RuntimeError(f"rpc worker exited with {self.proc.returncode}:\n{self.log()}")
        return self

    def _exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
