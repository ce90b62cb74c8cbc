"""The engine thread: owns the llama.cpp context and runs `step()` until the daemon stops.

step() = take what arrived -> housekeeping -> schedule (engine/scheduler.py: hot slots, budgets, the step's
chunks) -> run (engine/runner.py: one llama_decode for every running generation, then sampling) ->
postprocess (tokens streamed, stop conditions, checkpoints). A request that arrives while others generate joins
the next step. Every llama.cpp call of the daemon happens on this thread; the I/O thread only moves frames.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import msgspec

from kvpool import protocol as p
from kvpool.daemon.config import Config
from kvpool.daemon.engine.calibration import calibrate_on_slot
from kvpool.daemon.engine.cpu_share import IdleSampler, process_cpu_seconds
from kvpool.daemon.engine.drafts import FORCED, with_drafts
from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.housekeeping import Housekeeping
from kvpool.daemon.engine.intake import Intake
from kvpool.daemon.engine.moves import next_work
from kvpool.daemon.engine.requests import RequestHandlers
from kvpool.daemon.engine.runner import Runner, StepOutcome
from kvpool.daemon.engine.scheduler import Scheduler
from kvpool.daemon.engine.step_log import StepLog
from kvpool.daemon.engine.step_work import Work
from kvpool.daemon.engine.thread_count import ThreadCount
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.llama.model import Model, Sampled
from kvpool.daemon.media.frame_areas import FrameAreas
from kvpool.daemon.media.media_cache import MediaCache
from kvpool.daemon.ops.status_report import status_of
from kvpool.daemon.preload.preloader import Preloader
from kvpool.daemon.refusals import RequestRefused
from kvpool.daemon.remote.handlers import RemoteRequests
from kvpool.daemon.remote.interface import CrossNode, NoRemote
from kvpool.daemon.rpc.workers import Workers
from kvpool.daemon.serve.liveness import Liveness
from kvpool.protocol import ErrorCode, FinishReason
from kvpool.protocol.status import Counters, DaemonStatus, DraftStatus

if TYPE_CHECKING:  # the tier needs redis-py (the `remote` extra)
    from kvpool.daemon.remote.tier import RemoteTier

log = logging.getLogger("kvpool.engine")

Send = Callable[[bytes, p.Reply], None]
IDLE_WAIT_S = 0.25  # how long an idle engine blocks for new work before checking timeouts and stop
PAUSED_WAIT_S = 0.01  # how long it waits when every generation is paused for its client (or waits for a slot)


def thread_count(config: Config, most: int, idle: IdleSampler) -> ThreadCount:
    """The decode's thread count: adaptive unless a setting needs it fixed."""
    fixed_because = config.threads_fixed_because
    return ThreadCount(most, adaptive=not fixed_because, fixed_because=fixed_because, idle_cores=idle)


class Engine:
    def __init__(
        self,
        model: Model,
        config: Config,
        kv: KvManager,
        send: Send,
        daemon_version: str,
        frame_errors: Counter[str] | None = None,
        liveness: Liveness | None = None,
        workers: Workers | None = None,
        remote: RemoteTier | None = None,
        preloader: Preloader | None = None,
        media: MediaCache | None = None,
        frame_areas: FrameAreas | None = None,
        received_bytes: Callable[[], int] | None = None,
        step_log: StepLog | None = None,
    ):
        """``remote``: the cross-node tier (None: this daemon's sessions live here only); ``preloader``: moves
        sessions up ahead of their turns (None: none is, as with preload = "off"); ``media``: the projector's
        media by content (None: text only); ``frame_areas``: connections' shared memory for media."""
        self.model = model
        self.workers = workers  # the rpc workers the model is split across (None: all local)
        self.config = config
        self.kv = kv
        self.send = send
        self.daemon_version = daemon_version
        self.counters = Counters()
        self.scheduler = Scheduler(config, kv.sessions, model.step_tokens, model.attention_tile_rows)
        self.media, self.frame_areas = media, frame_areas
        self.received_bytes = received_bytes or (lambda: 0)  # counted by the I/O thread
        self.runner = Runner(model, self.scheduler.cost, media)
        self.step_log = step_log  # (the step_log setting; None: off)
        self.idle_cores = IdleSampler()
        self.threads = thread_count(config, model.threads, self.idle_cores)
        self.calibrated = self.scheduler.cost.calibrated()  # what steps cost at start; _calibrate measures it
        self.last_step_seconds = 0.0
        self.heartbeat = time.monotonic()
        self.frame_errors = frame_errors if frame_errors is not None else Counter()  # counted by the I/O thread
        # A request's clock starts at its arrival (the I/O thread's), not when the engine gets to it after the step
        # in flight; connections are served in turns (engine/intake.py).
        self.intake = Intake()
        self.stopping = threading.Event()
        self.started = time.monotonic()
        self.preloader = preloader if preloader is not None else Preloader(kv, "off", 0.0)
        self.remote: CrossNode = (
            RemoteRequests(remote, kv, self.preloader, self.submit) if remote is not None else NoRemote()
        )
        self.handlers = RequestHandlers(
            model,
            config,
            kv,
            self.scheduler,
            self.finish,
            self.status,
            daemon_version,
            self.remote,
            self.preloader,
            media,
            frame_areas,
        )
        self.housekeeping = Housekeeping(
            config,
            self.scheduler,
            kv,
            self.counters,
            self.cut,
            liveness or Liveness(0),  # kept by the I/O thread
            frame_areas,
        )

    # ------------------------------------------------------------------ loop

    def submit(self, client: bytes, request: p.AnyRequest) -> bool:
        """Called by the I/O thread: queue a request for the next step; False once the engine has stopped
        taking requests (the I/O thread then answers SHUTTING_DOWN itself)."""
        return self.intake.put(client, request)

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
        if self.scheduler.idle:
            self.idle_cores.engine_waited()
        self._take_requests(IDLE_WAIT_S if self.scheduler.idle else 0.0)
        self.housekeeping.run()
        if self.workers is not None:
            self.workers.check(idle=self.scheduler.idle)
        self.preloader.predict()
        self.remote.between_steps()
        if self.media is not None:
            self.media.poll()  # encodes beside the steps that ended: their media can be fed now
        step_work = next_work(self.scheduler, self.kv, self._refused_admission)
        if not step_work:
            if not self.scheduler.idle:  # its generations wait for their clients (or a slot): do not spin
                self.idle_cores.engine_waited()
                self._take_requests(PAUSED_WAIT_S)
            return
        # A step that feeds a promised first token's prompt carries no guessed rows: they would only lengthen it (and
        # the budgets' admission estimated it without them).
        if (
            self.config.draft_tokens
            and not step_work[0].item.feeds_medium  # (a medium's step feeds it alone)
            and not any(w.item.awaits_promised_first_token for w in step_work)
        ):
            step_work = with_drafts(
                step_work,
                self.model.step_tokens,
                self.model.draft_rows,
                self.scheduler.cost,
                self.scheduler.step_time_cap(),
                self.config.draft_min_tokens,
            )
        self.kv.room_for_step(sum(w.n_tokens + len(w.draft) for w in step_work))
        threads = self.threads.for_next_step(may_probe=not self.scheduler.first_token_due())
        lent = self.media is not None and self.media.busy  # an encode beside the steps takes a thread while it runs
        self.model.decode_with(threads - 1 if lent else threads)
        started, cpu = time.monotonic(), process_cpu_seconds()
        with self._laid_out(step_work):
            outcome = self.runner.run(step_work)
        if outcome.rc == 0 and not outcome.medium_error:
            if self.step_log is not None:
                predicted = self.scheduler.cost.predict(outcome.shape)  # (before _note_speed teaches it this step)
                self.step_log.write(step_work, outcome.tokens, outcome.seconds, predicted, outcome.shape.decodes)
            cores = (process_cpu_seconds() - cpu) / max(time.monotonic() - started, 1e-6)
            self._note_speed(threads, lent, outcome, cores)
        self._postprocess(step_work, outcome, started)

    def _laid_out(self, step_work: list[Work[Generation]]) -> AbstractContextManager[None]:
        """A step wider than deterministic steps are (a medium fed whole) runs with its session alone first in the
        KV (KvManager.alone_first): its sums then do not depend on where other sessions' cells sit."""
        if self.model.deterministic and sum(w.n_tokens for w in step_work) > self.model.step_tokens:
            return self.kv.alone_first(step_work[0].item.session)
        return contextlib.nullcontext()

    def _note_speed(self, threads: int, lent: bool, outcome: StepOutcome, cores: float) -> None:
        """The thread count learns the step's slowdown and the CPU its threads got; the cost model learns its time,
        unless it was a probe of another count (budgets plan for the count the steps run with)."""
        probe = self.threads.probing
        self.threads.observe(threads, outcome.seconds / self.calibrated.predict(outcome.shape), lent, cores)
        if not probe:
            self.scheduler.cost.update(outcome.shape, outcome.seconds)

    def _postprocess(self, step_work: list[Work[Generation]], outcome: StepOutcome, started: float) -> None:
        """Account for what the step fed, then stream each sampled token and end what must end."""
        now = time.monotonic()
        if outcome.medium_error:
            self._medium_failed(step_work[0].item, outcome.medium_error, now)
            return
        if outcome.rc == 1:
            self._kv_full(step_work, now)
            return
        if outcome.rc != 0:
            self._decode_failed(step_work, outcome.rc)
            return
        self.counters.decode_calls += 1
        if self.workers is not None:
            self.workers.note_step()
        self.counters.batch_tokens += outcome.batch_tokens
        # The KV now holds every fed token: record that for the whole step before anything can fail.
        for work in step_work:
            work.item.note_step(started)
            self.kv.fed(work.item.session, work.n_tokens)
            if work.item.completion_tokens == 0:  # fed before its first sampled token: prompt (or system prompt)
                self.counters.prompt_tokens += work.n_tokens
        for work in step_work:
            session = work.item.session
            if session.boundary and session.n_kv >= session.boundary:
                self._make_prefix(session)
        for work, run in zip(step_work, outcome.tokens, strict=True):
            if run:
                self._accept_run(work, run, now)
            elif work.completes and not work.item.samples:  # a prefill: its prompt is in the KV, nothing more
                self.finish(work.item, FinishReason.LENGTH, now)
        self.last_step_seconds = time.monotonic() - started
        self.counters.busy_seconds += self.last_step_seconds

    def _make_prefix(self, session: Session) -> None:
        """Its system prompt is in the KV now: share it from here on. Sharing is an optimisation: a failure
        costs the sharing, not the session."""
        try:
            self.kv.make_prefix(session)
        except Exception:
            log.exception("could not make a shared prefix from session %s", session.id)

    def _calibrate(self) -> None:
        """Start the cost model from this machine's speed (budgets need it; fcfs does not), and what an encode of
        each kind of medium takes. The vocabulary's byte table, which a grammar is asked about (the text it forces
        next; the best token it allows where it refused the likeliest ones), is read here too: it is a pass over the
        vocabulary (0.4 s for Gemma 3's 262k tokens), which the first constrained answer would otherwise pay between
        two of its steps, stalling every session's next token."""
        try:
            self.model.byte_tokens  # noqa: B018  (a cached property: read once, here)
        except Exception:  # the first constrained answer reads it again, with its reason
            log.exception("could not read the vocabulary's byte table")
        if self.media is not None:
            try:
                self.media.warm_up()
            except Exception:  # a projector that cannot encode shows at the first request, with its reason
                log.exception("the projector's warm-up encode failed")
        if not (self.config.calibrate and self.scheduler.policy.checks_budgets):
            return
        with self.kv.scratch_slot() as slot:
            if slot is not None:
                calibrate_on_slot(self.model, slot, self.scheduler.cost)
        self.calibrated = self.scheduler.cost.calibrated()

    def _take_requests(self, wait: float) -> None:
        for item in self.intake.take(wait):
            self._handle(*item)

    def _handle(self, client: bytes, request: p.AnyRequest, received_at: float) -> None:
        op = type(request).__struct_config__.tag
        self.counters.requests[op] += 1
        try:
            if self.stopping.is_set():
                raise RequestRefused(ErrorCode.SHUTTING_DOWN, "The daemon is stopping; retry after it restarts.")
            reply = self.handlers.by_type[type(request)](client, request, received_at)
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

    def _refused_admission(self, g: Generation, refused: RequestRefused) -> None:
        """A waiting generation the scheduler could not give a hot slot: it ends with the reason."""
        self._abandon(g, refused.code, refused.message)
        if refused.code == ErrorCode.SESSION_CORRUPT:
            self.kv.drop(g.session)

    # ------------------------------------------------------------------ tokens

    def _accept_run(self, work: Work[Generation], run: list[Sampled], now: float) -> None:
        """The tokens sampled for one work item, in order: each after the first was sampled from the row of the
        guessed token before it, which equals the token accepted before it, so that row's cell is computed. Cells
        past what the session holds then go, whatever happens (a stop, an error)."""
        g = work.item
        ended: FinishReason | None = None
        kept = len(run)  # the run's tokens the answer took (a stop ends it at one of them)
        try:
            for i, sampled in enumerate(run):
                if i:
                    self.kv.fed(g.session, 1)
                if (ended := self._accept(g, sampled, now)) is not None:
                    kept = i + 1
                    break
        finally:
            if work.draft:
                self.kv.trim(g.session)
        if work.draft and g.drafter is not None:  # (before the final message: its usage counts this run)
            # (the counters count what the answer kept: guesses sampling took after a stop are thrown away)
            if g.drafter.matched == FORCED:
                self.counters.jumped_tokens += kept - 1
            g.drafter.observe(len(work.draft), len(run) - 1, kept=kept - 1)
            self.counters.drafted_tokens += len(work.draft)
            self.counters.accepted_tokens += kept - 1
        if ended is not None:
            self.finish(g, ended, now, flushed=True)
        elif g.jumps == "append":
            self._jump(g, now)

    def _jump(self, g: Generation, now: float) -> None:
        """Append what ``g``'s grammar forces next, as if sampled (engine/jumps.py): the next step computes it as a
        chunk and samples after it."""
        room = g.draft_room  # (one token is left for the step to sample)
        for token in g.forced_tokens(self.model)[:-1][:room]:
            g.sampler.take(token)
            self.counters.jumped_tokens += 1
            if (ended := self._accept(g, Sampled(token), now)) is not None:
                self.finish(g, ended, now, flushed=True)
                return

    def _accept(self, g: Generation, sampled: Sampled, now: float) -> FinishReason | None:
        """A token was sampled for ``g``: append it to the session, stream it, and check the stop conditions.
        Why the generation ended with it (its text flushed; the caller finishes it), or None."""
        token = sampled.token
        logprobs = [sampled.logprob] if sampled.logprob is not None else None
        self.kv.append(g.session, [token])
        g.note_token(now)
        self.counters.generated_tokens += 1
        if g.completion_tokens == 1:
            self._record_first_token(g, now)
        if self.model.is_end_of_generation(token):
            g.ended_by_eog = True
            self.send(g.client, p.Chunk(id=g.request.id, text=g.text.flush(), tokens=[token], logprobs=logprobs))
            return FinishReason.STOP
        text = g.text.feed(self.model.token_bytes(token))
        reason = g.stop_reason()
        if reason is not None:
            text += g.text.flush()
        self.send(g.client, p.Chunk(id=g.request.id, text=text, tokens=[token], logprobs=logprobs))
        return reason

    def finish(
        self, g: Generation, reason: FinishReason, now: float, flushed: bool = False, checkpoint: bool = True
    ) -> None:
        """End a generation as asked (its end, its limit, its client's cancel): flush its text, checkpoint its
        session (by policy), then send its final message. The final message comes after the checkpoint, so a turn
        the client saw finish is never silently lost to a crash: when the checkpoint fails, the session is marked
        so that a crash evicts it instead."""
        self._end(g, now, flushed, checkpoint)
        self.counters.finished[reason.value] += 1
        self.send(g.client, g.final(reason, now))

    def cut(self, g: Generation, code: ErrorCode, message: str, now: float) -> None:
        """End a generation the daemon has to stop before it is done (it is stopping, the client is unreachable,
        the KV is full): as finish() does, but the last message is an Error whose detail says what the session
        kept, so that no client takes a cut answer for a finished one. One that never started is refused."""
        if not g.started:
            self._abandon(g, code, message)
            return
        # Text held back (a character's first bytes, the start of a stop string) is not sent: what it becomes is
        # not known yet. A continuation with text_from= holds it back the same way and sends it when it is.
        self._end(g, now, flushed=True, checkpoint=True)
        detail = p.cut_detail(g.completion_tokens, len(g.session.tokens))
        self.reply_error(g.client, g.request.id, code, message, detail)

    def _end(self, g: Generation, now: float, flushed: bool, checkpoint: bool) -> None:
        self.kv.trim(g.session)  # a guess's rows past its last token: its checkpoint must not hold them
        if not flushed and (rest := g.text.flush()):
            self.send(g.client, p.Chunk(id=g.request.id, text=rest, tokens=[]))
        self._release(g)
        g.session.last_used = now
        self.kv.touch(g.session)
        stats = self.scheduler.task_stats[g.session.task]
        stats.late_tokens += g.late_tokens
        if g.completion_tokens > 1 and g.first_token_at is not None and g.last_token_at is not None:
            stats.tpot_ms.add((g.last_token_at - g.first_token_at) * 1000.0 / (g.completion_tokens - 1))
        if checkpoint and self.config.checkpoint == "after_generate" and g.session.slot is not None:
            before = g.session.snapshot
            try:
                self.kv.checkpoint(g.session)
            except (RequestRefused, OSError) as exc:  # the session stays resident and usable, just not durable
                log.warning("checkpoint of session %s failed: %s", g.session.id, exc)
                if g.session.snapshot is before:  # (a failure after the commit, e.g. removing the old file, is not)
                    # Its older snapshot lacks this turn: a daemon restarted from it would answer the next turn as
                    # if this one never happened. Give it up, so that a crash before the next checkpoint evicts.
                    self.kv.give_up_snapshot(g.session)

    def _record_first_token(self, g: Generation, now: float) -> None:
        stats = self.scheduler.task_stats[g.session.task]
        ttft_ms = (now - g.arrival) * 1000.0
        stats.ttft_ms.add(ttft_ms)
        if g.ttft_s and ttft_ms > g.ttft_s * 1000.0:
            stats.deadline_misses += 1
            stats.lateness_ms += ttft_ms - g.ttft_s * 1000.0

    def _release(self, g: Generation) -> None:
        g.sampler.free()
        g.release_media()
        self.scheduler.remove(g)

    def _abandon(self, g: Generation, code: ErrorCode, message: str) -> None:
        """End a generation with an error and no checkpoint: a refusal when it had not started, else a cut (its
        detail says what the session holds)."""
        self._release(g)
        detail = p.cut_detail(g.completion_tokens, len(g.session.tokens)) if g.started else None
        self.reply_error(g.client, g.request.id, code, message, detail)

    def _kv_full(self, step_work: list[Work[Generation]], now: float) -> None:
        """llama_decode found no free cells in the unified KV (state unchanged): hibernate idle sessions to make
        room and retry next step; if none is idle, the generation with the most context is cut (KV_FULL)."""
        self.counters.kv_full_events += 1
        try:
            if self.kv.free_cells(exclude=[w.item.session for w in step_work], count=max(1, len(step_work))):
                return
        except RequestRefused as refused:
            log.warning("could not hibernate idle sessions to free KV cells: %s", refused.message)
        victim = max((w.item for w in step_work), key=lambda g: len(g.session.tokens))
        log.warning(
            "unified KV is full (%d cells): stopping the generation of session %s",
            self.model.context_size,
            victim.session.id,
        )
        self.cut(
            victim,
            ErrorCode.KV_FULL,
            f"The unified KV ({self.model.context_size} cells) filled up and no idle session could give way, so this "
            f"answer was stopped after {victim.completion_tokens} tokens (the session keeps them). Retry when other "
            "generations have finished, or give the daemon a larger context_size.",
            now,
        )

    def _medium_failed(self, g: Generation, why: str, now: float) -> None:
        """A medium of the prompt could not be encoded: the generation ends with the reason, and the session lets
        go of the prompt's cells not computed yet (nothing could compute them)."""
        log.warning("session %s: %s", g.session.id, why)
        self._release(g)
        self.kv.forget_uncomputed(g.session)
        self.reply_error(
            g.client,
            g.request.id,
            ErrorCode.INTERNAL,
            f"llama.cpp could not encode a medium of this prompt ({why}); the session keeps what it computed before "
            "it, and nothing after. Retry, or report the file.",
            p.cut_detail(g.completion_tokens, len(g.session.tokens)),
        )

    def _decode_failed(self, step_work: list[Work[Generation]], rc: int) -> None:
        """A fatal decode error: the KV of these sessions is in an unknown state, so they are closed."""
        log.error("llama_decode failed with %d; closing the %d sessions of that step", rc, len(step_work))
        for work in step_work:
            g = work.item
            self._abandon(
                g,
                ErrorCode.INTERNAL,
                f"llama.cpp failed to decode (code {rc}); this session was closed, open a new one.",
            )
            self.kv.drop(g.session)

    def _fail_all(self) -> None:
        for g in self.scheduler.generations():
            self._abandon(
                g,
                ErrorCode.INTERNAL,
                "The daemon hit an internal error during this generation; it is logged, retry it.",
            )

    def _shut_down(self) -> None:
        now = time.monotonic()
        for g in list(self.scheduler.running):
            self.cut(
                g,
                ErrorCode.SHUTTING_DOWN,
                f"The daemon is stopping, so this answer was stopped after {g.completion_tokens} tokens (the "
                "session keeps them); resume the session once the daemon is back and continue it.",
                now,
            )
        for g in list(self.scheduler.waiting):
            self._abandon(g, ErrorCode.SHUTTING_DOWN, "The daemon is stopping; retry after it restarts.")
        # A clean stop loses nothing: every resident session is checkpointed, whatever the policy.
        for s in list(self.kv.resident.values()):
            if not s.checkpoint_fresh:
                try:
                    self.kv.checkpoint(s)
                except (RequestRefused, OSError) as exc:
                    log.error("could not checkpoint session %s at stop: %s", s.id, exc)
        for client, request, _ in self.intake.close():  # from here on the I/O thread answers new requests itself
            self.reply_error(
                client, request.id, ErrorCode.SHUTTING_DOWN, "The daemon is stopping; retry after it restarts."
            )

    def summary(self) -> str:
        """One line for systemd's STATUS= (read from the watchdog thread: plain counts only)."""
        return (
            f"{len(self.kv.sessions.by_id)} sessions ({len(self.kv.resident)} hot), "
            f"{len(self.scheduler.running)} generating, {len(self.scheduler.waiting)} waiting, "
            f"{self.counters.generated_tokens} tokens generated"
        )

    # ------------------------------------------------------------------ status

    def status(self) -> DaemonStatus:
        status = status_of(
            daemon_version=self.daemon_version,
            started=self.started,
            heartbeat=self.heartbeat,
            config=self.config,
            model=self.model,
            kv=self.kv,
            scheduler=self.scheduler,
            counters=self.counters,
            frame_errors=self.frame_errors,
            rpc_workers=self.workers.status() if self.workers is not None else [],
        )
        status.counters.received_bytes = self.received_bytes()
        status.preload = self.preloader.status()
        status.remote = self.remote.status()
        status.cpu = self.threads.status()
        status.drafts = DraftStatus(
            most_tokens=self.config.draft_tokens,
            least_tokens=self.config.draft_min_tokens,
            ngram=self.config.draft_ngram,
            jump_forward=self.config.jump_forward,
        )
        if self.media is not None:
            status.media = msgspec.structs.replace(
                self.media.status(), frame_areas=len(self.frame_areas) if self.frame_areas is not None else 0
            )
        return status
