"""The daemon's ZeroMQ side: a ROUTER socket served by its own I/O thread.

The I/O thread receives frames, decodes them (answering malformed ones itself) and queues requests for the
engine. The engine never touches the ROUTER socket (ZeroMQ sockets are not thread-safe): it pushes replies
into an inproc PUSH socket that the I/O thread drains into the ROUTER. ctypes releases the GIL during
llama_decode, so frames keep moving while the model runs. What the I/O thread learns of each client's connection
(heard from, reading, gone) is in liveness.py.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvpool import protocol as p
from kvpool.client.address import ipc_path
from kvpool.daemon.serve.liveness import Liveness
from kvpool.protocol import ErrorCode

log = logging.getLogger("kvpool.server")

OUTBOX = "inproc://kvpool-outbox"
MAX_MESSAGE_BYTES = 4 << 20  # a larger frame is dropped by ZeroMQ (prompts are capped at 1 MiB of text)
POLL_MS = 100
INSTANCE = f"{os.getpid()}-{time.time_ns()}"  # this daemon process, as clients see it
SEND_QUEUE = 1024  # messages ZeroMQ queues for one client; beyond, its replies wait in its backlog (liveness.py)
MAX_BACKLOG_BYTES = 16 << 20  # a client's backlog beyond ZeroMQ's queue; its generations pause long before this
BACKLOG_POLL_MS = 5  # how often a backlog is offered to ZeroMQ again while one exists
SHUTDOWN_DRAIN_S = 2.0  # at a stop, how long replies still waiting for slow readers may take to go out


class AddressUnavailable(Exception):
    """The address cannot be served: another daemon holds it, or it is not an address kvpoold supports."""


class Server:
    def __init__(
        self,
        address: str,
        socket_dir_mode: int = 0o700,
        client_gid: int | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ):
        self.address = address
        # With a client group, members may enter the directory and connect; nobody else may.
        self.socket_dir_mode = 0o750 if client_gid is not None else socket_dir_mode
        self.client_gid = client_gid
        self.max_message_bytes = max_message_bytes
        self.context = zmq.Context()
        self.frame_errors: Counter[str] = Counter()  # frames refused before they reached the engine
        self.received_bytes = 0  # of request frames (their payloads): what crossed the socket towards the daemon
        self.liveness = Liveness(MAX_BACKLOG_BYTES)  # written here, read by the engine thread
        self._router: zmq.Socket | None = None
        self._outbox_in: zmq.Socket | None = None
        self._sender_local = threading.local()
        self._auth: ThreadAuthenticator | None = None
        self._lock_file: int | None = None

    # ------------------------------------------------------------------ setup

    def bind(self, curve_secret_file: str = "", curve_clients_dir: str = "") -> None:
        """Take the address: lock it against a second daemon, then bind the ROUTER (on the main thread).
        ``tcp://`` is served only with CURVE: the daemon's secret key and a directory of allowed client keys."""
        path = ipc_path(self.address)
        if path is not None:
            self._lock(path)  # first: an open socket would keep close() from terminating the context
        router = self.context.socket(zmq.ROUTER)
        if path is None:
            if not (self.address.startswith("tcp://") and curve_secret_file and curve_clients_dir):
                router.close(0)
                raise AddressUnavailable(
                    f"{self.address}: kvpoold serves ipc:// addresses, and tcp:// only with CURVE keys "
                    "(set curve_secret_file and curve_clients_dir)."
                )
            self._enable_curve(router, curve_secret_file, curve_clients_dir)
        router.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        # Slow readers: each client may have SEND_QUEUE messages waiting in ZeroMQ; beyond that the send fails at
        # once (ROUTER_MANDATORY) instead of blocking every other client, the reply waits in the client's backlog
        # and the engine pauses its generations until it reads. Sends to a client that is gone fail with
        # EHOSTUNREACH: its generations stop at once.
        router.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.LINGER, 1000)
        try:
            router.bind(self.address)
        except zmq.ZMQError as exc:
            router.close(0)
            raise AddressUnavailable(f"Cannot bind {self.address}: {exc}.") from None
        # The socket file follows its directory: a group that may enter the directory may also connect.
        if path is not None:
            if self.client_gid is not None:
                os.chown(path, -1, self.client_gid)
            os.chmod(path, 0o660 if self.socket_dir_mode & 0o050 else 0o600)
        outbox = self.context.socket(zmq.PULL)
        outbox.bind(OUTBOX)
        self._router, self._outbox_in = router, outbox

    def _enable_curve(self, router: zmq.Socket, secret_file: str, clients_dir: str) -> None:
        """CURVE encryption, and a ZAP authenticator that lets in only the public keys in ``clients_dir``."""
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as exc:
            router.close(0)
            raise AddressUnavailable(f"Cannot read the CURVE key {secret_file}: {exc}.") from None
        if secret is None or not Path(clients_dir).is_dir():
            router.close(0)
            raise AddressUnavailable(f"{secret_file} holds no secret key, or {clients_dir} is not a directory.")
        self._auth = ThreadAuthenticator(self.context)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=clients_dir)
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = public, secret

    def _lock(self, path: Path) -> None:
        # ZeroMQ silently replaces an existing ipc socket file, so a second daemon would steal the address;
        # an flock on a file next to it (released by the kernel when the holder dies) prevents that.
        if not path.parent.exists():
            path.parent.mkdir(parents=True, mode=self.socket_dir_mode)
            os.chmod(path.parent, self.socket_dir_mode)  # mkdir's mode is filtered by the umask
        if self.client_gid is not None:
            os.chown(path.parent, -1, self.client_gid)
            os.chmod(path.parent, self.socket_dir_mode)
        lock_path = path.with_name(path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AddressUnavailable(
                f"Another kvpoold (pid {holder}) is already serving {self.address}; stop it first or pass "
                "a different --address."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_file = fd

    # ------------------------------------------------------------------ engine side

    def send(self, client: bytes, reply: p.Reply) -> None:
        """Queue a reply for a client; callable from the engine thread (each thread gets its own PUSH)."""
        sock = getattr(self._sender_local, "sock", None)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(OUTBOX)
            self._sender_local.sock = sock
        reply.instance = INSTANCE
        sock.send_multipart([client, p.encode(reply)])  # small frames: copying is cheaper than zero-copy tracking

    def close_sender(self) -> None:
        """Close the calling thread's PUSH socket (the engine thread calls this as it exits)."""
        sock = getattr(self._sender_local, "sock", None)
        if sock is not None:
            sock.close()
            self._sender_local.sock = None

    # ------------------------------------------------------------------ I/O thread

    def serve(self, submit: Callable[[bytes, p.AnyRequest], bool], engine_done: threading.Event) -> None:
        """Thread target: move frames until the engine has exited, then flush what it sent."""
        router, outbox = self._router, self._outbox_in
        assert router is not None and outbox is not None, "bind() first"
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        next_forget = time.monotonic() + 10.0
        while not engine_done.is_set():
            backlog = self._offer_backlogs()
            events = dict(poller.poll(BACKLOG_POLL_MS if backlog else POLL_MS))
            if outbox in events:
                self._forward_replies()
            if router in events:
                self._receive(submit)
            if time.monotonic() > next_forget:
                self.liveness.forget_old()
                next_forget = time.monotonic() + 10.0
        # The engine has exited: its PUSH socket flushed on close, so everything it sent is here. Replies waiting
        # for slow readers (the errors that end their generations among them) get a bounded time to go out.
        self._forward_replies()
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S
        while self._offer_backlogs() and time.monotonic() < deadline:
            if router.poll(BACKLOG_POLL_MS):
                self._receive(lambda client, request: False)
        while router.poll(0):  # whoever is still asking learns that the daemon is going away
            self._receive(lambda client, request: False)

    @property
    def dropped_replies(self) -> int:
        return self.liveness.dropped_replies

    def _forward_replies(self) -> None:
        outbox = self._outbox_in
        for _ in range(10_000):  # bounded so inbound frames are not starved by a burst of chunks
            try:
                frames = outbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._deliver(frames)

    def _deliver(self, frames: list[bytes]) -> None:
        """Send one reply without ever blocking; behind the client's backlog when it has one, so replies keep
        their order."""
        client = frames[0]
        if self.liveness.has_backlog(client):
            self.liveness.defer(frames)
            return
        outcome = self._try_send(frames)
        if outcome == "sent":
            self.liveness.sent(client)
        elif outcome == "full":
            log.info("a client is not reading (%d replies queued): keeping its replies, pausing it", SEND_QUEUE)
            self.liveness.defer(frames)

    def _offer_backlogs(self) -> bool:
        """Hand waiting replies to ZeroMQ as far as each client's queue takes them; True while any still wait."""
        waiting = False
        for client in self.liveness.backlogged():
            while (frames := self.liveness.next_deferred(client)) is not None:
                outcome = self._try_send(frames)
                if outcome == "sent":
                    self.liveness.delivered_deferred(client)
                    continue
                waiting = outcome == "full"
                break
        return waiting

    def _try_send(self, frames: list[bytes]) -> str:
        """ "sent", "full" (the client's queue is full: it is not reading now) or "gone" (its connection closed)."""
        assert self._router is not None
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK)
            return "sent"
        except zmq.Again:
            return "full"
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.liveness.went_away(frames[0])  # its process died or closed its socket: nobody left to tell
            return "gone"

    def _receive(self, submit: Callable[[bytes, p.AnyRequest], bool]) -> None:
        for _ in range(1_000):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            client, payload = frames[0], frames[1:]
            self.received_bytes += sum(len(f) for f in payload)
            if len(payload) != 1:
                self._refuse(
                    client,
                    0,
                    ErrorCode.BAD_REQUEST,
                    f"Expected one frame per message, got {len(payload)}; send one msgpack frame.",
                )
                continue
            self.liveness.heard(client)
            try:
                request = p.decode_request(payload[0])
            except p.RequestDecodeError as exc:
                self._refuse(client, exc.request_id, exc.code, exc.message)
                continue
            except Exception:  # the I/O thread must survive any frame: a bug costs one request
                log.exception("could not decode a frame")
                self._refuse(
                    client, 0, ErrorCode.BAD_REQUEST, "The daemon could not read this frame; send a protocol message."
                )
                continue
            if isinstance(request, p.Hello) and request.heartbeat:
                self.liveness.heard(client, heartbeats=True)  # from now on its long silence means something
            if isinstance(request, p.Ping):  # heartbeats never wait behind an engine step
                self._deliver([client, p.encode(p.Pong(id=request.id, instance=INSTANCE))])
                continue
            if not submit(client, request):
                self._refuse(
                    client, request.id, ErrorCode.SHUTTING_DOWN, "The daemon is stopping; retry after it restarts."
                )

    def _refuse(self, client: bytes, request_id: int, code: ErrorCode, message: str) -> None:
        self.frame_errors[code.value] += 1
        self._deliver([client, p.encode(p.Error(id=request_id, code=code, message=message, instance=INSTANCE))])

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        for sock in (self._outbox_in, self._router):
            if sock is not None:
                sock.close()
        self.context.term()
        path = ipc_path(self.address)
        if self._lock_file is not None and path is not None:
            path.unlink(missing_ok=True)
            path.with_name(path.name + ".lock").unlink(missing_ok=True)
            os.close(self._lock_file)
            self._lock_file = None
