"""The RPC workers a running kvpoold is split across: their devices, where the layers went, and a periodic
check that they still answer (so that `kvpool health` reports them, and a worker lost while nothing generates
is noticed before the next request needs it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvpool.daemon.llama.ggml_rpc import RemoteDevice
from kvpool.daemon.llama.memory_plan import RemotePart
from kvpool.protocol.status import RpcWorkerStatus

CHECK_EVERY_S = 5.0


@dataclass
class Worker:
    device: RemoteDevice
    part: RemotePart
    free: int = 0
    total: int = 0
    checked_at: float = field(default_factory=time.monotonic)


class Workers:
    def __init__(self, devices: list[RemoteDevice], parts: tuple[RemotePart, ...]):
        self.workers = [Worker(d, p) for d, p in zip(devices, parts, strict=True)]
        self._next_check = 0.0

    def check(self, idle: bool) -> None:
        """Ask every worker for its free memory (one request on the model's own connection), every few seconds
        while the engine is idle (a busy engine talks to them at every step anyway). Must run on the engine
        thread. A worker that is gone makes ggml abort: faults.py turns that into a clean exit."""
        now = time.monotonic()
        if not idle or now < self._next_check:
            return
        self._next_check = now + CHECK_EVERY_S
        for w in self.workers:
            w.free, w.total = w.device.memory()
            w.checked_at = time.monotonic()

    def note_step(self) -> None:
        """A decode that went through every worker is as good as a check."""
        now = time.monotonic()
        for w in self.workers:
            w.checked_at = now

    def status(self) -> list[RpcWorkerStatus]:
        now = time.monotonic()
        return [
            RpcWorkerStatus(
                endpoint=w.device.endpoint,
                device=w.device.name,
                layers=w.part.layers,
                output=w.part.output,
                state="connected",
                memory_free_bytes=w.free,
                memory_total_bytes=w.total,
                checked_s_ago=round(now - w.checked_at, 3),
            )
            for w in self.workers
        ]
