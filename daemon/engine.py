"""The engine thread: owns the llama.cpp context and runs `step()` until the daemon stops.

step() = take what arrived -> schedule -> one llama_decode for every generating session (one token each)
plus prompt chunks -> sample -> emit. A request that arrives while others generate joins the next step.
Every llama.cpp call of the daemon happens on this thread; the I/O thread only moves frames.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvpool.client import protocol as p
from kvpool.client.protocol import ErrorCode, FinishReason

from .config import Config
from .errors import RequestRefused
from .generation import Generation
from .metrics import EngineCounters
from .model import Model, SamplingParams
from .scheduler import plan_step
from .sessions import Session, SessionTable
from .stream_text import StreamText

log = logging.getLogger("kvpool.engine")

Send = Callable[[bytes, p.Reply], None]
IDLE_WAIT_S = 0.25  # how long an idle engine blocks for new work before checking timeouts and stop


class Engine:
    def __init__(
        self, model: Model, config: Config, send: Send, daemon_version: str, frame_errors: Counter[str] | None = None
    ):
        self.model = model
        self.config = config
        self.send = send
        self.daemon_version = daemon_version
        self.sessions = SessionTable(config, model.hot_slots, model.context_size)
        self.running: list[Generation] = []
        self.counters = EngineCounters()
        self.frame_errors = frame_errors if frame_errors is not None else Counter()  # counted by the I/O thread
        self.inbox: queue.Queue[tuple[bytes, p.AnyRequest]] = queue.Queue()
        self.stopping = threading.Event()
        self.started = time.monotonic()
        self._next_expiry_check = 0.0
        self._handlers: dict[type, Callable[[bytes, Any], p.Reply | None]] = {
            p.Hello: self._hello,
            p.Status: self._status,
            p.ListSessions: self._list_sessions,
            p.OpenSession: self._open,
            p.CloseSession: self._close,
            p.Cancel: self._cancel,
            p.Generate: self._generate,
        }

    # ------------------------------------------------------------------ loop

    def submit(self, client: bytes, request: p.AnyRequest) -> None:
        """Called by the I/O thread: queue a request for the next step."""
        self.inbox.put((client, request))

    def run(self) -> None:
        """Thread target: step until asked to stop, then end every generation with finish reason `shutdown`."""
        try:
            while not self.stopping.is_set():
                try:
                    self.step()
                except Exception:  # a bug costs the generations of that step, never the daemon
                    log.exception("engine step failed; ending the generations in flight")
                    self._fail_running()
        finally:
            now = time.monotonic()
            for generation in list(self.running):
                self._finish(generation, FinishReason.SHUTDOWN, now)
            self._refuse_queued()

    def step(self) -> None:
        self._take_requests(block=not self.running)
        self._expire_idle_sessions()
        if not self.running:
            return
        started = time.monotonic()
        plan = plan_step(self.running, self.model.batch.capacity)
        batch = self.model.batch
        batch.clear()
        rows = []
        for work in plan:
            s = work.item.session
            rows.append(batch.add(s.slot, s.tokens[s.n_kv : s.n_kv + work.n_tokens], s.n_kv, work.completes))
        rc = self.model.decode()
        now = time.monotonic()
        if rc == 1:
            self._kv_full(plan, now)
            return
        if rc != 0:
            self._decode_failed(plan, rc, now)
            return
        self.counters.decode_calls += 1
        self.counters.batch_tokens += batch.n
        for work, row in zip(plan, rows, strict=True):
            g = work.item
            g.note_step(started)
            g.session.n_kv += work.n_tokens
            if work.completes:
                self._accept(g, g.sampler.sample(row), now)
        self.counters.busy_seconds += time.monotonic() - started

    def _take_requests(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, client: bytes, request: p.AnyRequest) -> None:
        op = type(request).__struct_config__.tag
        self.counters.requests[op] += 1
        try:
            if self.stopping.is_set():
                raise RequestRefused(ErrorCode.SHUTTING_DOWN, "The daemon is stopping; retry after it restarts.")
            reply = self._handlers[type(request)](client, request)
        except RequestRefused as refused:
            self.reply_error(client, request.id, refused.code, refused.message, refused.detail)
            return
        except Exception:  # a bug must cost one request, never the daemon
            log.exception("internal error while handling %s", op)
            self.reply_error(
                client,
                request.id,
                ErrorCode.INTERNAL,
                "The daemon hit an internal error on this request; it is logged, retry or report it.",
            )
            return
        if reply is not None:
            self.send(client, reply)

    def reply_error(
        self, client: bytes, request_id: int, code: ErrorCode, message: str, detail: dict[str, Any] | None = None
    ) -> None:
        self.counters.errors[code.value] += 1
        self.send(client, p.Error(id=request_id, code=code, message=message, detail=detail))

    def _refuse_queued(self) -> None:
        while True:
            try:
                client, request = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.reply_error(
                client, request.id, ErrorCode.SHUTTING_DOWN, "The daemon is stopping; retry after it restarts."
            )

    # ------------------------------------------------------------------ tokens

    def _accept(self, g: Generation, token: int, now: float) -> None:
        """A token was sampled for ``g``: append it to the session, stream it, and check the stop conditions."""
        g.session.tokens.append(token)
        g.note_token(now)
        self.counters.generated_tokens += 1
        if self.model.is_end_of_generation(token):
            self.send(g.client, p.Chunk(id=g.request.id, text=g.text.flush(), tokens=[token]))
            self._finish(g, FinishReason.STOP, now, flushed=True)
            return
        text = g.text.feed(self.model.token_bytes(token))
        reason = g.stop_reason()
        if reason is not None:
            text += g.text.flush()
        self.send(g.client, p.Chunk(id=g.request.id, text=text, tokens=[token]))
        if reason is not None:
            self._finish(g, reason, now, flushed=True)

    def _finish(self, g: Generation, reason: FinishReason, now: float, flushed: bool = False) -> None:
        if not flushed and (rest := g.text.flush()):
            self.send(g.client, p.Chunk(id=g.request.id, text=rest, tokens=[]))
        self.send(g.client, g.final(reason, now))
        g.sampler.free()
        g.session.generation = None
        g.session.last_used = now
        self.running.remove(g)
        self.counters.finished[reason.value] += 1

    def _kv_full(self, plan: list, now: float) -> None:
        """llama_decode found no free cells in the unified KV (state unchanged). The session holding the most
        context in this step ends its generation with `length`; the others retry in the next step."""
        self.counters.kv_full_events += 1
        victim = max((w.item for w in plan), key=lambda g: len(g.session.tokens))
        log.warning(
            "unified KV is full (%d cells): ending the generation of session %s with `length`",
            self.model.context_size,
            victim.session.id,
        )
        self._finish(victim, FinishReason.LENGTH, now)

    def _fail_running(self) -> None:
        for g in list(self.running):
            self.running.remove(g)
            g.sampler.free()
            g.session.generation = None
            self.reply_error(
                g.client,
                g.request.id,
                ErrorCode.INTERNAL,
                "The daemon hit an internal error during this generation; it is logged, retry it.",
            )

    def _decode_failed(self, plan: list, rc: int, now: float) -> None:
        """A fatal decode error: the KV of these sessions is in an unknown state, so they are closed."""
        log.error("llama_decode failed with %d; closing the %d sessions of that step", rc, len(plan))
        for work in plan:
            g = work.item
            self.running.remove(g)
            g.sampler.free()
            self.reply_error(
                g.client,
                g.request.id,
                ErrorCode.INTERNAL,
                f"llama.cpp failed to decode (code {rc}); this session was closed, open a new one.",
            )
            self._drop_session(g.session)

    # ------------------------------------------------------------------ requests

    def _hello(self, client: bytes, r: p.Hello) -> p.Reply:
        if r.version != p.PROTOCOL_VERSION:
            raise RequestRefused(
                ErrorCode.VERSION_MISMATCH,
                f"This daemon speaks protocol {p.PROTOCOL_VERSION}, the client {r.version}; "
                "install matching kvpool versions.",
            )
        return p.HelloReply(
            id=r.id, version=p.PROTOCOL_VERSION, daemon_version=self.daemon_version, model=self.model.description
        )

    def _status(self, client: bytes, r: p.Status) -> p.Reply:
        return p.StatusReply(id=r.id, status=self.status())

    def status(self) -> dict[str, Any]:
        sessions = self.sessions.by_id.values()
        return {
            "daemon_version": self.daemon_version,
            "protocol_version": p.PROTOCOL_VERSION,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "model": self.model.info(),
            "slots": {"total": self.model.hot_slots, "used": self.sessions.slots_used},
            "kv": {"cells_total": self.model.context_size, "cells_used": sum(s.n_kv for s in sessions)},
            "sessions": {
                "open": len(self.sessions.by_id),
                "max": self.config.max_sessions,
                "generating": len(self.running),
            },
            "batch_size": self.model.batch.capacity,
            "counters": self.counters.as_dict() | {"frame_errors": dict(self.frame_errors)},
        }

    def _list_sessions(self, client: bytes, r: p.ListSessions) -> p.Reply:
        now = time.monotonic()
        infos = [
            p.SessionInfo(
                session=s.id,
                task=s.task,
                tier="hot",
                context_tokens=len(s.tokens),
                busy=s.generation is not None,
                idle_s=round(now - s.last_used, 3),
                age_s=round(now - s.created, 3),
            )
            for s in self.sessions.by_id.values()
        ]
        return p.SessionsReply(id=r.id, sessions=infos)

    def _open(self, client: bytes, r: p.OpenSession) -> p.Reply:
        s = self.sessions.open(r.task)
        log.info("session %s opened for task %s in slot %d", s.id, s.task, s.slot)
        return p.SessionOpened(id=r.id, session=s.id, token=s.token, task=s.task, context_size=s.context_limit)

    def _close(self, client: bytes, r: p.CloseSession) -> p.Reply:
        s = self.sessions.get(r.session, r.token)
        if s.generation is not None:
            self._finish(s.generation, FinishReason.CANCELLED, time.monotonic())
        self._drop_session(s)
        return p.Closed(id=r.id, session=s.id)

    def _drop_session(self, s: Session) -> None:
        self.model.forget_sequence(s.slot)
        self.sessions.close(s)

    def _cancel(self, client: bytes, r: p.Cancel) -> p.Reply:
        s = self.sessions.get(r.session, r.token)
        g = s.generation
        if g is None:
            return p.Cancelled(id=r.id, cancelled=False)
        self._finish(g, FinishReason.CANCELLED, time.monotonic())
        return p.Cancelled(id=r.id, cancelled=True, completion_tokens=g.completion_tokens)

    def _generate(self, client: bytes, r: p.Generate) -> None:
        s = self.sessions.get(r.session, r.token)
        if s.generation is not None:
            raise RequestRefused(
                ErrorCode.SESSION_BUSY, f"Session {s.id} is still generating; wait for its final message or cancel it."
            )
        new = self._prompt_tokens(r, s)
        if not new and s.pending_tokens == 0:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                "The prompt is empty and the session has nothing to continue from; send some text.",
            )
        room = s.context_limit - len(s.tokens) - 1  # one place is kept for at least one generated token
        if len(new) > room:
            raise RequestRefused(
                ErrorCode.CONTEXT_OVERFLOW,
                f"The prompt is {len(new)} tokens but session {s.id} has room for {max(room, 0)} more "
                f"(context limit {s.context_limit}); shorten the prompt or open a new session.",
                {"prompt_tokens": len(new), "room": max(room, 0), "context_limit": s.context_limit},
            )
        params = SamplingParams(
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            min_p=r.min_p,
            repeat_penalty=r.repeat_penalty,
            repeat_last_n=r.repeat_last_n,
            seed=r.seed,
        )
        s.tokens.extend(new)
        self.counters.prompt_tokens += len(new)
        g = Generation(
            client=client,
            request=r,
            session=s,
            sampler=self.model.new_sampler(params, s.tokens),
            prompt_tokens=len(new),
            text=StreamText(r.stop),
        )
        s.generation = g
        s.last_used = g.arrival
        self.running.append(g)
        return None  # the reply is the stream of chunks and the final message

    def _prompt_tokens(self, r: p.Generate, s: Session) -> list[int]:
        if r.prompt_tokens is not None:
            if r.prompt:
                raise RequestRefused(ErrorCode.BAD_REQUEST, "Send either `prompt` or `prompt_tokens`, not both.")
            bad = [t for t in r.prompt_tokens if not self.model.valid_token(t)]
            if bad:
                raise RequestRefused(
                    ErrorCode.BAD_REQUEST,
                    f"Token ids {bad[:5]} are outside this model's vocabulary of "
                    f"{self.model.n_vocab}; tokenize with the daemon's model.",
                )
            return list(r.prompt_tokens)
        return self.model.tokenize(r.prompt, add_bos=not s.tokens)

    def _expire_idle_sessions(self) -> None:
        timeout = self.config.session_timeout
        now = time.monotonic()
        if timeout <= 0 or now < self._next_expiry_check:
            return
        self._next_expiry_check = now + 1.0  # a scan per second is plenty for timeouts counted in seconds
        for s in self.sessions.idle_longer_than(timeout, now):
            log.info("session %s expired after %.0f s idle", s.id, timeout)
            self._drop_session(s)
