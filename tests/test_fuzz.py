"""Fuzz the daemon's socket: 10,000 random and mutated frames. It must never die, must answer every frame
(an error code where the frame is not a valid request), and its memory must stay within a bound."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import psutil

from kvpool import protocol as p

from .daemon_process import DaemonProcess
from .raw import RawConnection

FRAMES = 10_000
BATCH = 200  # frames in flight before their replies are read
MEMORY_GROWTH_BOUND = 64 << 20  # the daemon's RSS may not grow by more than this over the whole run


def valid_messages(session: str, token: str) -> list[dict[str, Any]]:
    """Well-formed requests to mutate (none of them starts a generation that would stream)."""
    return [
        {"op": "hello", "id": 1, "version": 1},
        {"op": "status", "id": 2},
        {"op": "sessions", "id": 3},
        {"op": "open", "id": 4, "task": "default"},
        {"op": "cancel", "id": 5, "session": session, "token": token},
        {"op": "generate", "id": 6, "session": "0" * 16, "token": token, "prompt": "x", "max_tokens": 2},
        {"op": "resume", "id": 7, "session": session, "token": "f" * 32},
    ]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.randint(-(2**63), 2**64 - 1)
    if kind == 1:
        return rng.random() * 10 ** rng.randint(-5, 20) * rng.choice([1, -1])
    if kind == 2:
        return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.randbytes(rng.randrange(16))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice(["op", "id", "generate", "session", "token", "prompt", "max_tokens"])
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(random_value(rng, depth + 1)): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def fuzz_frame(rng: random.Random, seeds: list[dict[str, Any]]) -> bytes:
    choice = rng.randrange(6)
    if choice == 0:  # raw bytes
        return rng.randbytes(rng.randrange(64))
    if choice == 1:  # random msgpack structure
        return msgspec.msgpack.encode(random_value(rng))
    base = dict(rng.choice(seeds))
    if choice == 2:  # a field replaced with a random value, or a random field added
        key = rng.choice([*base.keys(), "extra", "op"])
        base[key] = random_value(rng)
        return msgspec.msgpack.encode(base)
    if choice == 3:  # a field dropped
        base.pop(rng.choice(list(base.keys())))
        return msgspec.msgpack.encode(base)
    frame = bytearray(msgspec.msgpack.encode(base))
    if choice == 4:  # bit flips
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        return bytes(frame)
    return bytes(frame[: rng.randrange(len(frame))])  # truncated


def test_ten_thousand_random_and_mutated_frames(daemon: DaemonProcess) -> None:
    rng = random.Random(20261129)
    raw = RawConnection(daemon.address)
    try:
        opened = raw.open()
        seeds = valid_messages(opened.session, opened.token)
        process = psutil.Process(daemon.proc.pid)
        rss_before = process.memory_info().rss
        codes: dict[str, int] = {}
        answered = 0
        for start in range(0, FRAMES, BATCH):
            for _ in range(min(BATCH, FRAMES - start)):
                raw.send_frames(fuzz_frame(rng, seeds))
            for _ in range(min(BATCH, FRAMES - start)):
                reply = raw.recv()  # bounded by the socket's receive timeout: a missing answer fails the test
                answered += 1
                key = reply.code.value if isinstance(reply, p.Error) else type(reply).__name__
                codes[key] = codes.get(key, 0) + 1
        assert answered == FRAMES
        assert daemon.proc.poll() is None, "the daemon died"
        assert codes.get("BAD_REQUEST", 0) > FRAMES // 3 and codes.get("UNKNOWN_OP", 0) > 0
        assert "INTERNAL" not in codes, codes  # no frame reached a code path that failed
        growth = process.memory_info().rss - rss_before
        assert growth < MEMORY_GROWTH_BOUND, f"RSS grew by {growth >> 20} MiB"
        # and it still serves real work, including the session opened before the storm
        reply = raw.call(
            p.Generate(id=99, session=opened.session, token=opened.token, prompt="ok", max_tokens=2, temperature=0.0)
        )
        assert isinstance(reply, p.Chunk)
    finally:
        raw.close()
