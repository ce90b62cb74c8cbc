"""What the sync and asyncio clients share, without any I/O: request ids, encoding, reading replies, and the
rules that turn silence into an error.

Both clients keep their own sockets and waiting (a lock and deques, or asyncio queues); everything they must
decide alike lives here, so they cannot drift apart:
- a request's frame is refused here when the daemon would drop it for its size (framing.encode_request);
- a reply frame that cannot be decoded is counted and logged, never silently dropped;
- a request is lost to a restart when the old daemon spoke after it was sent (restarts.RestartWatch);
- once heartbeats flow, a daemon silent for DAEMON_SILENCE_S has died or is restarting;
- requests that are safe to send twice are resent, a bounded number of times, after RESEND_PAUSE_S.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from kvpool import protocol as p

from .address import ipc_path
from .errors import DaemonUnavailable, RequestTimeout
from .framing import encode_request
from .restarts import RestartWatch

log = logging.getLogger("kvpool.client")

HEARTBEAT_S = 0.25  # the daemon stops the generations of a client it has not heard from for a second
DAEMON_SILENCE_S = 3.0  # no reply, not even to heartbeats, for this long: the daemon died or is restarting
RETRIES = 3  # resends of a request that is safe to repeat, after the daemon fell silent
RESEND_PAUSE_S = HEARTBEAT_S  # before a resend: time for ZeroMQ to reconnect to a restarted daemon


def check_socket_exists(address: str) -> None:
    """An ipc:// address whose socket file is missing has no daemon: say so before waiting for one."""
    path: Path | None = ipc_path(address)
    if path is not None and not path.exists():
        raise DaemonUnavailable(
            f"No kvpoold is listening at {address} (the socket file does not exist); "
            "start it with `kvpoold` or set KVPOOL_ADDRESS."
        )


def hello(name: str, multiplexer: bool = False) -> p.Hello:
    return p.Hello(version=p.PROTOCOL_VERSION, client=name, heartbeat=True, multiplexer=multiplexer)


def no_answer(address: str, connect_timeout: float) -> DaemonUnavailable:
    return DaemonUnavailable(f"No kvpoold answered at {address} within {connect_timeout:g} s; is it running?")


def attempts_for(message: p.Request) -> int:
    """How many times a request may be sent: once for those that must not happen twice (a hello, opening a
    session), else up to RETRIES more after the daemon restarted under it."""
    return 1 if isinstance(message, p.Hello | p.OpenSession | p.Migrate) else RETRIES + 1


class ClientCore:
    def __init__(self, address: str):
        self.address = address
        self.watch = RestartWatch()
        self.max_frame = 0  # the daemon's max_message_bytes, from its hello
        self.heartbeat_on = False  # silence means death only once pings are flowing
        self.undecodable_frames = 0
        self._ids = itertools.count(1)
        self._sent_at: dict[int, float] = {}  # when each outstanding request was sent

    def prepare(self, message: p.Request) -> tuple[int, bytes]:
        """Give the request its id and encode it (BadRequest when it is too large for the daemon)."""
        request_id = next(self._ids)
        message.id = request_id
        frame = encode_request(message, self.max_frame)
        self._sent_at[request_id] = time.monotonic()
        return request_id, frame

    def done(self, request_id: int) -> None:
        self._sent_at.pop(request_id, None)

    def outstanding(self) -> bool:
        return bool(self._sent_at)

    def read(self, frame: bytes) -> p.AnyReply | None:
        """The reply in ``frame``; None (counted and logged) when it cannot be decoded."""
        try:
            reply = p.decode_reply(frame)
        except Exception as exc:  # one unreadable frame must not silence every later reply
            self.undecodable_frames += 1
            log.warning("dropped a reply from %s that could not be decoded (%s)", self.address, exc)
            return None
        self.watch.heard(reply, time.monotonic())
        return reply

    def check(self, request_id: int, started: float, deadline: float) -> float:
        """Raise when waiting for ``request_id`` is pointless; else the seconds left before its deadline."""
        now = time.monotonic()
        if self.watch.lost(self._sent_at.get(request_id, started)):
            raise DaemonUnavailable(
                f"kvpoold at {self.address} restarted while this request was in flight; resume the session "
                "and send the turn again (Session.history() tells whether it was kept)."
            )
        if self.heartbeat_on and now - max(self.watch.last_heard, started) > DAEMON_SILENCE_S:
            raise DaemonUnavailable(
                f"kvpoold at {self.address} stopped answering heartbeats (it died or is restarting); "
                "resume the session and send the turn again (Session.history() tells whether it was kept)."
            )
        if now >= deadline:
            raise RequestTimeout(
                f"kvpoold at {self.address} did not answer within the timeout; it may "
                "be overloaded or hung (see `kvpool status`)."
            )
        return deadline - now
