"""The engine thread: owns the llama.cpp context and runs `step()` until the daemon stops.

step() = take what arrived -> admit waiting generations into hot slots -> schedule -> one llama_decode for
every generating session (one token each) plus prompt chunks -> sample -> emit. A request that arrives while
others generate joins the next step. Every llama.cpp call of the daemon happens on this thread; the I/O
thread only moves frames.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from kvpool import protocol as p
from kvpool.daemon.config import Config
from kvpool.daemon.engine.calibration import calibrate_on_slot
from kvpool.daemon.engine.cost_model import CostModel, StepShape
from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.housekeeping import Housekeeping
from kvpool.daemon.engine.requests import RequestHandlers
from kvpool.daemon.engine.step_plan import Work, plan_budgeted, plan_fcfs, steps_for, urgency
from kvpool.daemon.errors import RequestRefused
from kvpool.daemon.kv.pool.segment import Pool
from kvpool.daemon.kv.sessions import Session, SessionTable
from kvpool.daemon.kv.tiers import Tiers
from kvpool.daemon.llama.model import Model
from kvpool.daemon.ops.counters import EngineCounters
from kvpool.daemon.ops.latency_stats import TaskStats
from kvpool.daemon.ops.status import status_of
from kvpool.protocol import ErrorCode, FinishReason

log = logging.getLogger("kvpool.engine")

Send = Callable[[bytes, p.Reply], None]
# A deadline-bound request that arrives during a step waits for it, then needs a short step of its own: steps
# may take this share of the tightest first-token budget of a task with open sessions (measured: 0.6 keeps the
# voice p99 within its 300 ms budget while long prompts still move in large chunks).
HEADROOM = 0.6
IDLE_WAIT_S = 0.25  # how long an idle engine blocks for new work before checking timeouts and stop


class Engine:
    def __init__(
        self,
        model: Model,
        config: Config,
        tiers: Tiers,
        send: Send,
        daemon_version: str,
        frame_errors: Counter[str] | None = None,
        last_heard: dict[bytes, float] | None = None,
        lagging: set[bytes] | None = None,
    ):
        self.model = model
        self.config = config
        self.tiers = tiers
        self.pool: Pool = tiers.pool
        self.sessions: SessionTable = tiers.sessions
        self.send = send
        self.daemon_version = daemon_version
        self.running: list[Generation] = []
        self.waiting: list[Generation] = []  # accepted, waiting for a hot slot (FCFS)
        self.counters = EngineCounters()
        self.cost = CostModel()
        self.last_step_seconds = 0.0
        self.heartbeat = time.monotonic()
        self.over_memory = False  # resident memory above memory_high_water: new sessions are refused
        self.task_stats: dict[str, TaskStats] = defaultdict(TaskStats)
        self.frame_errors = frame_errors if frame_errors is not None else Counter()  # counted by the I/O thread
        self.last_heard = last_heard if last_heard is not None else {}  # heartbeats, kept by the I/O thread
        self.lagging = lagging if lagging is not None else set()  # clients that stopped reading (I/O thread)
        # (client, request, when the I/O thread received it): a request's clock starts at its arrival, not
        # when the engine gets to it after the step in flight.
        self.inbox: queue.Queue[tuple[bytes, p.AnyRequest, float]] = queue.Queue()
        self.received_at = 0.0  # of the request being handled
        self.stopping = threading.Event()
        self.started = time.monotonic()
        self._inbox_lock = threading.Lock()
        self._inbox_closed = False
        self.handlers = RequestHandlers(self)
        self.housekeeping = Housekeeping(self)

    # ------------------------------------------------------------------ loop

    def submit(self, client: bytes, request: p.AnyRequest) -> bool:
        """Called by the I/O thread: queue a request for the next step; False once the engine has stopped
        taking requests (the I/O thread then answers SHUTTING_DOWN itself)."""
        with self._inbox_lock:
            if self._inbox_closed:
                return False
            self.inbox.put((client, request, time.monotonic()))
            return True

    def run(self) -> None:
        """Thread target: step until asked to stop; then end every generation and checkpoint every session."""
        try:
            self._calibrate()
            while not self.stopping.is_set():
                try:
                    self.step()
                except Exception:  # a bug costs the generations of that step, never the daemon
                    log.exception("engine step failed; ending the generations in flight")
                    self._fail_all()
        finally:
            self._shut_down()

    def step(self) -> None:
        self.heartbeat = time.monotonic()  # the watchdog pings systemd only while this keeps moving
        self._take_requests(block=not (self.running or self.waiting))
        self.housekeeping.run()
        self._admit_waiting()
        if not self.running:
            return
        started = time.monotonic()
        capacity = self.model.batch.capacity
        if self.config.scheduling == "fcfs":
            plan = plan_fcfs(self.running, capacity)
        else:
            plan = plan_budgeted(self.running, capacity, self.cost, self.step_time_cap())
        if not plan:
            return
        batch = self.model.batch
        batch.clear()
        rows = []
        for work in plan:
            s = work.item.session
            rows.append(batch.add(s.slot, s.tokens[s.n_kv : s.n_kv + work.n_tokens], s.n_kv, work.completes))
        shape = StepShape.of([(w.item.position, w.n_tokens, w.completes) for w in plan])
        timed = time.perf_counter()
        rc = self.model.decode()
        now = time.monotonic()
        if rc == 1:
            self._kv_full(plan, now)
            return
        if rc != 0:
            self._decode_failed(plan, rc)
            return
        self.counters.decode_calls += 1
        self.counters.batch_tokens += batch.n
        # The KV now holds every fed token: record that for the whole step before anything can fail.
        for work in plan:
            work.item.note_step(started)
            work.item.session.n_kv += work.n_tokens
            if work.item.completion_tokens == 0:  # fed before its first sampled token: prompt (or system prompt)
                self.counters.prompt_tokens += work.n_tokens
        for work in plan:
            session = work.item.session
            if session.boundary and session.n_kv >= session.boundary:
                self._make_prefix(session)
        tokens = [w.item.sampler.sample(row) if w.completes else None for w, row in zip(plan, rows, strict=True)]
        self.cost.update(shape, time.perf_counter() - timed)  # the model predicts decode + sampling
        for work, token in zip(plan, tokens, strict=True):
            if token is not None:
                self._accept(work.item, token, now)
        self.last_step_seconds = time.monotonic() - started
        self.counters.busy_seconds += self.last_step_seconds

    def _make_prefix(self, session: Session) -> None:
        """Its system prompt is in the KV now: share it from here on. Sharing is an optimisation: a failure
        costs the sharing, not the session."""
        try:
            self.tiers.make_prefix(session)
        except Exception:
            log.exception("could not make a shared prefix from session %s", session.id)

    def step_time_cap(self) -> float | None:
        """The longest a step may take: the tightest per-token budget in flight, and half of the tightest
        first-token budget of the tasks with open sessions (one of them may ask at any moment, and must not
        wait behind a long prompt chunk)."""
        caps = [g.tpot_s for g in self.running if g.tpot_s and g.first_token_at is not None and not g.best_effort]
        for task, profile in self.config.tasks.items():
            if profile.ttft_ms and not profile.best_effort and self.sessions.count(task):
                caps.append(profile.ttft_ms / 1000.0 * HEADROOM)
        return min(caps) if caps else None

    def _calibrate(self) -> None:
        """Start the cost model from this machine's speed (budgets need it; fcfs does not)."""
        if self.config.scheduling != "fcfs" and self.tiers.free_slots:
            calibrate_on_slot(self.model, self.tiers.free_slots[-1], self.cost)

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

    def _handle(self, client: bytes, request: p.AnyRequest, received_at: float) -> None:
        op = type(request).__struct_config__.tag
        self.received_at = received_at
        self.counters.requests[op] += 1
        try:
            if self.stopping.is_set():
                raise RequestRefused(ErrorCode.SHUTTING_DOWN, "The daemon is stopping; retry after it restarts.")
            reply = self.handlers.by_type[type(request)](client, request)
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
            try:
                self.send(client, reply)
            except Exception:  # a reply that cannot be encoded is a bug: answer, log, keep serving
                log.exception("could not send the reply to %s", op)
                self.reply_error(
                    client,
                    request.id,
                    ErrorCode.INTERNAL,
                    "The daemon could not encode its reply; it is logged, report it.",
                )

    def reply_error(
        self, client: bytes, request_id: int, code: ErrorCode, message: str, detail: dict[str, Any] | None = None
    ) -> None:
        self.counters.errors[code.value] += 1
        self.send(client, p.Error(id=request_id, code=code, message=message, detail=detail))

    def _admit_waiting(self) -> None:
        """Give waiting generations a hot slot (restoring their KV), most urgent first; a deadline-bound one
        may swap out a running best-effort generation when every slot is generating."""
        if self.config.scheduling != "fcfs":
            self.waiting.sort(key=urgency)
        # A generation whose session is still hot needs no slot: it runs at once. It must not queue behind one
        # that needs a slot, because the slot it would wait for may be its own (a deadlock with one slot).
        for g in [g for g in self.waiting if g.session.slot is not None]:
            self.waiting.remove(g)
            self._start(g)
        while self.waiting:
            g = self.waiting[0]
            try:
                resident = self.tiers.make_resident(g.session)
                if not resident and self._preempt_for(g):
                    resident = self.tiers.make_resident(g.session)
                if not resident:
                    return  # every slot is generating; try again next step
            except RequestRefused as refused:
                self.waiting.pop(0)
                self._abandon(g, refused.code, refused.message)
                if refused.code == ErrorCode.SESSION_CORRUPT:
                    self.tiers.drop(g.session)
                continue
            self.waiting.pop(0)
            self._start(g)

    def _start(self, g: Generation) -> None:
        if g.new_tokens:  # first admission (a preempted generation comes back with nothing new)
            g.session.tokens.extend(g.new_tokens)
            g.new_tokens = []
        s = g.session
        if s.n_kv == 0 and s.slot is not None and s.prefix is None and self.tiers.prefixes.enabled:
            self.tiers.share_prefix(s)  # its first prompt: compute only what no shared prefix already holds
        self.running.append(g)

    def _preempt_for(self, g: Generation) -> bool:
        """Swap a running best-effort generation out to the pool (not recomputed: it resumes from the same
        KV and sampler state, so its output does not change) to free a slot for deadline-bound ``g``."""
        if self.config.scheduling == "fcfs" or g.best_effort:
            return False
        victims = [r for r in self.running if r.best_effort]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.arrival)  # the newest best-effort work yields first
        try:
            self.tiers.hibernate(victim.session, preempt=True)
        except RequestRefused as refused:  # no room to swap it out: g waits for a slot like anyone else
            log.warning("could not preempt session %s: %s", victim.session.id, refused.message)
            return False
        self.running.remove(victim)
        self.waiting.append(victim)
        self.task_stats[victim.session.task].preemptions += 1
        log.info("preempted best-effort session %s for deadline-bound session %s", victim.session.id, g.session.id)
        return True

    # ------------------------------------------------------------------ tokens

    def _accept(self, g: Generation, token: int, now: float) -> None:
        """A token was sampled for ``g``: append it to the session, stream it, and check the stop conditions."""
        g.session.tokens.append(token)
        g.note_token(now)
        self.counters.generated_tokens += 1
        if g.completion_tokens == 1:
            self._record_first_token(g, now)
        if self.model.is_end_of_generation(token):
            self.send(g.client, p.Chunk(id=g.request.id, text=g.text.flush(), tokens=[token]))
            self.finish(g, FinishReason.STOP, now, flushed=True)
            return
        text = g.text.feed(self.model.token_bytes(token))
        reason = g.stop_reason()
        if reason is not None:
            text += g.text.flush()
        self.send(g.client, p.Chunk(id=g.request.id, text=text, tokens=[token]))
        if reason is not None:
            self.finish(g, reason, now, flushed=True)

    def finish(
        self, g: Generation, reason: FinishReason, now: float, flushed: bool = False, checkpoint: bool = True
    ) -> None:
        """End a generation: flush its text, checkpoint its session (by policy), then send its final message.
        The final message comes after the checkpoint, so a turn the client saw finish is never silently lost to a
        crash: when the checkpoint fails, the session is marked so that a crash evicts it instead."""
        if not flushed and (rest := g.text.flush()):
            self.send(g.client, p.Chunk(id=g.request.id, text=rest, tokens=[]))
        self._release(g)
        g.session.last_used = now
        self.pool.touch(g.session.entry)  # a restarted daemon times the session out from here, not from its start
        self.counters.finished[reason.value] += 1
        stats = self.task_stats[g.session.task]
        stats.late_tokens += g.late_tokens
        if g.completion_tokens > 1 and g.first_token_at is not None and g.last_token_at is not None:
            stats.tpot_ms.add((g.last_token_at - g.first_token_at) * 1000.0 / (g.completion_tokens - 1))
        if checkpoint and self.config.checkpoint == "after_generate" and g.session.slot is not None:
            before = g.session.snapshot
            try:
                self.tiers.checkpoint(g.session)
            except (RequestRefused, OSError) as exc:  # the session stays resident and usable, just not durable
                log.warning("checkpoint of session %s failed: %s", g.session.id, exc)
                if g.session.snapshot is before:  # (a failure after the commit, e.g. removing the old file, is not)
                    # Its older snapshot lacks this turn: a daemon restarted from it would answer the next turn as
                    # if this one never happened. Give it up, so that a crash before the next checkpoint evicts.
                    self.tiers.give_up_snapshot(g.session)
        self.send(g.client, g.final(reason, now))

    def _record_first_token(self, g: Generation, now: float) -> None:
        stats = self.task_stats[g.session.task]
        ttft_ms = (now - g.arrival) * 1000.0
        stats.ttft_ms.add(ttft_ms)
        if g.ttft_s and ttft_ms > g.ttft_s * 1000.0:
            stats.deadline_misses += 1
            stats.lateness_ms += ttft_ms - g.ttft_s * 1000.0

    def _release(self, g: Generation) -> None:
        g.sampler.free()
        g.session.generation = None
        if g in self.running:
            self.running.remove(g)
        elif g in self.waiting:
            self.waiting.remove(g)

    def _abandon(self, g: Generation, code: ErrorCode, message: str) -> None:
        """End a generation with an error instead of a final message."""
        self._release(g)
        self.reply_error(g.client, g.request.id, code, message)

    def _kv_full(self, plan: list[Work[Generation]], now: float) -> None:
        """llama_decode found no free cells in the unified KV (state unchanged): hibernate idle sessions to make
        room and retry next step; if none is idle, the session with the most context ends with `length`."""
        self.counters.kv_full_events += 1
        try:
            if self.tiers.free_cells(exclude=[w.item.session for w in plan], count=max(1, len(plan))):
                return
        except RequestRefused as refused:
            log.warning("could not hibernate idle sessions to free KV cells: %s", refused.message)
        victim = max((w.item for w in plan), key=lambda g: len(g.session.tokens))
        log.warning(
            "unified KV is full (%d cells): ending the generation of session %s with `length`",
            self.model.context_size,
            victim.session.id,
        )
        self.finish(victim, FinishReason.LENGTH, now)

    def _decode_failed(self, plan: list[Work[Generation]], rc: int) -> None:
        """A fatal decode error: the KV of these sessions is in an unknown state, so they are closed."""
        log.error("llama_decode failed with %d; closing the %d sessions of that step", rc, len(plan))
        for work in plan:
            g = work.item
            self._abandon(
                g,
                ErrorCode.INTERNAL,
                f"llama.cpp failed to decode (code {rc}); this session was closed, open a new one.",
            )
            self.tiers.drop(g.session)

    def _fail_all(self) -> None:
        for g in [*self.running, *self.waiting]:
            self._abandon(
                g,
                ErrorCode.INTERNAL,
                "The daemon hit an internal error during this generation; it is logged, retry it.",
            )

    def _shut_down(self) -> None:
        now = time.monotonic()
        for g in list(self.running):
            self.finish(g, FinishReason.SHUTDOWN, now)
        for g in list(self.waiting):
            self._abandon(g, ErrorCode.SHUTTING_DOWN, "The daemon is stopping; retry after it restarts.")
        # A clean stop loses nothing: every resident session is checkpointed, whatever the policy.
        for s in list(self.tiers.resident.values()):
            if not s.checkpoint_fresh:
                try:
                    self.tiers.checkpoint(s)
                except (RequestRefused, OSError) as exc:
                    log.error("could not checkpoint session %s at stop: %s", s.id, exc)
        with self._inbox_lock:  # from here on the I/O thread answers new requests itself
            self._inbox_closed = True
        while True:
            try:
                client, request, _ = self.inbox.get_nowait()
            except queue.Empty:
                break
            self.reply_error(
                client, request.id, ErrorCode.SHUTTING_DOWN, "The daemon is stopping; retry after it restarts."
            )

    def summary(self) -> str:
        """One line for systemd's STATUS= (read from the watchdog thread: plain counts only)."""
        return (
            f"{len(self.sessions.by_id)} sessions ({len(self.tiers.resident)} hot), "
            f"{len(self.running)} generating, {len(self.waiting)} waiting, "
            f"{self.counters.generated_tokens} tokens generated"
        )

    # ------------------------------------------------------------------ status

    def estimate_ttft(self, prompt_tokens: int, position: int, deadline: float) -> float:
        """Seconds from the request's arrival to its first token: the time it already waited (the step that was
        in flight when it came), then the prompts due no later than it and its own, in chunks next to the
        streams already decoding."""
        cap = self.step_time_cap()
        decoders = sum(1 for g in self.running if g.pending_tokens == 1)
        ahead = sum(
            len(g.new_tokens) + g.pending_tokens
            for g in (*self.running, *self.waiting)
            if not g.best_effort and g.first_token_at is None and g.deadline <= deadline
        )
        _, seconds = steps_for(ahead + prompt_tokens, decoders, position, self.model.batch.capacity, self.cost, cap)
        return time.monotonic() - self.received_at + seconds

    def in_flight(self, task: str) -> int:
        return sum(1 for g in (*self.waiting, *self.running) if g.session.task == task)

    def queue_depth(self, task: str) -> int:
        """Generations of a task that have not produced their first token yet."""
        return sum(1 for g in (*self.waiting, *self.running) if g.session.task == task and g.first_token_at is None)

    def status(self) -> dict[str, Any]:
        return status_of(self)
