"""The engine's intake: requests from the I/O thread, handed to the engine a connection at a time, in turns.

The engine handles requests between its steps. Taking them in arrival order let one connection that sends many
(thousands of status requests, a stream of detokenizes it never reads) hold every other connection's answers, and
every running generation's next step, for as long as it kept sending (and, with none running, the engine's
housekeeping and the watchdog's heartbeat). Here each connection's requests wait in a queue of their own, in their
order; the engine takes one from each connection in turn, and stops after a short slice, leaving the rest for the
next round.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator

from kvpool import protocol as p

# The requests handled between two steps take at most this long (the one that passes it ends first): a step later
# at most by this, whoever sends what.
SLICE_S = 0.01

Item = tuple[bytes, p.AnyRequest, float]  # (client, request, when the I/O thread received it)


class Intake:
    def __init__(self) -> None:
        self._arrived: queue.Queue[Item] = queue.Queue()
        self._waiting: OrderedDict[bytes, deque[Item]] = OrderedDict()  # per connection, in turn order
        self._lock = threading.Lock()
        self._closed = False

    def put(self, client: bytes, request: p.AnyRequest) -> bool:
        """From the I/O thread; False once closed (the I/O thread then answers the request itself)."""
        with self._lock:
            if self._closed:
                return False
            self._arrived.put((client, request, time.monotonic()))
            return True

    def take(self, wait: float) -> Iterator[Item]:
        """The requests to handle now, a connection at a time in turns, for at most SLICE_S: waits up to ``wait``
        seconds for one when none is there."""
        if not self._waiting:
            try:
                self._file(self._arrived.get(timeout=wait) if wait else self._arrived.get_nowait())
            except queue.Empty:
                return
        until = time.monotonic() + SLICE_S
        while True:
            self._read_arrived()
            if not self._waiting:
                return
            client, items = next(iter(self._waiting.items()))
            item = items.popleft()
            if items:
                self._waiting.move_to_end(client)  # its next one after every other connection's
            else:
                del self._waiting[client]
            yield item
            if time.monotonic() >= until:
                return

    def close(self) -> list[Item]:
        """No more requests are taken; those not handled yet, for the caller to answer."""
        with self._lock:
            self._closed = True
        self._read_arrived()
        left = [item for items in self._waiting.values() for item in items]
        self._waiting.clear()
        return left

    def _read_arrived(self) -> None:
        while True:
            try:
                self._file(self._arrived.get_nowait())
            except queue.Empty:
                return

    def _file(self, item: Item) -> None:
        self._waiting.setdefault(item[0], deque()).append(item)
