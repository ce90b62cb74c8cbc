"""The sync and the asyncio client against the same cases: they share one core (client/core.py), and these
tests keep them from drifting apart. Each case runs once per client, against a real daemon or a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvpool import protocol as p
from kvpool.client import Client, DaemonUnavailable
from kvpool.client.aio import AsyncClient
from kvpool.client.errors import BadRequest

from .daemon_process import DaemonProcess

WAIT_S = 60.0
KINDS = ["sync", "asyncio"]


def first_then_rest_sync(daemon: DaemonProcess, prompt: str) -> tuple[list[int], list[int], str]:
    with daemon.client() as client, client.open_session() as s:
        stream = s.generate(prompt, max_tokens=12, temperature=0.0)
        first = next(iter(stream))  # the way people read the first token of any Python stream
        tokens = list(first.tokens)
        for chunk in stream:
            tokens.extend(chunk.tokens)
        assert stream.final is not None
        with client.open_session() as fresh:
            expected = fresh.complete(prompt, max_tokens=12, temperature=0.0).tokens
        return tokens, expected, stream.final.finish_reason


async def first_then_rest_asyncio(daemon: DaemonProcess, prompt: str) -> tuple[list[int], list[int], str]:
    async with await AsyncClient.connect(daemon.address) as client, await client.open_session() as s:
        stream = s.generate(prompt, max_tokens=12, temperature=0.0)
        first = await anext(aiter(stream))
        tokens = list(first.tokens)
        async for chunk in stream:
            tokens.extend(chunk.tokens)
        assert stream.final is not None
        async with await client.open_session() as fresh:
            expected = (await fresh.complete(prompt, max_tokens=12, temperature=0.0)).tokens
        return tokens, expected, stream.final.finish_reason


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_is_its_own_iterator(daemon: DaemonProcess, kind: str) -> None:
    """next() reads the first chunk, a loop the rest, and together they are the whole generation."""
    prompt = "one two three"
    if kind == "sync":
        tokens, expected, reason = first_then_rest_sync(daemon, prompt)
    else:
        tokens, expected, reason = asyncio.run(asyncio.wait_for(first_then_rest_asyncio(daemon, prompt), WAIT_S))
    assert tokens == expected and len(tokens) == 12 and reason == "length"


@pytest.mark.parametrize("kind", KINDS)
def test_closing_a_stream_early_cancels_the_generation(daemon: DaemonProcess, kind: str) -> None:
    with daemon.client() as watcher:

        def generating() -> int:
            return watcher.status().sessions.generating

        if kind == "sync":
            with daemon.client() as client, client.open_session() as s:
                with s.generate("endless", max_tokens=100_000) as stream:
                    next(stream)
                    assert generating() == 1
                assert list(stream) == [] and s.complete("again", max_tokens=1).usage.completion_tokens == 1
        else:

            async def scenario() -> None:
                async with await AsyncClient.connect(daemon.address) as client, await client.open_session() as s:
                    async with s.generate("endless", max_tokens=100_000) as stream:
                        await anext(stream)
                        assert generating() == 1
                    assert [c async for c in stream] == []
                    assert (await s.complete("again", max_tokens=1)).usage.completion_tokens == 1

            asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
        assert generating() == 0


@contextlib.contextmanager
def frozen(daemon: DaemonProcess) -> Iterator[None]:
    """The daemon stopped by SIGSTOP: alive, but silent. Always continued again."""
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("kind", KINDS)
def test_a_daemon_that_falls_silent_is_reported_within_seconds(daemon: DaemonProcess, kind: str) -> None:
    """Heartbeats go unanswered: both clients give up after DAEMON_SILENCE_S, long before their 120 s timeout
    (and before WAIT_S ends the asyncio case)."""
    if kind == "sync":
        with daemon.client(timeout=120.0) as client, client.open_session() as s:
            stream = s.generate("endless", max_tokens=100_000)
            next(stream)
            with frozen(daemon), pytest.raises(DaemonUnavailable, match="stopped answering heartbeats"):
                for _ in stream:
                    pass
        return

    async def scenario() -> None:
        async with await AsyncClient.connect(daemon.address, timeout=120.0) as client:
            s = await client.open_session()
            stream = s.generate("endless", max_tokens=100_000)
            await anext(stream)
            with frozen(daemon), pytest.raises(DaemonUnavailable, match="stopped answering heartbeats"):
                async for _ in stream:
                    pass

    asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


@pytest.fixture
def garbling_peer(short_tmp: Path) -> Iterator[str]:
    """A real ZeroMQ ROUTER that answers a hello with an undecodable frame first, then a proper reply."""
    address = f"ipc://{short_tmp / 'peer.sock'}"
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, frame = router.recv_multipart()
            request = p.decode_request(frame)
            if isinstance(request, p.Hello):
                router.send_multipart([identity, b"\xc1 not msgpack"])
                reply = p.HelloReply(id=request.id, version=p.PROTOCOL_VERSION, daemon_version="peer", model="none")
                router.send_multipart([identity, p.encode(reply)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        stop.set()
        thread.join(5.0)
        router.close(0)


@pytest.mark.parametrize("kind", KINDS)
def test_an_undecodable_reply_is_counted_and_logged_not_fatal(
    garbling_peer: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    counted: Callable[[object], int] = lambda client: client._core.undecodable_frames  # noqa: E731
    if kind == "sync":
        with Client(garbling_peer, connect_timeout=5.0) as client:
            assert client.daemon_version == "peer" and counted(client) == 1
    else:

        async def scenario() -> int:
            async with await AsyncClient.connect(garbling_peer, connect_timeout=5.0) as client:
                assert client.daemon_version == "peer"
                return counted(client)

        assert asyncio.run(asyncio.wait_for(scenario(), WAIT_S)) == 1
    assert "could not be decoded" in caplog.text


def test_asyncio_client_runs_sessions_concurrently(daemon: DaemonProcess) -> None:
    prompts = ["first async prompt", "second async prompt", "third one"]
    with daemon.client() as client:
        expected = []
        for prompt in prompts:
            with client.open_session() as s:
                expected.append(s.complete(prompt, max_tokens=16, temperature=0.0).tokens)

    async def one(client: AsyncClient, prompt: str) -> list[int]:
        async with await client.open_session() as s:
            tokens: list[int] = []
            async for chunk in s.generate(prompt, max_tokens=16, temperature=0.0):
                tokens.extend(chunk.tokens)
            assert s.final is not None and s.final.finish_reason == "length"
            return tokens

    async def too_large(client: AsyncClient) -> None:  # refused before sending, as in the sync client
        async with await client.open_session() as s:
            with pytest.raises(BadRequest, match="max_message_bytes"):
                async for _ in s.generate("\U0001f600" * (1 << 20), max_tokens=2):
                    pass

    async def main() -> list[list[int]]:
        async with await AsyncClient.connect(daemon.address) as client:
            assert "llama" in client.model
            await too_large(client)
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    assert asyncio.run(asyncio.wait_for(main(), 60)) == expected
