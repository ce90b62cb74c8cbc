"""What each request does to the engine's state. Runs on the engine thread, between steps.

A handler returns its reply, or None when the reply comes later (a generation streams chunks and a final
message). Refusals raise RequestRefused; the engine turns them into Error messages.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from functools import partial

from kvpool import protocol as p
from kvpool.daemon.config import Config
from kvpool.daemon.engine.drafts import Drafter
from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.jumps import jump_mode
from kvpool.daemon.engine.replies import session_opened
from kvpool.daemon.engine.scheduler import Scheduler
from kvpool.daemon.engine.stream_text import StreamText
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.llama.constraints import ConstraintError, parse_schema
from kvpool.daemon.llama.model import (
    SAMPLER_FIELDS,
    Grammar,
    GrammarError,
    Model,
    SamplingParams,
    json_schema_grammar,
)
from kvpool.daemon.media.frame_areas import FrameAreas
from kvpool.daemon.media.media_cache import MediaCache
from kvpool.daemon.media.prompts import MediaPrompt, media_prompt
from kvpool.daemon.preload.preloader import Preloader
from kvpool.daemon.refusals import RequestRefused
from kvpool.daemon.remote.interface import CrossNode, Handler
from kvpool.protocol import ErrorCode, FinishReason
from kvpool.protocol.status import DaemonStatus

log = logging.getLogger("kvpool.engine")


Finish = Callable[..., None]  # Engine.finish(g, reason, now, checkpoint=...)
MULTIPLEXERS_KEPT = 1024


class RequestHandlers:
    def __init__(
        self,
        model: Model,
        config: Config,
        kv: KvManager,
        scheduler: Scheduler,
        finish: Finish,
        status: Callable[[], DaemonStatus],
        daemon_version: str,
        remote: CrossNode,
        preloader: Preloader,
        media: MediaCache | None = None,
        frame_areas: FrameAreas | None = None,
    ):
        """``remote``: the cross-node tier (NoRemote without one); ``preloader``: told of hints and turns;
        ``media``: the projector's media by content (None: text only); ``frame_areas``: connections' shared
        memory for media (None: media come as bytes in the message only)."""
        self.model, self.config, self.kv, self.scheduler = model, config, kv, scheduler
        self.remote, self.preloader = remote, preloader
        self.media, self.frame_areas = media, frame_areas
        self.sessions = kv.sessions
        self.finish, self._status, self.daemon_version = finish, status, daemon_version
        self._multiplexers: dict[bytes, None] = {}  # connections that said they multiplex users, oldest first
        self.by_type: dict[type, Handler] = {
            p.Hello: self.hello,
            p.Status: self.status,
            p.ListSessions: self.list_sessions,
            p.OpenSession: self.open,
            p.ResumeSession: self.resume,
            p.Prefetch: self.prefetch,
            p.CloseSession: self.close,
            p.Cancel: self.cancel,
            p.History: self.history,
            p.Tokenize: self.tokenize,
            p.Detokenize: self.detokenize,
            p.Generate: self.generate,
            p.Migrate: remote.migrate,
            p.FrameArea: self.frame_area,
            **remote.internal,
        }

    def hello(self, client: bytes, r: p.Hello, received_at: float) -> p.Reply:
        if r.version != p.PROTOCOL_VERSION:
            raise RequestRefused(
                ErrorCode.VERSION_MISMATCH,
                f"This daemon speaks protocol {p.PROTOCOL_VERSION}, the client {r.version}; "
                "install matching kvpool versions.",
            )
        if r.multiplexer:
            self._multiplexers[client] = None
            while len(self._multiplexers) > MULTIPLEXERS_KEPT:  # identities of connections long gone
                del self._multiplexers[next(iter(self._multiplexers))]
        return p.HelloReply(
            id=r.id,
            version=p.PROTOCOL_VERSION,
            daemon_version=self.daemon_version,
            model=self.model.description,
            max_message_bytes=self.config.max_message_bytes,
            max_inflight=self._inflight_limit(client),
        )

    def _inflight_limit(self, client: bytes) -> int:
        if client in self._multiplexers:
            return self.config.max_inflight_per_multiplexer
        return self.config.max_inflight_per_client

    def status(self, client: bytes, r: p.Status, received_at: float) -> p.Reply:
        return p.StatusReply(id=r.id, status=self._status())

    def list_sessions(self, client: bytes, r: p.ListSessions, received_at: float) -> p.Reply:
        now = time.monotonic()
        infos = [
            p.SessionInfo(
                session=s.id,
                task=s.task,
                tier=s.tier,
                context_tokens=len(s.tokens),
                snapshot_bytes=s.snapshot_bytes,
                checkpoint_version=s.snapshot.version if s.snapshot else 0,
                busy=s.busy,
                idle_s=round(now - s.last_used, 3),
                age_s=round(now - s.created, 3),
                shared_tokens=s.prefix_len if s.prefix is not None else 0,
                saved=(s.snapshot.n_tokens if s.snapshot else 0) == len(s.tokens),
                kv_type=self.kv.kv_type_name(s.snapshot) if s.snapshot and s.snapshot.n_kv else "",
                remote=self.remote.where(s),
            )
            for s in self.sessions.by_id.values()
        ]
        return p.SessionsReply(id=r.id, sessions=infos)

    def open(self, client: bytes, r: p.OpenSession, received_at: float) -> p.Reply:
        if self.scheduler.over_memory:
            raise RequestRefused(
                ErrorCode.OVERLOADED,
                "The daemon's memory is above its memory_high_water; close sessions or retry later.",
            )
        try:
            self.sessions.check_can_open(r.task)  # first: the system prompt may come from the task's profile
        except RequestRefused as refused:
            if r.task in self.config.tasks:  # (a task's own quota: its refusals column counts it)
                self.scheduler.count_refusal(r.task, refused.code)
            raise
        system = self._system_prompt(client, r)
        try:
            s = self.kv.open(
                secrets.token_hex(8),
                secrets.token_hex(16),
                r.task,
                tokens=system.tokens,
                boundary=len(system.tokens),
                media=system.media,
            )
        except BaseException:
            system.release()
            raise
        if system.tokens:
            self.kv.record_tokens(s)
        for _, piece in system.media:
            assert self.media is not None
            self.media.start(piece)
        log.info("session %s opened for task %s", s.id, s.task)
        return session_opened(r.id, s)

    def _system_prompt(self, client: bytes, r: p.OpenSession) -> MediaPrompt:
        """The tokens a new session starts with: the request's system prompt, else its task's configured one."""
        given = [r.system_prompt is not None, r.system_prompt_tokens is not None, r.system_parts is not None]
        if sum(given) > 1:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                "Send one of `system_prompt`, `system_prompt_tokens` and `system_parts`, not several.",
            )
        limit = self.sessions.context_limit(r.task)
        if r.system_parts is not None:
            prompt = self._parts(client, r.system_parts, starts_session=True)
        elif r.system_prompt_tokens is not None:
            prompt = MediaPrompt(self._checked_tokens(r.system_prompt_tokens))
        else:
            text = r.system_prompt
            if text is None:
                text = self.config.tasks[r.task].system_prompt
            prompt = MediaPrompt(self._tokenized(text, limit - 1, "system prompt", add_bos=True) if text else [])
        tokens = prompt.tokens
        if len(tokens) >= limit:
            prompt.release()
            configured = not any(given)  # (the client sent none: the task's own is too long for its sessions)
            whose = (
                f"Task {r.task!r}'s configured system_prompt (tasks.{r.task}.system_prompt)"
                if configured
                else "The system prompt"
            )
            raise RequestRefused(
                ErrorCode.CONTEXT_OVERFLOW,
                f"{whose} is {len(tokens)} tokens; task {r.task!r} sessions hold at most {limit - 1} before their "
                f"first answer. Shorten it{' in the config' if configured else ''}.",
                {"prompt_tokens": len(tokens), "context_limit": limit},
            )
        return prompt

    def _parts(self, client: bytes, parts: list[str | list[int] | p.Medium], starts_session: bool) -> MediaPrompt:
        def area_bytes(name: str, offset: int, length: int) -> bytes:
            if self.frame_areas is None:
                raise RequestRefused(ErrorCode.BAD_REQUEST, "This daemon gives no frame areas; send media as `data`.")
            return self.frame_areas.read(client, name, offset, length)

        return media_prompt(
            parts,
            self.media,
            lambda text, bos: (
                self._tokenized(text, self.model.context_size, "prompt", add_bos=bos) if text or bos else []
            ),
            self._checked_tokens,
            area_bytes,
            starts_session,
            self.config.max_media_bytes,
        )

    def frame_area(self, client: bytes, r: p.FrameArea, received_at: float) -> p.Reply:
        if self.frame_areas is None:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                "This daemon gives no frame areas (it serves tcp:// only, or reads text only); send media as `data`.",
            )
        area = self.frame_areas.area_for(client, r.size)
        return p.FrameAreaReply(id=r.id, name=area.name, size=area.size)

    def resume(self, client: bytes, r: p.ResumeSession, received_at: float) -> p.Reply | None:
        try:
            s = self._used(r.session, r.token)
        except RequestRefused as refused:
            missing = refused.code in (ErrorCode.UNKNOWN_SESSION, ErrorCode.SESSION_EVICTED)
            if missing and self.remote.fetch(client, r, prefetch=r.prefetch, answer_prefetched=False):
                return None  # the reply comes when the fetch ends
            raise
        self.remote.check_owned(s)
        if r.prefetch:
            self.preloader.hint(s)
        return session_opened(r.id, s)

    def prefetch(self, client: bytes, r: p.Prefetch, received_at: float) -> p.Reply | None:
        here = r.session in self.sessions.by_id or r.session in self.sessions.evicted
        if not here and self.remote.fetch(client, r, prefetch=True, answer_prefetched=True):
            return None  # the reply comes when the fetch ends
        s = self.sessions.get(r.session, r.token)
        self.remote.check_owned(s)
        return p.Prefetched(id=r.id, session=s.id, tier=self.preloader.hint(s))

    def tokenize(self, client: bytes, r: p.Tokenize, received_at: float) -> p.Reply:
        tokens = self._tokenized(r.text, self.model.context_size, "text", add_bos=r.add_bos, special=r.special)
        return p.TokensReply(id=r.id, tokens=tokens)

    def detokenize(self, client: bytes, r: p.Detokenize, received_at: float) -> p.Reply:
        if len(r.tokens) > self.model.context_size:  # (no session holds more; and the engine waits for it)
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"{len(r.tokens)} tokens are more than a context holds ({self.model.context_size}); detokenize them "
                "in pieces.",
            )
        return p.TextReply(id=r.id, text=self.model.detokenize(self._checked_tokens(r.tokens)))

    def history(self, client: bytes, r: p.History, received_at: float) -> p.Reply:
        s = self._used(r.session, r.token)
        return p.HistoryReply(id=r.id, tokens=s.tokens[r.start :], context_tokens=len(s.tokens))

    def _used(self, session: str, token: str) -> Session:
        """A session a request names: in use from now on (session_timeout counts from its last request)."""
        s = self.sessions.get(session, token)
        s.last_used = time.monotonic()
        self.kv.touch(s)
        return s

    def close(self, client: bytes, r: p.CloseSession, received_at: float) -> p.Reply:
        s = self.sessions.get(r.session, r.token)
        g = self.scheduler.generation_of(s)
        if g is not None:  # no checkpoint: the session is about to go
            self.finish(g, FinishReason.CANCELLED, time.monotonic(), checkpoint=False)
        self.kv.drop(s)
        self.remote.closed(s)
        return p.Closed(id=r.id, session=s.id)

    def cancel(self, client: bytes, r: p.Cancel, received_at: float) -> p.Reply:
        s = self._used(r.session, r.token)
        g = self.scheduler.generation_of(s)
        if g is None:
            return p.Cancelled(id=r.id, cancelled=False)
        self.finish(g, FinishReason.CANCELLED, time.monotonic())
        return p.Cancelled(id=r.id, cancelled=True, completion_tokens=g.completion_tokens)

    def generate(self, client: bytes, r: p.Generate, received_at: float) -> None:
        if r.session not in self.sessions.by_id:
            self.remote.check_gone(r.session, r.token)  # dropped here for the node that owns it now: CONFLICT
        s = self.sessions.get(r.session, r.token)
        self.remote.check_owned(s)
        if s.busy:
            raise RequestRefused(
                ErrorCode.SESSION_BUSY, f"Session {s.id} is still generating; wait for its final message or cancel it."
            )
        if r.after is not None and r.after != len(s.tokens):
            raise RequestRefused(
                ErrorCode.CONFLICT,
                f"Session {s.id} holds {len(s.tokens)} tokens, the request expected {r.after}: another request "
                "changed it (was this turn already applied?); read Session.history() and decide.",
                {"context_tokens": len(s.tokens), "after": r.after},
            )
        self._check_quota(s)
        if r.id and any(g.client == client and g.request.id == r.id for g in self.scheduler.generations()):
            raise RequestRefused(  # (their chunks would carry one id, and the client could not tell them apart)
                ErrorCode.BAD_REQUEST,
                f"Request id {r.id} is already a generation in flight on this connection; give each request its "
                "own id.",
            )
        in_flight = self.scheduler.in_flight_for(client)
        limit = self._inflight_limit(client)
        if in_flight >= limit:
            setting = "max_inflight_per_multiplexer" if client in self._multiplexers else "max_inflight_per_client"
            raise RequestRefused(
                ErrorCode.OVERLOADED,
                f"This connection already has {in_flight} generations in flight ({setting}={limit}); "
                "wait for one to finish.",
            )
        prompt = self._prompt(client, r, s)
        try:
            self._queue(client, r, s, prompt, received_at)
        except BaseException:
            prompt.release()
            raise
        return None  # the reply is the stream of chunks and the final message

    def _queue(self, client: bytes, r: p.Generate, s: Session, prompt: MediaPrompt, received_at: float) -> None:
        """The generation of ``prompt`` on ``s``, admitted and queued (or RequestRefused, nothing applied)."""
        new = prompt.tokens
        most = self.config.max_prompt_tokens
        if most and len(new) > most:
            raise RequestRefused(
                ErrorCode.CONTEXT_OVERFLOW,
                f"The prompt is {len(new)} tokens; this daemon accepts at most max_prompt_tokens={most} per request.",
                {"prompt_tokens": len(new), "max_prompt_tokens": most},
            )
        if not new and s.pending_tokens == 0:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                "The prompt is empty and the session has nothing to continue from; send some text.",
            )
        room = s.context_limit - len(s.tokens) - 1  # one place is kept for at least one generated token
        if room < 0:
            raise RequestRefused(
                ErrorCode.CONTEXT_OVERFLOW,
                f"Session {s.id} is full: it holds {len(s.tokens)} tokens, its context limit "
                f"({s.context_limit}); nothing more can be generated in it, open a new session.",
                {"prompt_tokens": len(new), "room": 0, "context_limit": s.context_limit},
            )
        if len(new) > room:
            raise RequestRefused(
                ErrorCode.CONTEXT_OVERFLOW,
                f"The prompt is {len(new)} tokens but the session has room for {max(room, 0)} more "
                f"(context limit {s.context_limit}); shorten the prompt or open a new session.",
                {"prompt_tokens": len(new), "room": max(room, 0), "context_limit": s.context_limit},
            )
        to_compute = len(new) + s.pending_tokens
        if s.n_kv == 0 and s.prefix is None:  # the part a shared prefix holds will not be computed
            to_compute -= self.kv.shared_prefix_length(s.tokens + new)
        params = self._sampling(r)
        predicted = self._prediction(r, room - len(new) + 1)
        replay = self._replay(r, s.tokens + new)
        text = self._text(r, s.tokens + new)  # refused (text_from out of range) before a sampler is built
        encodes = sum(self.media.expected_seconds(piece) for _, piece in prompt.media) if self.media else 0.0
        budget = self.scheduler.admit(s, r.deadline_ms, to_compute, received_at, encodes, self._slot_at_hand(s))
        try:
            sampler = self.model.new_sampler(params, s.tokens + new, replay)
        except GrammarError as exc:
            raise RequestRefused(ErrorCode.BAD_REQUEST, str(exc)) from None
        g = Generation(
            client=client,
            request=r,
            session=s,
            sampler=sampler,
            prompt_tokens=len(new),
            text=text,
            new_tokens=new,
            media=prompt.media,
            arrival=received_at,
            ttft_s=budget.ttft_s,
            tpot_s=budget.tpot_s,
            best_effort=budget.best_effort,
            priority=budget.priority,
            drafter=self._drafter(s) if self.config.draft_tokens else None,
            jumps=self._jumps(sampler.constrained, r),
        )
        if g.jumps == "guess" and g.drafter is not None:
            g.drafter.forced, g.drafter.piece = partial(g.forced_tokens, self.model), self.model.token_bytes
        if predicted and g.drafter is not None:
            g.drafter.predict(predicted, lead=[*s.tokens[-self.config.draft_ngram :], *new])
        s.last_used = g.arrival
        self.scheduler.add(g)
        for _, piece in prompt.media:  # (beside the steps, from now on; the step that feeds it waits for it)
            assert self.media is not None
            self.media.start(piece)
        self.preloader.turn(s)

    def _drafter(self, s: Session) -> Drafter:
        """Guesses from the session's whole conversation, this turn's prompt included once it joins it."""
        return Drafter(s.tokens, self.config.draft_ngram, self.config.draft_tokens, self.model.is_end_of_generation)

    def _jumps(self, constrained: bool, r: p.Generate) -> str:
        """How the generation's forced text goes (engine/jumps.py)."""
        setting = self.config.jump_forward if constrained else "off"
        return jump_mode(setting, self.config.draft_tokens, logprobs=r.logprobs is not None)

    def _sampling(self, r: p.Generate) -> SamplingParams:
        self._checked_tokens([*r.logit_bias, *r.grammar_trigger_tokens])
        # The request's sampler fields carry SamplingParams' names (tests/test_protocol.py checks they match).
        same = {name: getattr(r, name) for name in SAMPLER_FIELDS if name not in ("logit_bias", "grammar")}
        return SamplingParams(**same, logit_bias=tuple(sorted(r.logit_bias.items())), grammar=self._grammar(r))

    def _grammar(self, r: p.Generate) -> Grammar | None:
        """The request's grammar: its GBNF, or the one its JSON schema converts to (BAD_REQUEST with the reason
        when the schema uses what a grammar cannot enforce)."""
        if r.grammar is not None and r.json_schema is not None:
            raise RequestRefused(ErrorCode.BAD_REQUEST, "Send either `grammar` or `json_schema`, not both.")
        if r.grammar is None and r.json_schema is None:
            if r.grammar_trigger_words or r.grammar_trigger_tokens or r.grammar_from is not None:
                raise RequestRefused(
                    ErrorCode.BAD_REQUEST, "Grammar triggers and `grammar_from` need a `grammar` or `json_schema`."
                )
            return None
        try:
            text = r.grammar if r.grammar is not None else json_schema_grammar(parse_schema(r.json_schema or ""))
        except (ConstraintError, GrammarError) as exc:
            raise RequestRefused(ErrorCode.BAD_REQUEST, str(exc)) from None
        return Grammar(text, tuple(r.grammar_trigger_words), tuple(r.grammar_trigger_tokens))

    def _text(self, r: p.Generate, tokens: list[int]) -> StreamText:
        """The generation's text stream; with ``text_from``, fed the tokens from there on without sending their
        text, so that it holds back what the answer it continues held back when it was cut."""
        text = StreamText(r.stop)
        if r.text_from is not None:
            if r.text_from > len(tokens):
                raise RequestRefused(
                    ErrorCode.BAD_REQUEST,
                    f"`text_from` is {r.text_from} but the session (with this prompt) holds {len(tokens)} tokens; "
                    "give the position where the answer being continued started.",
                )
            for token in tokens[r.text_from :]:
                if token >= 0:  # (a medium's cells stand as negative ids: they have no text)
                    text.feed(self.model.token_bytes(token))
        return text

    @staticmethod
    def _replay(r: p.Generate, tokens: list[int]) -> list[int]:
        if r.grammar_from is None:
            return []
        if r.grammar_from > len(tokens):
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"`grammar_from` is {r.grammar_from} but the session (with this prompt) holds {len(tokens)} tokens; "
                "give the position where the constrained answer started.",
            )
        replay = tokens[r.grammar_from :]
        if any(token < 0 for token in replay):
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"`grammar_from` {r.grammar_from} lies before a medium of the session; give the position where the "
                "constrained answer started (after the prompt).",
            )
        return replay

    def _slot_at_hand(self, s: Session) -> bool:
        """Whether ``s`` can have a hot slot at once: its own, a free one, an idle session's, or a best-effort
        generation's that a deadline-bound one may swap out."""
        if s.slot is not None or self.kv.free_slot_count or self.kv.idle_resident():
            return True
        return self.scheduler.policy.preempts and any(g.best_effort for g in self.scheduler.running)

    def _check_quota(self, s: Session) -> None:
        profile = self.config.tasks.get(s.task)  # a recovered session's task may have left the config
        quota = profile.pool_quota if profile is not None else 0
        if not quota:
            return
        held = sum(x.snapshot_bytes for x in self.sessions.by_id.values() if x.task == s.task)
        if held >= quota:
            self.scheduler.count_refusal(s.task, ErrorCode.QUOTA_EXCEEDED)
            raise RequestRefused(
                ErrorCode.QUOTA_EXCEEDED,
                f"Task {s.task!r} holds {held} bytes of session snapshots, at or over its pool_quota of {quota}; "
                "close some of its sessions or raise the quota.",
                {"held_bytes": held, "pool_quota": quota},
            )

    def _prompt(self, client: bytes, r: p.Generate, s: Session) -> MediaPrompt:
        if sum([bool(r.prompt), r.prompt_tokens is not None, r.parts is not None]) > 1:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST, "Send one of `prompt`, `prompt_tokens` and `parts`, not several."
            )
        if r.parts is not None:
            return self._parts(client, r.parts, starts_session=not s.tokens)
        if r.prompt_tokens is not None:
            return MediaPrompt(self._checked_tokens(r.prompt_tokens))
        room = s.context_limit - len(s.tokens) - 1
        if self.config.max_prompt_tokens:
            room = min(room, self.config.max_prompt_tokens)
        return MediaPrompt(self._tokenized(r.prompt, room, "prompt", add_bos=not s.tokens))

    def _prediction(self, r: p.Generate, room: int) -> list[int]:
        """The tokens of the request's prediction ([] without one), or RequestRefused where it cannot be used:
        ``room``, the most tokens the answer can have in the session's context, bounds it (a longer one cannot be
        the answer, and indexing it costs the steps about 7 us a token)."""
        if r.prediction is None and r.prediction_tokens is None:
            return []
        if r.prediction is not None and r.prediction_tokens is not None:
            raise RequestRefused(ErrorCode.BAD_REQUEST, "Send one of `prediction` and `prediction_tokens`, not both.")
        if not self.config.draft_tokens:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                "This daemon runs without guesses (draft_tokens = 0), so a prediction would do nothing; leave it "
                "out, or set draft_tokens above 0.",
            )
        if r.max_tokens == 0:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                "A prefill (max_tokens 0) generates nothing for a prediction to guess; leave the prediction out.",
            )
        if r.prediction_tokens is not None:
            predicted = self._checked_tokens(r.prediction_tokens)
        else:
            predicted = self._tokenized(r.prediction or "", room, "prediction", add_bos=False)
        if len(predicted) > room:
            raise RequestRefused(
                ErrorCode.CONTEXT_OVERFLOW,
                f"The prediction is {len(predicted)} tokens but the answer has room for {room} at most (the "
                "session's context limit); send the part of it the answer can hold.",
                {"prediction_tokens": len(predicted), "room": room},
            )
        return predicted

    def _tokenized(self, text: str, room: int, what: str, *, add_bos: bool, special: bool = False) -> list[int]:
        """``text`` as tokens; refused at once (CONTEXT_OVERFLOW) when its bytes could not be ``room`` tokens even
        at the vocabulary's longest piece a token. llama.cpp's tokenizer takes time that grows faster than the text
        on some vocabularies (23 s for 300k characters of the test model's byte-level one), and every session's
        next step waits for it."""
        size = len(text.encode("utf-8", errors="surrogatepass"))
        longest = self.model.longest_piece
        if size > (max(room, 0) + 1) * longest:
            raise RequestRefused(
                ErrorCode.CONTEXT_OVERFLOW,
                f"The {what} is {size} bytes, more than {max(room, 0)} tokens can hold (this model's tokens stand for "
                f"{longest} bytes at most); shorten it.",
                {"prompt_bytes": size, "room": max(room, 0)},
            )
        return self.model.tokenize(text, add_bos=add_bos, special=special)

    def _checked_tokens(self, tokens: list[int]) -> list[int]:
        bad = [t for t in tokens if not self.model.valid_token(t)]
        if bad:
            raise RequestRefused(
                ErrorCode.BAD_REQUEST,
                f"Token ids {bad[:5]} are outside this model's vocabulary of "
                f"{self.model.n_vocab}; tokenize with the daemon's model.",
            )
        return list(tokens)
