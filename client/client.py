"""The synchronous client: one DEALER socket to kvpoold, sessions, streamed generations.

A Client may be shared by threads: every use of its socket happens under one lock, and replies are sorted
into per-request queues by request id, so each thread finds its own. ``Session.cancel()`` is meant to be
called from another thread while a generation streams. Every wait is bounded by a timeout.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool import protocol as p
from kvpool.protocol.status import DaemonStatus

from . import core
from .address import default_address
from .core import HEARTBEAT_S, RECONNECT_WAIT_S, ClientCore
from .errors import BadRequest, DaemonUnavailable, KvpoolError, RequestTimeout, closes_after
from .media import AREA_BYTES, FrameArea, Part, Placing, is_parts, wire_parts
from .results import (
    Collector,
    Completion,
    WirePart,
    check_migration_target,
    expect,
    generate_request,
    left_for_the_remote_tier,
    open_request,
    raise_if_error,
)

POLL_SLICE_MS = 10  # the lock is released between poll slices so other threads can send and receive


class Client:
    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        reconnect_wait: float = RECONNECT_WAIT_S,
        name: str = "",
        curve: tuple[bytes, bytes, bytes] | None = None,
        multiplexer: bool = False,
    ):
        """Connect to kvpoold at ``address`` (None: $KVPOOL_ADDRESS, else the daemon's default address).
        ``reconnect_wait``: how long a request waits for a connection to the daemon (one restarting) before
        NotConnected. ``curve``: (daemon public key, client public key, client secret key) for a tcp:// daemon.
        ``multiplexer``: this connection serves many users (a gateway): the daemon lets it have more generations
        in flight (``max_inflight`` says how many)."""
        self.address = address or default_address()
        self.timeout = timeout
        self.reconnect_wait = min(reconnect_wait, connect_timeout)
        core.check_before_connecting(self.address, timeout, connect_timeout, reconnect_wait)
        self._core = ClientCore(self.address)
        self._context = zmq.Context.instance()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Whether a connection to a daemon exists, from the socket's own events: requests are sent only over one.
        # (ZeroMQ's IMMEDIATE would do that too, but it drops the replies not read yet when the daemon goes, the
        # error that ends a generation at a daemon's stop among them.)
        self._monitor = self._sock.get_monitor_socket(core.CONNECTION_EVENTS)
        if curve is not None:
            self._sock.curve_serverkey, self._sock.curve_publickey, self._sock.curve_secretkey = curve
        self._sock.connect(self.address)
        self._lock = threading.Lock()
        self._inboxes: dict[int, deque[p.AnyReply]] = {}
        self._area: FrameArea | None = None  # media's shared memory (asked for at the first medium)
        self._area_asked = False
        try:
            hello = expect(self._call(core.hello(name, multiplexer), connect_timeout), p.HelloReply)
        except RequestTimeout:
            self.close()
            raise core.no_answer(self.address, connect_timeout) from None
        except BaseException:
            self.close()
            raise
        self.daemon_version = hello.daemon_version
        self.model = hello.model
        self._core.max_frame = hello.max_message_bytes
        self.max_inflight = hello.max_inflight
        self.reconnect_wait = reconnect_wait
        self._closed = threading.Event()
        self._core.heartbeat_on = True
        self._heartbeat = threading.Thread(target=self._beat, name="kvpool-heartbeat", daemon=True)
        self._heartbeat.start()

    # ------------------------------------------------------------------ public API

    def status(self) -> DaemonStatus:
        return expect(self._call(p.Status()), p.StatusReply).status

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        """The model's token ids for ``text`` (``special``: ``<start_of_turn>`` and the like become special
        tokens), e.g. for a prompt rendered from a chat template, sent as token ids."""
        return expect(self._call(p.Tokenize(text=text, add_bos=add_bos, special=special)), p.TokensReply).tokens

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens`` (special tokens render as nothing)."""
        return expect(self._call(p.Detokenize(tokens=list(tokens))), p.TextReply).text

    def sessions(self) -> list[p.SessionInfo]:
        return expect(self._call(p.ListSessions()), p.SessionsReply).sessions

    def open_session(self, task: str = "default", system_prompt: str | list[int] | list[Part] | None = None) -> Session:
        """A new session for ``task``, starting with ``system_prompt`` (text, token ids, or parts with media;
        None: the task's configured one, "" for none). Sessions starting alike share that part's KV in the
        daemon, an image in it included."""
        if is_parts(system_prompt):
            request_id = self._send_parts(lambda parts: open_request(task, parts), system_prompt)  # type: ignore[arg-type]
            try:
                opened = expect(self._next(request_id), p.SessionOpened)
            finally:
                self._done(request_id)
        else:
            opened = expect(self._call(open_request(task, system_prompt)), p.SessionOpened)  # type: ignore[arg-type]
        return Session(self, opened.session, opened.token, opened.task, opened.context_size, opened.context_tokens)

    def resume_session(self, session_id: str, token: str, *, prefetch: bool = False) -> Session:
        """Take back a session opened earlier (by this or another process, before or after a daemon restart; a
        daemon with a remote tier also takes sessions of other nodes). ``prefetch``: also move its KV up the
        tiers now, ahead of its next turn."""
        request = p.ResumeSession(session=session_id, token=token, prefetch=prefetch)
        opened = expect(self._call(request), p.SessionOpened)
        return Session(self, opened.session, opened.token, opened.task, opened.context_size, opened.context_tokens)

    def close(self) -> None:
        closed = getattr(self, "_closed", None)
        if closed is not None:
            closed.set()
            if self._heartbeat is not threading.current_thread():
                self._heartbeat.join(1.0)
        with self._lock:
            if not self._sock.closed:
                self._sock.disable_monitor()
                self._monitor.close(0)
                self._sock.close(0)
            if self._area is not None:
                self._area.close()
                self._area = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _beat(self) -> None:
        """While replies are awaited, tell the daemon this process is alive: if it dies mid-generation, the
        daemon stops the generation instead of finishing it for nobody (after its client_patience)."""
        ping = p.encode(p.Ping(id=0))  # id 0: the pong is dropped, no request waits for it
        while not self._closed.wait(HEARTBEAT_S):
            with self._lock:
                if self._inboxes and not self._sock.closed and self._watch_connection():
                    with contextlib.suppress(zmq.Again):
                        self._sock.send(ping, zmq.NOBLOCK)

    def _watch_connection(self, wait_ms: float = 0) -> bool:
        """Whether a connection to the daemon exists, after reading the socket's events (waiting up to ``wait_ms``
        for one). Call it holding the lock."""
        while self._monitor.poll(wait_ms):
            self._core.connection_event(recv_monitor_message(self._monitor)["event"])
            wait_ms = 0
        return self._core.connected

    def _send_parts(self, build: Callable[[list[WirePart]], p.Request], parts: list[Part]) -> int:
        """Send the request ``build`` makes of ``parts``, their media in the frame area (waiting for answers that
        free room in it, within the timeout), or in the message when the daemon gives no area."""
        self._wait_for_connection()  # (an area is the connection's: one given before a restart is gone)
        area = self._frame_area()
        deadline = time.monotonic() + self.timeout
        while True:
            with self._lock:
                placing = area.placing() if area is not None else None
                wired = wire_parts(parts, placing, self._core.max_frame // 2 or AREA_BYTES)
                if wired is None and placing is not None:
                    area.abandon(placing)  # type: ignore[union-attr]
            if wired is not None:
                break
            if time.monotonic() >= deadline:
                raise RequestTimeout(
                    f"The frame area stayed full for {self.timeout:g} s: the daemon has not answered the requests "
                    "whose frames it holds; wait for them, or send fewer frames at once."
                )
            with self._lock:
                self._drain()
                self._sock.poll(POLL_SLICE_MS)
        try:
            return self._send(build(wired), placing)
        except BaseException:
            if area is not None and placing is not None:
                with self._lock:
                    area.abandon(placing)
            raise

    def _wait_for_connection(self) -> None:
        deadline = time.monotonic() + self.reconnect_wait
        while time.monotonic() < deadline:
            with self._lock:
                if self._watch_connection(0 if self._core.connected else POLL_SLICE_MS):
                    return
            time.sleep(0)  # let a thread waiting for the lock in

    def _frame_area(self) -> FrameArea | None:
        """The connection's frame area, asked for once per connection (a restarted daemon, or a new connection,
        gives a new one); None: over tcp://, or the daemon gives none (or none now: media go in the message)."""
        with self._lock:
            if self._area is not None and self._area.connection != self._core.connection and not self._area.busy:
                self._drop_area()
        if self._area is None and not self._area_asked and self.address.startswith("ipc://"):
            self._area_asked = True
            try:
                reply = expect(self._call(p.FrameArea(size=AREA_BYTES)), p.FrameAreaReply)
            except BadRequest:
                return None  # (a daemon without a projector, or one that gives no areas: media go in the message)
            except KvpoolError:
                self._area_asked = False  # (overloaded, or the daemon restarting: ask again next time)
                return None
            with self._lock:
                self._area = FrameArea(reply.name, reply.size, self._core.connection)
        return self._area

    def _drop_area(self) -> None:
        """Forget the frame area (the daemon freed it): the next medium asks for another. Call it holding the lock."""
        if self._area is not None:
            self._area.close()
        self._area, self._area_asked = None, False

    def _send(self, message: p.Request, placing: Placing | None = None) -> int:
        """Send over a connection to the daemon, waiting up to reconnect_wait for one (NotConnected).
        ``placing``: the frame area regions its media took, its until it is answered."""
        with self._lock:
            request_id, frame = self._core.prepare(message)
            self._inboxes[request_id] = deque()
            if placing is not None:
                placing.area.hold(placing, request_id)
        deadline = time.monotonic() + self.reconnect_wait
        while True:
            with self._lock:
                if self._watch_connection(0 if self._core.connected else POLL_SLICE_MS):
                    self._core.sent_now(request_id)
                    self._sock.send(frame)
                    return request_id
            if time.monotonic() >= deadline:
                self._done(request_id)
                raise core.not_connected(self.address, self.reconnect_wait)
            time.sleep(0)  # let a thread waiting for the lock in

    def _next(self, request_id: int, timeout: float | None = None) -> p.AnyReply:
        """The next reply to ``request_id``, receiving (and sorting) whatever arrives meanwhile."""
        started = time.monotonic()
        deadline = started + (self.timeout if timeout is None else timeout)
        while True:
            with self._lock:
                inbox = self._inboxes.get(request_id)
                if inbox is None:
                    raise KvpoolError(f"Request {request_id} is no longer awaited: its stream was closed.")
                if inbox:
                    return inbox.popleft()
                self._drain()  # replies that came are read before any verdict on the daemon
                if inbox:
                    return inbox.popleft()
                self._watch_connection()
                remaining = self._core.check(request_id, started, deadline)
                if self._sock.poll(min(POLL_SLICE_MS, remaining * 1000)):
                    self._drain()
            time.sleep(0)  # let a thread waiting for the lock in

    def _drain(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self._core.read(frame)
            if reply is None:
                continue
            if self._area is not None:
                self._area.answered(reply.id)  # the daemon has read its media by the time it answers
                if isinstance(reply, p.Error) and (reply.detail or {}).get("frame_area") == self._area.name:
                    self._drop_area()  # the daemon freed it (its connection went, or too many were given)
            inbox = self._inboxes.get(reply.id)
            if inbox is not None:  # replies to abandoned requests (after a timeout) are dropped
                inbox.append(reply)

    def _done(self, request_id: int) -> None:
        with self._lock:
            self._inboxes.pop(request_id, None)
            self._core.done(request_id)
            if self._area is not None:
                self._area.answered(request_id)

    def _call(self, message: p.Request, timeout: float | None = None) -> p.AnyReply:
        """One request, one reply. When the daemon stops answering (a restart), requests that can safely be
        sent twice are sent again, a bounded number of times, while ZeroMQ reconnects underneath."""
        attempts = core.attempts_for(message)
        for attempt in range(attempts):
            request_id = self._send(message)
            try:
                return self._next(request_id, timeout)
            except DaemonUnavailable:
                if attempt + 1 == attempts:
                    raise
                time.sleep(core.RESEND_PAUSE_S)  # let ZeroMQ reconnect
            finally:
                self._done(request_id)
        raise AssertionError("unreachable")


class Stream:
    """The chunks of one generation, as they arrive: an iterator (``next(stream)`` reads one chunk, a ``for`` loop
    the rest). The request was sent when ``generate()`` made the stream. ``final`` holds the final message once it
    came (so does the session's ``final``). Closing it early (``close()``, leaving a ``with`` block, or dropping
    it) stops the generation, so the session is free again."""

    def __init__(self, session: Session, request_id: int):
        self._session = session
        self._client = session.client
        self._id = request_id
        # Sends the request again (its media through a new frame area), once, when the daemon refused it because
        # it had taken back the area its media were in (nothing was applied).
        self._resend: Callable[[], int] | None = None
        self._closed = False
        self.final: p.Final | None = None

    @classmethod
    def _with_media(cls, session: Session, send: Callable[[], int]) -> Stream:
        stream = cls(session, send())
        stream._resend = send
        return stream

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> p.Chunk:
        while not self._closed:
            try:
                reply = self._client._next(self._id)
            except DaemonUnavailable:
                self.close(cancel=False)  # the daemon that ran it is gone: nothing to cancel, no retries to wait
                raise
            except BaseException:
                self.close()
                raise
            try:
                raise_if_error(reply)
            except KvpoolError as exc:
                if self._resend is not None and "frame_area" in exc.detail:
                    self._client._done(self._id)
                    self._id, self._resend = self._resend(), None
                    continue
                self.close(cancel=False)  # the daemon ended it with this error: nothing left to cancel
                raise
            self._resend = None  # (begun: nothing is sent twice)
            if isinstance(reply, p.Final):
                self.final = self._session.final = reply
                self.close()
            elif isinstance(reply, p.Chunk):
                return reply
        raise StopIteration

    def close(self, cancel: bool = True) -> None:
        """Stop reading; a generation still running is cancelled."""
        if self._closed:
            return
        self._closed = True
        if self.final is None and cancel:
            with contextlib.suppress(Exception):  # the daemon may be gone; there is nothing left to stop then
                self._session.cancel()
        self._client._done(self._id)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and not self._client._sock.closed:
            self.close()


class Session:
    """A session in the daemon: its context lives there; ``id`` and ``token`` identify and authorise it."""

    def __init__(
        self, client: Client, session_id: str, token: str, task: str, context_size: int, context_tokens: int = 0
    ):
        self.client = client
        self.id = session_id
        self.token = token
        self.task = task
        self.context_size = context_size
        self.context_tokens = context_tokens  # what it held when opened or resumed
        self.final: p.Final | None = None  # the final message of its last generation (finish reason, timings)

    def generate(self, prompt: str | list[int] | list[Part] = "", **params: Any) -> Stream:
        """Append ``prompt`` (text, token ids, or parts: text, Image and Audio, kvpool.client.media) to the session
        and stream the continuation; the request is sent now, the chunks are read from the stream.

        Parameters: max_tokens, temperature (0 = greedy), top_k, top_p, min_p, typical_p, repeat_penalty,
        repeat_last_n, presence_penalty, frequency_penalty, logit_bias ({token id: bias}), seed, stop (list of
        strings), logprobs (top log-probabilities per token), deadline_ms, after; constrained decoding: grammar
        (GBNF) or json_schema (a dict or its JSON text), grammar_trigger_words / grammar_trigger_tokens (a lazy
        grammar), grammar_from (continue a constrained answer), text_from (continue an answer cut short, its text
        joining exactly). docs/client.md has them all.
        """
        if is_parts(prompt):
            build = lambda parts: generate_request(self.id, self.token, parts, params)  # noqa: E731
            return Stream._with_media(self, lambda: self.client._send_parts(build, prompt))  # type: ignore[arg-type]
        request = generate_request(self.id, self.token, prompt, params)  # type: ignore[arg-type]
        return Stream(self, self.client._send(request))

    def complete(self, prompt: str | list[int] | list[Part] = "", **params: Any) -> Completion:
        """Like generate(), but waits for the whole result."""
        stream = self.generate(prompt, **params)
        collector = Collector()
        for chunk in stream:
            collector.add(chunk)
        assert stream.final is not None
        return collector.result(stream.final)

    def cancel(self) -> bool:
        """Stop this session's running generation (safe from any thread); False if none was running."""
        return expect(self.client._call(p.Cancel(session=self.id, token=self.token)), p.Cancelled).cancelled

    def history(self, start: int = 0) -> list[int]:
        """The session's tokens from ``start`` on, as the daemon holds them."""
        return expect(
            self.client._call(p.History(session=self.id, token=self.token, start=start)), p.HistoryReply
        ).tokens

    def prefetch(self) -> str:
        """A hint that this session's next turn is coming: the daemon moves its KV from disk or the remote tier
        into the pool, and into a hot slot when one is free. Returns where its KV is now (hot, pool, disk)."""
        return expect(self.client._call(p.Prefetch(session=self.id, token=self.token)), p.Prefetched).tier

    def migrate(self, to: str | Client, **client_options: Any) -> Session:
        """Hand this session over to the daemon at ``to`` (an address, or a Client): this daemon writes its newest
        checkpoint to the remote tier and lets it go, then the other resumes it (prefetched). Returns the session
        on the new daemon; a Client made here for an address is the caller's to close (``session.client``)."""
        target = to if isinstance(to, Client) else Client(to, **client_options)
        try:
            check_migration_target(target.status(), target.address)  # (before the session leaves here)
            expect(self.client._call(p.Migrate(session=self.id, token=self.token)), p.Migrated)
            try:
                return target.resume_session(self.id, self.token, prefetch=True)
            except KvpoolError as exc:
                raise left_for_the_remote_tier(exc, self.id) from exc
        except BaseException:
            if target is not to:
                target.close()
            raise

    def close(self) -> None:
        expect(self.client._call(p.CloseSession(session=self.id, token=self.token)), p.Closed)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if self.client._sock.closed or not closes_after(exc):
            return
        if exc is None:
            self.close()
            return
        with contextlib.suppress(KvpoolError):  # the error on its way out is the one the caller must see
            self.close()
