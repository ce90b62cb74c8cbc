"""The asyncio twin of kvpool.client: same sessions and results, awaited instead of blocking.

    async with await AsyncClient.connect() as client:
        async with await client.open_session(task="voice") as s:
            async for chunk in s.generate("Hello", max_tokens=16):
                print(chunk.text, end="")

One reader task receives every reply and hands it to the queue of its request id, so any number of
coroutines can use one client at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from kvpool import protocol as p

from .address import default_address, ipc_path
from .client import HEARTBEAT_S, RETRIES
from .errors import DaemonUnavailable, RequestTimeout
from .framing import encode_request
from .restarts import RestartWatch
from .results import Collector, Completion, expect, generate_request, open_request, raise_if_error


class AsyncClient:
    def __init__(self, address: str | None = None, *, timeout: float = 30.0):
        self.address = address or default_address()
        self.timeout = timeout
        self._context = zmq.asyncio.Context.instance()
        self._sock = self._context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[p.AnyReply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._beater: asyncio.Task[None] | None = None
        self._watch = RestartWatch()
        self._sent_at: dict[int, float] = {}  # when each outstanding request was sent
        self.daemon_version = ""
        self.model = ""
        self._max_frame = 0  # the daemon's max_message_bytes, from its hello

    @classmethod
    async def connect(
        cls, address: str | None = None, *, timeout: float = 30.0, connect_timeout: float = 5.0, name: str = ""
    ) -> AsyncClient:
        """Connect and say hello (None: $KVPOOL_ADDRESS, else the daemon's default address)."""
        client = cls(address, timeout=timeout)
        path = ipc_path(client.address)
        if path is not None and not path.exists():
            raise DaemonUnavailable(
                f"No kvpoold is listening at {client.address} (the socket file does not exist); "
                "start it with `kvpoold` or set KVPOOL_ADDRESS."
            )
        client._sock.connect(client.address)
        client._reader = asyncio.get_running_loop().create_task(client._read())
        try:
            hello = expect(
                await client._call(p.Hello(version=p.PROTOCOL_VERSION, client=name, heartbeat=True), connect_timeout),
                p.HelloReply,
            )
        except RequestTimeout:
            await client.close()
            raise DaemonUnavailable(
                f"No kvpoold answered at {client.address} within {connect_timeout:g} s; is it running?"
            ) from None
        except BaseException:
            await client.close()
            raise
        client.daemon_version, client.model = hello.daemon_version, hello.model
        client._max_frame = hello.max_message_bytes
        client._beater = asyncio.get_running_loop().create_task(client._beat())
        return client

    async def status(self) -> dict[str, Any]:
        return expect(await self._call(p.Status()), p.StatusReply).status

    async def sessions(self) -> list[p.SessionInfo]:
        return expect(await self._call(p.ListSessions()), p.SessionsReply).sessions

    async def open_session(self, task: str = "default", system_prompt: str | list[int] | None = None) -> AsyncSession:
        opened = expect(await self._call(open_request(task, system_prompt)), p.SessionOpened)
        return AsyncSession(self, opened.session, opened.token, opened.task, opened.context_size)

    async def resume_session(self, session_id: str, token: str) -> AsyncSession:
        opened = expect(await self._call(p.ResumeSession(session=session_id, token=token)), p.SessionOpened)
        return AsyncSession(self, opened.session, opened.token, opened.task, opened.context_size)

    async def close(self) -> None:
        for task in (self._beater, self._reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._reader = self._beater = None
        if not self._sock.closed:
            self._sock.close(0)

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
            if self._queues and not self._sock.closed:
                await self._sock.send(ping)

    async def _read(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                reply = p.decode_reply(frame)
            except Exception:  # one unreadable frame must not silence every later reply
                continue
            now = time.monotonic()
            self._watch.heard(reply, now)
            queue = self._queues.get(reply.id)
            if queue is not None:  # replies to abandoned requests are dropped
                queue.put_nowait(reply)

    async def _send(self, message: p.Request) -> int:
        request_id = next(self._ids)
        message.id = request_id
        frame = encode_request(message, self._max_frame)
        self._queues[request_id] = asyncio.Queue()
        self._sent_at[request_id] = time.monotonic()
        await self._sock.send(frame)
        return request_id

    async def _next(self, request_id: int, timeout: float | None = None) -> p.AnyReply:
        started = time.monotonic()
        deadline = started + (self.timeout if timeout is None else timeout)
        queue = self._queues[request_id]
        while True:
            sent = self._sent_at.get(request_id, started)
            if self._watch.lost(sent):  # it went down with the old daemon
                raise DaemonUnavailable(
                    f"kvpoold at {self.address} restarted while this request was in flight; resume the session "
                    "and send the turn again."
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(
                    f"kvpoold at {self.address} did not answer within the timeout; it may be overloaded or hung."
                )
            try:
                return await asyncio.wait_for(queue.get(), min(remaining, HEARTBEAT_S))
            except TimeoutError:
                continue

    async def _call(self, message: p.Request, timeout: float | None = None) -> p.AnyReply:
        """As the sync client: requests that are safe to repeat are resent (a bounded number of times) when the
        daemon restarted under them."""
        attempts = 1 if isinstance(message, p.Hello | p.OpenSession) else RETRIES + 1
        for attempt in range(attempts):
            request_id = await self._send(message)
            try:
                return await self._next(request_id, timeout)
            except DaemonUnavailable:
                if attempt + 1 == attempts:
                    raise
                await asyncio.sleep(HEARTBEAT_S)  # let ZeroMQ reconnect
            finally:
                self._queues.pop(request_id, None)
                self._sent_at.pop(request_id, None)
        raise AssertionError("unreachable")


class AsyncSession:
    def __init__(self, client: AsyncClient, session_id: str, token: str, task: str, context_size: int):
        self.client = client
        self.id = session_id
        self.token = token
        self.task = task
        self.context_size = context_size
        self.final: p.Final | None = None  # the final message of the last generation

    async def generate(self, prompt: str | list[int] = "", **params: Any) -> AsyncIterator[p.Chunk]:
        """Stream the continuation of ``prompt``; same parameters as the sync Session.generate()."""
        request = generate_request(self.id, self.token, prompt, params)
        request_id = await self.client._send(request)
        final: p.Final | None = None  # this generation's own: self.final may already belong to a newer one
        try:
            while final is None:
                reply = raise_if_error(await self.client._next(request_id))
                if isinstance(reply, p.Final):
                    final = self.final = reply
                elif isinstance(reply, p.Chunk):
                    yield reply
        finally:
            self.client._queues.pop(request_id, None)
            self.client._sent_at.pop(request_id, None)
            if final is None:  # the caller stopped early (use contextlib.aclosing to make that prompt)
                with contextlib.suppress(Exception):
                    await self.cancel()

    async def complete(self, prompt: str | list[int] = "", **params: Any) -> Completion:
        collector = Collector()
        async for chunk in self.generate(prompt, **params):
            collector.add(chunk)
        assert self.final is not None
        return collector.result(self.final)

    async def history(self, start: int = 0) -> list[int]:
        reply = await self.client._call(p.History(session=self.id, token=self.token, start=start))
        return expect(reply, p.HistoryReply).tokens

    async def cancel(self) -> bool:
        reply = await self.client._call(p.Cancel(session=self.id, token=self.token))
        return expect(reply, p.Cancelled).cancelled

    async def close(self) -> None:
        expect(await self.client._call(p.CloseSession(session=self.id, token=self.token)), p.Closed)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.client._sock.closed:
            await self.close()
