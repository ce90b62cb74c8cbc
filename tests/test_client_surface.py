"""One client surface: the sync and asyncio clients have the same public names and signatures (so they cannot
drift apart again), the same attributes once connected, and both send a generation when generate() is called."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from kvpool.client import Client, Session, Stream
from kvpool.client.aio import AsyncClient, AsyncSession, AsyncStream

from .daemon_process import DaemonProcess, wait_until

# Where asyncio's protocols name a thing differently: the async name of each sync one.
PROTOCOLS = {"__init__": "__init__", "__iter__": "__aiter__", "__next__": "__anext__", "__enter__": "__aenter__"}
PAIRS = [
    (Client, AsyncClient, {**PROTOCOLS, "__init__": "connect"}),  # Client(...) connects; AsyncClient.connect does
    (Session, AsyncSession, PROTOCOLS),
    (Stream, AsyncStream, {**PROTOCOLS, "close": "aclose"}),
]


def public(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) or isinstance(value, classmethod | property)}


def shape(function: object) -> list[tuple[str, object, object, str]]:
    """Parameters (name, kind, default, annotation) with the async names mapped onto the sync ones."""
    signature = inspect.signature(function)  # type: ignore[arg-type]
    return [
        (p.name, p.kind, p.default, str(p.annotation).replace("Async", ""))
        for p in signature.parameters.values()
        if p.name not in ("self", "cls")
    ]


@pytest.mark.parametrize(("sync", "aio", "names"), PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_sync_and_async_classes_have_the_same_public_surface(sync: type, aio: type, names: dict[str, str]) -> None:
    def compared(cls: type, allowed: set[str]) -> set[str]:
        return {name for name in public(cls) if not name.startswith("_") or name in allowed}

    sync_names = compared(sync, set(names))
    assert {names.get(name, name) for name in sync_names} == compared(aio, set(names.values())), sync.__name__
    for name in sync_names:
        twin = names.get(name, name)
        assert shape(getattr(sync, name)) == shape(getattr(aio, twin)), f"{sync.__name__}.{name} vs {twin}"
        if name in ("__init__", "__iter__", "__next__", "__enter__"):
            continue  # what they return differs by nature (an awaitable, the async iterator)
        returns = inspect.signature(getattr(sync, name)).return_annotation
        async_returns = inspect.signature(getattr(aio, twin)).return_annotation
        assert str(returns).replace("Async", "") == str(async_returns).replace("Async", ""), name


def test_both_clients_expose_the_same_attributes_and_send_at_generate(daemon: DaemonProcess) -> None:
    with daemon.client() as client, daemon.client() as observer, client.open_session() as s:
        stream = s.generate("sync", max_tokens=2, temperature=0.0)
        wait_until(lambda: observer.status().counters.requests.get("generate", 0) >= 1, "the sync generate to arrive")
        list(stream)
        sync_attrs = (public_attributes(client), public_attributes(s), public_attributes(stream))
        assert s.final is stream.final is not None and s.final.timings.ttft_ms > 0

    async def run_async() -> tuple[set[str], set[str], set[str]]:
        async with await AsyncClient.connect(daemon.address) as aclient, await aclient.open_session() as a:
            astream = a.generate("async", max_tokens=2, temperature=0.0)
            # Nothing awaited since generate(): the request is already on its way, as the sync client's is.
            with Client(daemon.address) as watcher:
                wait_until(
                    lambda: watcher.status().counters.requests.get("generate", 0) >= 2, "the async generate to arrive"
                )
            async for _ in astream:
                pass
            assert a.final is astream.final is not None and a.final.timings.ttft_ms > 0
            return public_attributes(aclient), public_attributes(a), public_attributes(astream)

    assert asyncio.run(run_async()) == sync_attrs


def public_attributes(obj: object) -> set[str]:
    return {name for name in vars(obj) if not name.startswith("_")}
