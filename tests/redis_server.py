"""A real redis-server (Debian's package) on a free loopback port for the remote tier's tests: no persistence,
its own directory, always killed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import redis

from kvpool.client import Client
from kvpool.client.client import Session
from kvpool.client.errors import Conflict

from .daemon_process import STOP_TIMEOUT_S, free_port, wait_until


class RedisServer:
    def __init__(self, workdir: Path):
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server (.ci/run does)")
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"), "--protected-mode", "yes"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        wait_until(self.answers, "redis-server to answer", timeout=20)
        return self

    def answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)


def resume_when_free(client: Client, session: str, token: str, **kw: object) -> Session:
    """Resume, retrying while the dead owner's lease has not expired yet (bounded)."""
    result: list[Session] = []

    def attempt() -> bool:
        try:
            result.append(client.resume_session(session, token, **kw))
        except Conflict:
            return False
        return True

    wait_until(attempt, "the dead node's lease to expire", timeout=30)
    return result[0]
