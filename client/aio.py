"""The asyncio twin of kvpool.client: same sessions and results, awaited instead of blocking.

    async with await AsyncClient.connect() as client:
        async with await client.open_session(task="voice") as s:
            async for chunk in s.generate("Hello", max_tokens=16):
                print(chunk.text, end="")

One reader task receives every reply and hands it to the queue of its request id, so any number of
coroutines can use one client at once. What both clients must decide alike is in core.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvpool import protocol as p
from kvpool.protocol.status import DaemonStatus

from . import core
from .address import default_address
from .core import HEARTBEAT_S, RECONNECT_WAIT_S, ClientCore
from .errors import BadRequest, DaemonUnavailable, KvpoolError, NotConnected, RequestTimeout, closes_after
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


class AsyncClient:
    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = 30.0,
        reconnect_wait: float = RECONNECT_WAIT_S,
        curve: tuple[bytes, bytes, bytes] | None = None,
    ):
        """Not connected yet: use ``await AsyncClient.connect(...)``, which takes the sync Client's arguments."""
        self.address = address or default_address()
        self.timeout = timeout
        self.reconnect_wait = reconnect_wait
        self._context = zmq.asyncio.Context.instance()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Whether a connection to a daemon exists, from the socket's own events (see the sync Client).
        self._monitor = self._sock.get_monitor_socket(core.CONNECTION_EVENTS)
        self._connected = asyncio.Event()
        if curve is not None:
            self._sock.curve_serverkey, self._sock.curve_publickey, self._sock.curve_secretkey = curve
        self._core = ClientCore(self.address)
        self._queues: dict[int, asyncio.Queue[p.AnyReply]] = {}
        self._sends: dict[int, asyncio.Future[Any]] = {}  # sends ZeroMQ could not complete at once
        self._reader: asyncio.Task[None] | None = None
        self._beater: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.daemon_version = ""
        self.model = ""
        self.max_inflight = 0  # generations this connection may have in flight (the daemon's hello says)
        self._area: FrameArea | None = None  # media's shared memory (asked for at the first medium)
        self._area_asked: asyncio.Future[FrameArea | None] | None = None
        self._area_freed = asyncio.Event()

    @classmethod
    async def connect(
        cls,
        address: str | None = None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        reconnect_wait: float = RECONNECT_WAIT_S,
        name: str = "",
        curve: tuple[bytes, bytes, bytes] | None = None,
        multiplexer: bool = False,
    ) -> AsyncClient:
        """Connect and say hello (None: $KVPOOL_ADDRESS, else the daemon's default address). ``curve``: (daemon
        public key, client public key, client secret key) for a tcp:// daemon. ``reconnect_wait`` and
        ``multiplexer``: see Client."""
        address = address or default_address()
        core.check_before_connecting(address, timeout, connect_timeout, reconnect_wait)  # (before a socket is made)
        client = cls(address, timeout=timeout, reconnect_wait=min(reconnect_wait, connect_timeout), curve=curve)
        client._watcher = asyncio.get_running_loop().create_task(client._watch())
        client._sock.connect(client.address)
        client._reader = asyncio.get_running_loop().create_task(client._read())
        try:
            hello = expect(await client._call(core.hello(name, multiplexer), connect_timeout), p.HelloReply)
        except RequestTimeout:
            await client.close()
            raise core.no_answer(client.address, connect_timeout) from None
        except BaseException:
            await client.close()
            raise
        client.daemon_version, client.model = hello.daemon_version, hello.model
        client._core.max_frame = hello.max_message_bytes
        client.max_inflight = hello.max_inflight
        client.reconnect_wait = reconnect_wait
        client._core.heartbeat_on = True
        client._beater = asyncio.get_running_loop().create_task(client._beat())
        return client

    async def status(self) -> DaemonStatus:
        return expect(await self._call(p.Status()), p.StatusReply).status

    async def tokenize(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        """As the sync Client.tokenize()."""
        reply = await self._call(p.Tokenize(text=text, add_bos=add_bos, special=special))
        return expect(reply, p.TokensReply).tokens

    async def detokenize(self, tokens: list[int]) -> str:
        """As the sync Client.detokenize()."""
        return expect(await self._call(p.Detokenize(tokens=list(tokens))), p.TextReply).text

    async def sessions(self) -> list[p.SessionInfo]:
        return expect(await self._call(p.ListSessions()), p.SessionsReply).sessions

    async def open_session(
        self, task: str = "default", system_prompt: str | list[int] | list[Part] | None = None
    ) -> AsyncSession:
        """As the sync Client.open_session(): a system prompt may hold media."""
        if is_parts(system_prompt):
            request_id = await self._send_parts(lambda parts: open_request(task, parts), system_prompt)  # type: ignore[arg-type]
            try:
                opened = expect(await self._next(request_id), p.SessionOpened)
            finally:
                self._done(request_id)
        else:
            opened = expect(await self._call(open_request(task, system_prompt)), p.SessionOpened)  # type: ignore[arg-type]
        return AsyncSession(self, opened.session, opened.token, opened.task, opened.context_size, opened.context_tokens)

    async def resume_session(self, session_id: str, token: str, *, prefetch: bool = False) -> AsyncSession:
        request = p.ResumeSession(session=session_id, token=token, prefetch=prefetch)
        opened = expect(await self._call(request), p.SessionOpened)
        return AsyncSession(self, opened.session, opened.token, opened.task, opened.context_size, opened.context_tokens)

    async def close(self) -> None:
        for sending in self._sends.values():
            sending.cancel()
        self._sends.clear()
        for task in (self._beater, self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._reader = self._beater = self._watcher = None
        if not self._sock.closed:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)
        if self._area is not None:
            self._area.close()
            self._area = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ plumbing

    async def _beat(self) -> None:
        """Heartbeats while replies are awaited (see the sync client)."""
        ping = p.encode(p.Ping(id=0))
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if self._queues and not self._sock.closed and self._connected.is_set():
                with contextlib.suppress(zmq.Again):
                    await self._sock.send(ping, zmq.NOBLOCK)

    async def _watch(self) -> None:
        """Follow the socket's events: whether a connection to the daemon exists."""
        while True:
            self._core.connection_event(parse_monitor_message(await self._monitor.recv_multipart())["event"])
            if self._core.connected:
                self._connected.set()
            else:
                self._connected.clear()

    async def _read(self) -> None:
        while True:
            reply = self._core.read(await self._sock.recv())
            if reply is None:
                continue
            if self._area is not None and self._area.busy:
                self._area.answered(reply.id)  # the daemon has read its media by the time it answers
                self._area_freed.set()
                if isinstance(reply, p.Error) and (reply.detail or {}).get("frame_area") == self._area.name:
                    self._drop_area()  # the daemon freed it (its connection went, or too many were given)
            queue = self._queues.get(reply.id)
            if queue is not None:  # replies to abandoned requests are dropped
                queue.put_nowait(reply)

    async def _send_parts(self, build: Callable[[list[WirePart]], p.Request], parts: list[Part]) -> int:
        """As the sync client: the media in the frame area (waiting for answers that free room in it), or in the
        message when the daemon gives no area."""
        if not self._connected.is_set():  # (an area is the connection's: one given before a restart is gone)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.reconnect_wait):
                    await self._connected.wait()
        area = await self._frame_area()
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    placing = area.placing() if area is not None else None
                    wired = wire_parts(parts, placing, self._core.max_frame // 2 or AREA_BYTES)
                    if wired is not None:
                        break
                    assert area is not None and placing is not None
                    area.abandon(placing)
                    self._area_freed.clear()
                    await self._area_freed.wait()
        except TimeoutError:
            raise RequestTimeout(
                f"The frame area stayed full for {self.timeout:g} s: the daemon has not answered the requests whose "
                "frames it holds; wait for them, or send fewer frames at once."
            ) from None
        try:
            return self._send(build(wired), placing)
        except BaseException:
            if area is not None and placing is not None:
                area.abandon(placing)
            raise

    async def _frame_area(self) -> FrameArea | None:
        """As the sync client: asked for once per connection."""
        if self._area is not None and self._area.connection != self._core.connection and not self._area.busy:
            self._drop_area()
        if self._area_asked is None:
            self._area_asked = asyncio.ensure_future(self._ask_frame_area())
        return await asyncio.shield(self._area_asked)

    async def _ask_frame_area(self) -> FrameArea | None:
        if not self.address.startswith("ipc://"):
            return None
        try:
            reply = expect(await self._call(p.FrameArea(size=AREA_BYTES)), p.FrameAreaReply)
        except BadRequest:
            return None  # (a daemon without a projector, or one that gives no areas: media go in the message)
        except KvpoolError:
            self._area_asked = None  # (overloaded, or the daemon restarting: ask again next time)
            return None
        self._area = FrameArea(reply.name, reply.size, self._core.connection)
        return self._area

    def _drop_area(self) -> None:
        """Forget the frame area (the daemon freed it): the next medium asks for another."""
        if self._area is not None:
            self._area.close()
        self._area, self._area_asked = None, None

    def _send(self, message: p.Request, placing: Placing | None = None) -> int:
        """Send now, as the sync client does (called on the event loop's thread), over a connection to the daemon;
        with none, the send waits on the loop and the first wait for its reply awaits it, for reconnect_wait at most
        (then it is not sent at all)."""
        request_id, frame = self._core.prepare(message)
        self._queues[request_id] = asyncio.Queue()
        if placing is not None:
            placing.area.hold(placing, request_id)
        if self._connected.is_set():
            sent = self._sock.send(frame)
        else:
            sent = asyncio.ensure_future(self._send_when_connected(request_id, frame))
        if sent.done():
            sent.result()  # a send that failed at once raises here
        else:
            self._sends[request_id] = sent  # type: ignore[assignment]
        return request_id

    async def _send_when_connected(self, request_id: int, frame: bytes) -> None:
        await self._connected.wait()
        self._core.sent_now(request_id)
        await self._sock.send(frame)

    async def _next(self, request_id: int, timeout: float | None = None) -> p.AnyReply:
        started = time.monotonic()
        deadline = started + (self.timeout if timeout is None else timeout)
        queue = self._queues.get(request_id)
        if queue is None:
            raise KvpoolError(f"Request {request_id} is no longer awaited: its stream was closed.")
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns a reply that arrives together with a
        # cancellation and drops the cancellation, so a cancelled reader of a fast stream could read on.
        if (sending := self._sends.pop(request_id, None)) is not None:
            try:
                async with asyncio.timeout(max(0.0, min(deadline - started, self.reconnect_wait))):
                    await sending
            except TimeoutError:  # the send was cancelled with its wait: no daemon will ever see it
                raise core.not_connected(self.address, self.reconnect_wait) from None
        while True:
            if not queue.empty():  # replies that came are read before any verdict on the daemon's silence
                return queue.get_nowait()
            remaining = self._core.check(request_id, started, deadline)
            try:
                async with asyncio.timeout(min(remaining, HEARTBEAT_S)):
                    return await queue.get()
            except TimeoutError:
                continue

    def _done(self, request_id: int) -> None:
        self._queues.pop(request_id, None)
        if self._area is not None and self._area.busy:
            self._area.answered(request_id)
            self._area_freed.set()
        if (sending := self._sends.pop(request_id, None)) is not None:
            sending.cancel()  # not sent yet (no connection): it never will be
        self._core.done(request_id)

    async def _call(self, message: p.Request, timeout: float | None = None) -> p.AnyReply:
        """As the sync client: requests that are safe to repeat are resent (a bounded number of times) when the
        daemon restarted under them."""
        attempts = core.attempts_for(message)
        for attempt in range(attempts):
            request_id = self._send(message)
            try:
                return await self._next(request_id, timeout)
            except NotConnected:
                raise  # never sent: a resend would only wait again
            except DaemonUnavailable:
                if attempt + 1 == attempts:
                    raise
                await asyncio.sleep(core.RESEND_PAUSE_S)  # let ZeroMQ reconnect
            finally:
                self._done(request_id)
        raise AssertionError("unreachable")


class AsyncStream:
    """The chunks of one generation, as they arrive: an async iterator (``await anext(stream)`` reads one chunk,
    ``async for`` the rest). The request was sent when ``generate()`` made the stream. ``final`` holds the final
    message once it came (so does the session's ``final``); ``aclose()`` (or leaving an ``async with`` block)
    early cancels the generation."""

    def __init__(self, session: AsyncSession, request_id: int):
        self._session = session
        self._client = session.client
        self._id = request_id
        self._sending: asyncio.Future[int] | None = None  # a send under way (media: their frame area first)
        # Sends the request again, once, when the daemon took back the frame area of its media (see Stream).
        self._resend: Callable[[], Awaitable[int]] | None = None
        self._closed = False
        self.final: p.Final | None = None

    @classmethod
    def _sent_later(cls, session: AsyncSession, send: Callable[[], Awaitable[int]]) -> AsyncStream:
        """The stream of a request whose send is under way: the first read waits for it."""
        stream = cls(session, -1)
        stream._sending = asyncio.ensure_future(send())
        stream._resend = send
        return stream

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> p.Chunk:
        if self._sending is not None:
            try:
                self._id = await self._sending
            except BaseException:
                self._closed = True
                raise
            finally:
                self._sending = None
        while not self._closed:
            try:
                reply = await self._client._next(self._id)
            except DaemonUnavailable:
                await self.aclose(cancel=False)  # the daemon that ran it is gone: nothing to cancel
                raise
            except BaseException:
                await self.aclose()
                raise
            try:
                raise_if_error(reply)
            except KvpoolError as exc:
                if self._resend is not None and "frame_area" in exc.detail:
                    self._client._done(self._id)
                    self._id, self._resend = await self._resend(), None
                    continue
                await self.aclose(cancel=False)  # the daemon ended it with this error: nothing left to cancel
                raise
            self._resend = None  # (begun: nothing is sent twice)
            if isinstance(reply, p.Final):
                self.final = self._session.final = reply
                await self.aclose()
            elif isinstance(reply, p.Chunk):
                return reply
        raise StopAsyncIteration

    async def aclose(self, cancel: bool = True) -> None:
        """Stop reading; a generation still running is cancelled."""
        if self._closed:
            return
        self._closed = True
        if self._sending is not None:  # never read: its send may still be under way
            self._sending.cancel()
            with contextlib.suppress(BaseException):
                self._id = await self._sending
            self._sending = None
            if self._id < 0:
                return
        self._client._done(self._id)
        if self.final is None and cancel:
            with contextlib.suppress(Exception):  # the daemon may be gone; there is nothing left to stop then
                await self._session.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Dropped unfinished (a `break` out of `async for`): cancel on the loop it ran on, as an async generator's
        # finaliser would.
        if getattr(self, "_closed", True) or self.final is not None:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the client is gone with it
            asyncio.get_running_loop().create_task(self.aclose())


class AsyncSession:
    def __init__(
        self, client: AsyncClient, session_id: str, token: str, task: str, context_size: int, context_tokens: int = 0
    ):
        self.client = client
        self.id = session_id
        self.token = token
        self.task = task
        self.context_size = context_size
        self.context_tokens = context_tokens  # what it held when opened or resumed
        self.final: p.Final | None = None  # the final message of the last generation

    def generate(self, prompt: str | list[int] | list[Part] = "", **params: Any) -> AsyncStream:
        """Append ``prompt`` to the session and stream the continuation; the request is sent now (call it on the
        event loop's thread; a prompt with media is sent once its frames are in the frame area). Same parameters
        as the sync Session.generate()."""
        if is_parts(prompt):
            build = lambda parts: generate_request(self.id, self.token, parts, params)  # noqa: E731
            return AsyncStream._sent_later(self, lambda: self.client._send_parts(build, prompt))  # type: ignore[arg-type]
        request = generate_request(self.id, self.token, prompt, params)  # type: ignore[arg-type]
        return AsyncStream(self, self.client._send(request))

    async def complete(self, prompt: str | list[int] | list[Part] = "", **params: Any) -> Completion:
        collector = Collector()
        stream = self.generate(prompt, **params)
        async for chunk in stream:
            collector.add(chunk)
        assert stream.final is not None
        return collector.result(stream.final)

    async def history(self, start: int = 0) -> list[int]:
        reply = await self.client._call(p.History(session=self.id, token=self.token, start=start))
        return expect(reply, p.HistoryReply).tokens

    async def cancel(self) -> bool:
        reply = await self.client._call(p.Cancel(session=self.id, token=self.token))
        return expect(reply, p.Cancelled).cancelled

    async def prefetch(self) -> str:
        """See Session.prefetch: move the session's KV up the tiers ahead of its next turn."""
        return expect(await self.client._call(p.Prefetch(session=self.id, token=self.token)), p.Prefetched).tier

    async def migrate(self, to: str | AsyncClient, **client_options: Any) -> AsyncSession:
        """See Session.migrate: hand the session over to the daemon at ``to`` (an address, or an AsyncClient); a
        client connected here for an address is the caller's to close (``session.client``)."""
        target = to if isinstance(to, AsyncClient) else await AsyncClient.connect(to, **client_options)
        try:
            check_migration_target(await target.status(), target.address)  # (before the session leaves here)
            expect(await self.client._call(p.Migrate(session=self.id, token=self.token)), p.Migrated)
            try:
                return await target.resume_session(self.id, self.token, prefetch=True)
            except KvpoolError as exc:
                raise left_for_the_remote_tier(exc, self.id) from exc
        except BaseException:
            if target is not to:
                await target.close()
            raise

    async def close(self) -> None:
        expect(await self.client._call(p.CloseSession(session=self.id, token=self.token)), p.Closed)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if self.client._sock.closed or not closes_after(exc):
            return
        if exc is None:
            await self.close()
            return
        with contextlib.suppress(KvpoolError):  # the error on its way out is the one the caller must see
            await self.close()
