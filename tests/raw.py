"""A raw DEALER connection for tests that need to send what the client library never would."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from kvpool import protocol as p

RECV_TIMEOUT_MS = 10_000


class RawConnection:
    def __init__(self, address: str):
        self.context = zmq.Context.instance()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)  # a missing reply fails the test, never hangs it
        self.sock.connect(address)
        self.backlog: list[p.AnyReply] = []  # replies skipped by call(), returned by recv() first

    def send_frames(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def send(self, message: dict[str, Any] | p.Request) -> None:
        data = p.encode(message) if isinstance(message, p.Request) else msgspec.msgpack.encode(message)
        self.sock.send(data)

    def recv(self) -> p.AnyReply:
        if self.backlog:
            return self.backlog.pop(0)
        return p.decode_reply(self.sock.recv())

    def call(self, message: dict[str, Any] | p.Request) -> p.AnyReply:
        """Send and return the reply with the same id (chunks of other requests are skipped)."""
        self.send(message)
        request_id = message.id if isinstance(message, p.Request) else message.get("id", 0)
        skipped: list[p.AnyReply] = []
        while True:
            reply = self.recv()
            if reply.id == request_id or not isinstance(request_id, int):
                self.backlog[:0] = skipped
                return reply
            skipped.append(reply)

    def until_final(self, request_id: int) -> tuple[list[p.Chunk], p.Final]:
        chunks, end = self.until_end(request_id)
        if isinstance(end, p.Error):
            raise AssertionError(f"unexpected error {end.code}: {end.message}")
        return chunks, end

    def until_end(self, request_id: int) -> tuple[list[p.Chunk], p.Final | p.Error]:
        """The chunks of a generation and what ended it: its final message, or an error."""
        chunks: list[p.Chunk] = []
        skipped: list[p.AnyReply] = []  # other requests' replies, kept for later recv() calls
        while True:
            reply = self.recv()
            if reply.id != request_id:
                skipped.append(reply)
                continue
            if isinstance(reply, p.Final | p.Error):
                self.backlog[:0] = skipped
                return chunks, reply
            assert isinstance(reply, p.Chunk)
            chunks.append(reply)

    def open(self, task: str = "default") -> p.SessionOpened:
        reply = self.call(p.OpenSession(id=1, task=task))
        assert isinstance(reply, p.SessionOpened), reply
        return reply

    def close(self) -> None:
        self.sock.close(0)
