"""The engine's failure paths in this process, on the fake model (a real pool and spill directory, no daemon): what
happens to the generations of a step whose decode finds the unified KV full, fails, or raises."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpool import protocol as p
from kvpool.daemon.engine.loop import Engine
from kvpool.daemon.kv.sessions import Session
from kvpool.protocol import ErrorCode, FinishReason

from .fake_model import FakeModel
from .kv_in_process import compute, kv_on_fake_model, open_session

CLIENT = b"client"
WAIT_S = 10.0
MAX_STEPS = 20


class Replies:
    """What the engine sent, by request id (a queue: the threaded test waits on it, bounded)."""

    def __init__(self) -> None:
        self.sent: queue.Queue[p.Reply] = queue.Queue()
        self.by_id: dict[int, list[p.Reply]] = {}

    def send(self, client: bytes, reply: p.Reply) -> None:
        self.sent.put(reply)

    def take(self) -> None:
        while not self.sent.empty():
            reply = self.sent.get_nowait()
            self.by_id.setdefault(reply.id, []).append(reply)

    def last(self, request_id: int) -> p.Reply | None:
        self.take()
        replies = self.by_id.get(request_id)
        return replies[-1] if replies else None

    def wait_last(self, request_id: int) -> p.Reply:
        """The final message or error of a request, waiting at most WAIT_S for it."""
        deadline = time.monotonic() + WAIT_S
        while True:
            reply = self.last(request_id)
            if isinstance(reply, p.Final | p.Error):
                return reply
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no final message or error for request {request_id} within {WAIT_S} s"
            reply = self.sent.get(timeout=remaining)
            self.by_id.setdefault(reply.id, []).append(reply)


@contextmanager
def engine_on_fake_model(
    tmp: Path, *, hot_slots: int = 2, context_size: int = 64, **settings: object
) -> Iterator[tuple[Engine, Replies]]:
    """An engine over the fake model's tiers: first come first served (its plans do not depend on a clock) and no
    calibration (nothing to measure), and any other ``settings``."""
    config = {"scheduling": "fcfs", "calibrate": False, **settings}
    with kv_on_fake_model(tmp, hot_slots=hot_slots, context_size=context_size, config_text=config) as kv:
        replies = Replies()
        yield Engine(kv.model, kv.config, kv, replies.send, "test"), replies  # type: ignore[arg-type]


def generate(request_id: int, s: Session, prompt: int, stop: list[str] | None = None) -> p.Generate:
    """``prompt`` tokens, then two generated ones (or fewer, at a stop string)."""
    return p.Generate(
        id=request_id,
        session=s.id,
        token=s.token,
        prompt_tokens=[7] * prompt,
        max_tokens=2,
        temperature=0.0,
        stop=stop or [],
    )


def start(engine: Engine, request: p.Generate) -> None:
    """As the I/O thread hands a request over, and the next step takes it."""
    engine.handlers.generate(CLIENT, request, time.monotonic())


def step_until_done(engine: Engine, replies: Replies, *request_ids: int) -> None:
    for _ in range(MAX_STEPS):
        if all(isinstance(replies.last(i), p.Final | p.Error) for i in request_ids):
            return
        engine.step()
    raise AssertionError(f"requests {request_ids} did not end within {MAX_STEPS} steps")


def fake(engine: Engine) -> FakeModel:
    assert isinstance(engine.model, FakeModel)
    return engine.model


def test_a_full_kv_hibernates_an_idle_session_and_the_step_is_retried(tmp_path: Path) -> None:
    with engine_on_fake_model(tmp_path, context_size=64) as (engine, replies):
        idle, talker = open_session(engine.kv), open_session(engine.kv)
        compute(engine.kv, idle, 40)  # hot and idle: 40 of the 64 cells
        start(engine, generate(1, talker, prompt=30))  # 30 more do not fit
        engine.step()
        assert engine.counters.kv_full_events == 1 and fake(engine).decodes == 1
        assert idle.tier == "pool" and replies.last(1) is None  # room made, nothing ended: the step comes again
        step_until_done(engine, replies, 1)
        final = replies.last(1)
        assert isinstance(final, p.Final) and final.finish_reason == FinishReason.LENGTH
        assert final.usage.completion_tokens == 2 and talker.n_kv == 31  # the retried step fed all 30
        assert engine.counters.kv_full_events == 1 and idle.id in engine.kv.sessions.by_id


def test_a_full_kv_with_nobody_idle_ends_the_generation_holding_the_most_context(tmp_path: Path) -> None:
    with engine_on_fake_model(tmp_path, context_size=48) as (engine, replies):
        longer, shorter = open_session(engine.kv), open_session(engine.kv)
        start(engine, generate(1, longer, prompt=30))
        start(engine, generate(2, shorter, prompt=25, stop=["xx"]))  # the fake's tokens read "x" each
        engine.step()  # 55 tokens (one batch) for 48 cells, and no idle session to give way
        assert engine.counters.kv_full_events == 1
        ended = replies.last(1)  # a cut, never a finish: an error that says what the session kept
        assert isinstance(ended, p.Error) and ended.code == p.ErrorCode.KV_FULL
        assert ended.detail == p.cut_detail(0, 30) and replies.last(2) is None
        step_until_done(engine, replies, 2)  # the other one goes on alone
        final = replies.last(2)
        assert isinstance(final, p.Final) and final.finish_reason == FinishReason.STOP
        assert final.usage.completion_tokens == 2 and {longer.id, shorter.id} <= set(engine.kv.sessions.by_id)


@pytest.mark.parametrize("rc", [-1, 2])
def test_a_failed_decode_closes_the_sessions_of_that_step_with_internal(tmp_path: Path, rc: int) -> None:
    with engine_on_fake_model(tmp_path) as (engine, replies):
        a, b, bystander = (open_session(engine.kv) for _ in range(3))
        start(engine, generate(1, a, prompt=5))
        start(engine, generate(2, b, prompt=5))
        fake(engine).fail_next_decodes(rc)
        engine.step()
        for request_id in (1, 2):
            error = replies.last(request_id)
            assert isinstance(error, p.Error) and error.code == ErrorCode.INTERNAL
            assert f"code {rc}" in error.message and "closed" in error.message
        sessions = engine.kv.sessions.by_id
        assert a.id not in sessions and b.id not in sessions and bystander.id in sessions  # its KV is unknown
        assert engine.kv.pool.usage().entries_used == 1 and engine.counters.errors["INTERNAL"] == 2


def test_a_step_that_raises_ends_every_generation_with_internal_and_the_engine_goes_on(tmp_path: Path) -> None:
    with engine_on_fake_model(tmp_path) as (engine, replies):
        a, b = open_session(engine.kv), open_session(engine.kv)
        fake(engine).fail_next_decodes(RuntimeError("a bug in a step"))
        engine.submit(CLIENT, generate(1, a, prompt=5))  # both in the engine's first step
        engine.submit(CLIENT, generate(2, b, prompt=5))
        thread = threading.Thread(target=engine.run, name="engine")
        thread.start()
        try:
            for request_id in (1, 2):
                error = replies.wait_last(request_id)
                assert isinstance(error, p.Error) and error.code == ErrorCode.INTERNAL
                assert "internal error during this generation" in error.message
            engine.submit(CLIENT, generate(3, a, prompt=5))  # the sessions stay, and the engine still steps
            final = replies.wait_last(3)
            assert isinstance(final, p.Final) and final.usage.completion_tokens == 2
        finally:
            engine.stopping.set()
            thread.join(WAIT_S)
        assert not thread.is_alive()
        assert {a.id, b.id} <= set(engine.kv.sessions.by_id) and fake(engine).decodes >= 3
