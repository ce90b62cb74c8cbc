"""Queue, don't refuse: the gateway's own bounded, fair queue in front of the daemon.

At most ``limit`` generations are dispatched to the daemon at once; beyond that a request waits here, in a
queue of at most ``size`` requests, served round-robin across keys (who is asking: see routes.fairness_key) and
first-come-first-served within a key. Only a full queue (or a key over its ``per_key`` share) is refused, with
429 and Retry-After. A request whose client goes away leaves the queue (its task is cancelled)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from .http_errors import HttpError
from .metrics import GatewayMetrics


@dataclass
class _Waiter:
    key: str
    weight: int
    since: float
    granted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    def __init__(self, size: int, per_key: int, metrics: GatewayMetrics, limit: int = 1):
        """``size``: requests that may wait; ``per_key``: of those, how many one key may have (0: no limit);
        ``limit``: generations in flight at once (set from the daemon once connected, see Gateway.client)."""
        self.size, self.per_key, self.limit = size, per_key, limit
        self.metrics = metrics
        self.in_flight = 0
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._turns: deque[str] = deque()  # keys with waiters, in the order they are served next
        self.depth = 0
        self.queued = self.refused = 0

    @asynccontextmanager
    async def slot(self, key: str, weight: int = 1) -> AsyncIterator[None]:
        """Hold ``weight`` of the in-flight generations (an n-choice request takes n) for the block."""
        weight = max(1, min(weight, self.limit))
        await self._acquire(key, weight)
        try:
            yield
        finally:
            self._release(weight)

    async def _acquire(self, key: str, weight: int) -> None:
        if not self.depth and self.in_flight + weight <= self.limit:
            self.in_flight += weight
            return
        if self.depth >= self.size:
            self._refuse(f"The gateway's queue is full ({self.size} requests wait); retry shortly.")
        mine = self._waiting.get(key)
        if self.per_key and mine is not None and len(mine) >= self.per_key:
            self._refuse(
                f"You have {len(mine)} requests waiting, the most one client may (--queue-per-key); "
                "retry when one is answered."
            )
        waiter = _Waiter(key, weight, time.monotonic())
        if mine is None:
            mine = self._waiting[key] = deque()
            self._turns.append(key)
        mine.append(waiter)
        self.depth += 1
        self.queued += 1
        self.metrics.queued.inc()
        self.metrics.queue_depth.set(self.depth)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release(weight)  # granted as it was cancelled: give the slot to the next
            else:
                self._leave(waiter)
            raise
        self.metrics.queue_wait.observe(time.monotonic() - waiter.since)

    def try_hold(self) -> bool:
        """Take one in-flight place now if one is free and no request waits, for work done ahead of requests (a
        prefill, tool_result_prefill.py), which must never make a request wait; give it back with give_back()."""
        if self.depth or self.in_flight + 1 > self.limit:
            return False
        self.in_flight += 1
        return True

    def give_back(self) -> None:
        self._release(1)

    def _refuse(self, message: str) -> None:
        self.refused += 1
        self.metrics.queue_refused.inc()
        raise HttpError(429, message, "queue_full", "rate_limit_error")

    def _leave(self, waiter: _Waiter) -> None:
        mine = self._waiting.get(waiter.key)
        if mine is None or waiter not in mine:
            return
        mine.remove(waiter)
        self.depth -= 1
        if not mine:
            del self._waiting[waiter.key]
            self._turns.remove(waiter.key)
        self.metrics.queue_depth.set(self.depth)
        self._dispatch()  # a heavier request at the head may have blocked lighter ones behind it

    def _release(self, weight: int) -> None:
        self.in_flight -= weight
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant waiting requests while there is room: the next key in turn, its oldest request."""
        while self._turns:
            key = self._turns[0]
            mine = self._waiting[key]
            waiter = mine[0]
            if self.in_flight + waiter.weight > self.limit:
                break
            mine.popleft()
            self._turns.popleft()
            if mine:
                self._turns.append(key)  # its next request waits for the other keys' turns
            else:
                del self._waiting[key]
            self.depth -= 1
            self.in_flight += waiter.weight
            waiter.granted.set_result(None)
        self.metrics.queue_depth.set(self.depth)

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._dispatch()

    def status(self) -> dict[str, Any]:
        return {
            "depth": self.depth,
            "size": self.size,
            "per_key": self.per_key,
            "in_flight": self.in_flight,
            "limit": self.limit,
            "keys_waiting": len(self._waiting),
            "queued": self.queued,
            "refused": self.refused,
        }
