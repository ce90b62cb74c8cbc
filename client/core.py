"""What the sync and asyncio clients share, without any I/O: request ids, encoding, reading replies, and the
rules that turn silence into an error.

Both clients keep their own sockets and waiting (a lock and deques, or asyncio queues); everything they must
decide alike lives here, so they cannot drift apart:
- a request's frame is refused here when the daemon would drop it for its size (framing.encode_request);
- a reply frame that cannot be decoded is counted and logged, never silently dropped;
- a request is lost to a restart when the old daemon spoke after it was sent (restarts.RestartWatch);
- a request goes out only over a connection to a daemon (the socket's handshake and disconnect events): with none
  for ``reconnect_wait`` seconds the daemon is down, and the request was never sent, so no daemon runs it later;
- a connection lost while a reply is awaited means the daemon stopped or died: the request is lost with it;
- once heartbeats flow, a daemon silent for DAEMON_SILENCE_S has died or hung, counted only while this process
  runs: a client process that was not scheduled (stopped, or starved by other work) does not blame the daemon for
  the time it did not look;
- requests that are safe to send twice are resent, a bounded number of times, after RESEND_PAUSE_S.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from pathlib import Path

from kvpool import protocol as p

from .address import ipc_path
from .errors import BadRequest, DaemonUnavailable, NotConnected, RequestTimeout
from .framing import encode_request
from .restarts import RestartWatch

log = logging.getLogger("kvpool.client")

HEARTBEAT_S = 0.25  # pings while replies are awaited; the daemon waits client_patience (10 s) before giving up
DAEMON_SILENCE_S = 3.0  # no reply, not even to heartbeats, for this long: the daemon died or hung
RECONNECT_WAIT_S = 10.0  # how long a request waits for a connection to the daemon (a restart takes a few seconds)
DISCONNECT_GRACE_S = 0.5  # a connection gone this long while a reply is awaited: the daemon stopped or died
PAUSE_GAP_S = 1.0  # waits look at least every HEARTBEAT_S; a longer gap means this process was not running
RETRIES = 3  # resends of a request that is safe to repeat, after the daemon fell silent
RESEND_PAUSE_S = HEARTBEAT_S  # before a resend: time for ZeroMQ to reconnect to a restarted daemon


def check_before_connecting(address: str, *waits: float) -> None:
    """An address that is not ipc:// or tcp://, or a wait that is not a positive number of seconds (a NaN one
    would never end), is BadRequest; an ipc:// address whose socket file is missing has no daemon: say so before
    waiting for one."""
    if not address.startswith(("ipc://", "tcp://")):
        raise BadRequest(f"The address {address!r} is ipc://PATH or tcp://HOST:PORT.")
    if not all(math.isfinite(wait) and wait > 0 for wait in waits):
        raise BadRequest(f"Waits are positive numbers of seconds, not {', '.join(map(str, waits))}.")
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


CONNECTION_EVENTS = 0x1000 | 0x0200  # ZeroMQ's EVENT_HANDSHAKE_SUCCEEDED | EVENT_DISCONNECTED


def connection_up(event: int) -> bool:
    """After this socket event, a connection to the daemon exists (a handshake succeeded) or not (it closed)."""
    return event == 0x1000


def not_connected(address: str, waited: float) -> NotConnected:
    return NotConnected(
        f"No kvpoold is connected at {address}: none answered the connection within {waited:g} s (it is stopped, "
        "restarting or crashed); the request was not sent. Retry once it runs (`kvpool health`)."
    )


def attempts_for(message: p.Request) -> int:
    """How many times a request may be sent: once for those that must not happen twice (a hello, opening a
    session), else up to RETRIES more after the daemon restarted under it."""
    return 1 if isinstance(message, p.Hello | p.OpenSession | p.Migrate) else RETRIES + 1


# What to do about a request a daemon that went did not answer: a turn may or may not have been kept.
AGAIN = "send the request again; for a turn, resume the session first (Session.history() tells whether it was kept)."


class ClientCore:
    def __init__(self, address: str):
        self.address = address
        self.watch = RestartWatch()
        self.max_frame = 0  # the daemon's max_message_bytes, from its hello
        self.heartbeat_on = False  # silence means death only once pings are flowing
        self.undecodable_frames = 0
        self._ids = itertools.count(1)
        self._sent_at: dict[int, float] = {}  # when each outstanding request was sent
        self._last_look = time.monotonic()  # when a wait last looked at its request
        self._resumed_at = 0.0  # when this process ran again after a gap (stopped, or starved of CPU)
        self.connected = False  # a connection to a daemon exists now (the socket's events, connection_event)
        self._connections = 0  # connections made so far: a request sent on an earlier one went with it
        self._sent_on: dict[int, int] = {}  # the connection each outstanding request was sent on
        self._disconnected_at: float | None = None  # since when no connection to the daemon exists

    def prepare(self, message: p.Request) -> tuple[int, bytes]:
        """Give the request its id and encode it (BadRequest when it is too large for the daemon)."""
        request_id = next(self._ids)
        message.id = request_id
        frame = encode_request(message, self.max_frame)
        self._sent_at[request_id] = time.monotonic()
        self._sent_on[request_id] = self._connections
        return request_id, frame

    def sent_now(self, request_id: int) -> None:
        """A request whose send waited for a connection went out now, on the current one."""
        self._sent_at[request_id] = time.monotonic()
        self._sent_on[request_id] = self._connections

    def connection_event(self, event: int) -> None:
        """The socket's event (CONNECTION_EVENTS): a connection to a daemon was made, or closed."""
        self.connected = connection_up(event)
        if self.connected:
            self._connections += 1

    @property
    def connection(self) -> int:
        """Which connection to a daemon this is (each one made counts): what the daemon gave on an earlier one (a
        frame area) went with it."""
        return self._connections

    def done(self, request_id: int) -> None:
        self._sent_at.pop(request_id, None)
        self._sent_on.pop(request_id, None)

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
        """Raise when waiting for ``request_id`` is pointless; else the seconds left before its deadline. Call it
        only when no reply to it is waiting to be read: replies that came are read before any verdict."""
        now = time.monotonic()
        if now - self._last_look > PAUSE_GAP_S:
            self._resumed_at = now  # the silence while this process did not run is not the daemon's
        self._last_look = now
        if self.connected:
            self._disconnected_at = None
        elif self._disconnected_at is None:
            self._disconnected_at = now
        if self._sent_on.get(request_id, self._connections) < self._connections:
            # Sent on a connection that has closed since (a daemon stopping, then one starting): whatever it did not
            # answer before it went, nobody will.
            raise DaemonUnavailable(
                f"The kvpoold at {self.address} that had this request went away before answering it (a new "
                f"connection was made since); {AGAIN}"
            )
        if self.watch.lost(self._sent_at.get(request_id, started)):
            raise DaemonUnavailable(f"kvpoold at {self.address} restarted while this request was in flight; {AGAIN}")
        since = max(started, self._resumed_at)
        if self._disconnected_at is not None and now - max(self._disconnected_at, since) > DISCONNECT_GRACE_S:
            raise DaemonUnavailable(
                f"The connection to kvpoold at {self.address} closed while this request was in flight (it stopped "
                f"or died); once it is back, {AGAIN}"
            )
        if self.heartbeat_on and now - max(self.watch.last_heard, since) > DAEMON_SILENCE_S:
            raise DaemonUnavailable(
                f"kvpoold at {self.address} stopped answering heartbeats (it died or hung); {AGAIN}"
            )
        if now >= deadline:
            raise RequestTimeout(
                f"kvpoold at {self.address} did not answer within the timeout; it may "
                "be overloaded or hung (see `kvpool status`)."
            )
        return deadline - now
