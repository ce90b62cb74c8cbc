"""What the daemon knows of each client's connection, kept by the I/O thread and read by the engine thread.

A client is alive while its connection is: a client process that died closes it, and the next reply to it fails
(ZeroMQ's EHOSTUNREACH), which marks it ``gone`` at once. A client that is alive but not scheduled (a paused or
busy task process, a gateway behind other work) is only quiet: it sends no heartbeats and reads nothing for a
while. Its replies wait in a bounded backlog and its generations pause (the scheduler skips them) until it reads
again; only a client that stays silent, or reads nothing, for ``patience`` seconds has its generations stopped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

FORGET_S = 300.0  # a client heard from this long ago, with no replies waiting, is forgotten


@dataclass
class ClientState:
    heard: float  # when its last frame came
    heartbeats: bool = False  # it said it pings while it waits: its silence means something
    gone: bool = False  # its connection closed: nobody is there to read
    backlog: deque[list[bytes]] = field(default_factory=deque)  # replies ZeroMQ could not take yet, in order
    backlog_bytes: int = 0
    last_read: float = 0.0  # when a reply to it last went out (it is reading)


class Liveness:
    """Clients by ZeroMQ identity. Every method takes the lock: the I/O thread writes, the engine thread reads."""

    def __init__(self, max_backlog_bytes: int):
        self.max_backlog_bytes = max_backlog_bytes
        self.dropped_replies = 0  # replies lost: to a client that is gone, or past a backlog's bound
        self._clients: dict[bytes, ClientState] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ I/O thread

    def heard(self, client: bytes, heartbeats: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            state = self._clients.get(client)
            if state is None:
                self._clients[client] = state = ClientState(heard=now, last_read=now)
            state.heard = now
            state.gone = False  # (a DEALER that reconnects keeps no identity: this is a new connection's frame)
            state.heartbeats = state.heartbeats or heartbeats

    def sent(self, client: bytes) -> None:
        with self._lock:
            state = self._clients.get(client)
            if state is not None:
                state.last_read = time.monotonic()

    def went_away(self, client: bytes) -> None:
        with self._lock:
            state = self._clients.get(client)
            if state is not None:
                state.gone = True
                self.dropped_replies += len(state.backlog)
                state.backlog.clear()
                state.backlog_bytes = 0
            self.dropped_replies += 1

    def defer(self, frames: list[bytes]) -> bool:
        """Keep a reply ZeroMQ could not take (the client's queue is full) behind the others; False when the
        backlog is at its bound (the reply is dropped and counted)."""
        size = sum(len(f) for f in frames)
        with self._lock:
            state = self._clients.get(frames[0])
            if state is None:
                now = time.monotonic()
                self._clients[frames[0]] = state = ClientState(heard=now, last_read=now)
            if state.gone or state.backlog_bytes + size > self.max_backlog_bytes:
                self.dropped_replies += 1
                return False
            state.backlog.append(frames)
            state.backlog_bytes += size
            return True

    def has_backlog(self, client: bytes) -> bool:
        with self._lock:
            state = self._clients.get(client)
            return state is not None and bool(state.backlog)

    def backlogged(self) -> list[bytes]:
        with self._lock:
            return [client for client, state in self._clients.items() if state.backlog]

    def next_deferred(self, client: bytes) -> list[bytes] | None:
        with self._lock:
            state = self._clients.get(client)
            return state.backlog[0] if state is not None and state.backlog else None

    def delivered_deferred(self, client: bytes) -> None:
        with self._lock:
            state = self._clients[client]
            frames = state.backlog.popleft()
            state.backlog_bytes -= sum(len(f) for f in frames)
            state.last_read = time.monotonic()

    def forget_old(self) -> None:
        """Drop clients unheard for FORGET_S; one with replies waiting is kept (forgetting them would leave a hole in
        its stream)."""
        now = time.monotonic()
        with self._lock:
            for client in [c for c, s in self._clients.items() if now - s.heard > FORGET_S and not s.backlog]:
                del self._clients[client]

    # ------------------------------------------------------------------ engine thread

    def gone(self, client: bytes) -> bool:
        """Whether the connection closed (a reply to it failed): nobody is there any more."""
        with self._lock:
            state = self._clients.get(client)
            return state is not None and state.gone

    def verdict(self, client: bytes, patience: float, now: float) -> str:
        """ "ok"; "paused" (it has replies waiting: its generations wait for it to read); "gone" (its connection
        closed); "silent" (a heartbeating client unheard for ``patience``); "not_reading" (replies waiting and none
        read for ``patience``)."""
        with self._lock:
            state = self._clients.get(client)
            if state is None:
                return "ok"
            if state.gone:
                return "gone"
            if state.heartbeats and now - state.heard > patience:
                return "silent"
            if state.backlog:
                return "not_reading" if now - state.last_read > patience else "paused"
            return "ok"
