"""One running `generate` request: its sampler, its text stream, its stop conditions and its timings."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.daemon.engine.drafts import Drafter
from kvpool.daemon.engine.jumps import CONTEXT_TOKENS, JUMP_BYTES, Tokens, forced_after
from kvpool.daemon.engine.stream_text import StreamText
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.llama.model import Sampler
from kvpool.daemon.media.media_cache import MediaPiece
from kvpool.protocol import Final, FinishReason, Generate, Timings, Usage


@dataclass(eq=False)
class Generation:
    client: bytes  # ZeroMQ identity of the requesting connection
    request: Generate
    session: Session
    sampler: Sampler
    prompt_tokens: int
    text: StreamText
    new_tokens: list[int] = field(default_factory=list)  # the prompt, appended to the session once it runs
    # Where the prompt's media begin among new_tokens, each pinned in the media cache: the session takes them over
    # with the prompt (a generation that never starts lets go of them).
    media: list[tuple[int, MediaPiece]] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    completion_tokens: int = 0
    first_step_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Budgets from the task's profile (tightened by the request's deadline_ms); 0 means none.
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    best_effort: bool = False
    priority: int = 0
    late_tokens: int = 0  # tokens that came later than tpot_s after the previous one
    ended_by_eog: bool = False  # its last token was the model's end-of-generation token
    restore_seconds_at: float = -1.0  # the session's restore_seconds at arrival (set by __post_init__)
    restore_ms: float = 0.0  # what of its time to first token went into making the session hot
    started: bool = False  # its prompt went into the session (an end now is a cut, not a refusal)
    paused: bool = False  # its client has replies waiting (serve/liveness.py): no step feeds it until it reads
    drafter: Drafter | None = None  # guesses its next tokens from its context (None: it decodes one a step)
    jumps: str = "off"  # what its grammar forces next: "append"ed unsampled, "guess"ed, or sampled (engine/jumps.py)

    def __post_init__(self) -> None:
        self.restore_seconds_at = self.session.restore_seconds

    @property
    def samples(self) -> bool:
        """False for a prefill (max_tokens 0): its last chunk needs no logits, and it ends once that is fed."""
        return self.request.max_tokens > 0

    @property
    def awaits_promised_first_token(self) -> bool:
        """Its task promised a first token within a budget (not best effort), and it is not out yet."""
        return bool(self.ttft_s) and not self.best_effort and self.samples and self.first_token_at is None

    @property
    def pending_tokens(self) -> int:
        return self.session.pending_tokens

    @property
    def feedable_tokens(self) -> int:
        return self.session.feedable_tokens

    @property
    def position(self) -> int:
        return self.session.n_kv

    @property
    def draft_room(self) -> int:
        """Guessed tokens a step may feed after its pending one: the step samples one token more than it guesses,
        within the answer's token limit and the session's context."""
        s = self.session
        left = min(self.request.max_tokens - self.completion_tokens, s.context_limit - len(s.tokens))
        return max(0, left - 1)

    @property
    def admitted(self) -> Callable[[list[int]], list[int]] | None:
        """The part of a guess its grammar admits (a guess past it would be refused by sampling anyway); None
        without a grammar: all of it."""
        return self._admitted if self.sampler.constrained else None

    def _admitted(self, guess: list[int]) -> list[int]:
        return guess[: self.sampler.admitted(guess)]

    def forced_tokens(self, model: Tokens) -> list[int]:
        """The tokens of what its grammar forces next, in its answer's context, as far as the tokenizer spells that
        text as the grammar does ([] when nothing is forced, or the boundary would move: engine/jumps.py)."""
        forced = self.sampler.forced(JUMP_BYTES)
        if not forced:
            return []
        context = self.session.tokens[-min(CONTEXT_TOKENS, self.completion_tokens) :]
        return forced_after(context, forced, model)

    @property
    def feeds_medium(self) -> bool:
        return self.session.feeds_medium

    @property
    def medium_ready(self) -> bool:
        """Its next medium can be fed now (not waiting for its encode beside the steps)."""
        return not self.session.feeds_medium or self.session.medium_ahead()[1].ready

    @property
    def medium_seconds(self) -> float:
        """What its next feed costs before its rows are decoded: the medium's encode, unless it is encoded."""
        if not self.session.feeds_medium:
            return 0.0
        return self.session.medium_ahead()[1].expected_seconds

    def release_media(self) -> None:
        """The generation ends without having started: its prompt's media are not held for it any more."""
        for _, piece in self.media:
            piece.pins -= 1
        self.media = []

    @property
    def deadline(self) -> float:
        """When the next token is due: the first within ttft_s of arrival, each next within tpot_s."""
        if self.first_token_at is None:
            return self.arrival + self.ttft_s if self.ttft_s else math.inf
        assert self.last_token_at is not None
        return self.last_token_at + self.tpot_s if self.tpot_s else math.inf

    def note_step(self, now: float) -> None:
        if self.first_step_at is None:
            self.first_step_at = now

    def note_token(self, now: float) -> None:
        if self.tpot_s and self.last_token_at is not None and now - self.last_token_at > self.tpot_s:
            self.late_tokens += 1
        self.completion_tokens += 1
        if self.first_token_at is None:
            self.first_token_at = now
            self.restore_ms = round((self.session.restore_seconds - self.restore_seconds_at) * 1000.0, 3)
        self.last_token_at = now

    def stop_reason(self) -> FinishReason | None:
        """Why the generation must end after the token just sampled, or None to go on."""
        if self.text.stopped:
            return FinishReason.STOP
        if self.completion_tokens >= self.request.max_tokens:
            return FinishReason.LENGTH
        # The session's context is full: the token just sampled takes its last place.
        if len(self.session.tokens) >= self.session.context_limit:
            return FinishReason.LENGTH
        return None

    def final(self, reason: FinishReason, now: float) -> Final:
        def ms(a: float | None, b: float | None) -> float:
            return round((b - a) * 1000.0, 3) if a is not None and b is not None else 0.0

        decode_s = (self.last_token_at or 0.0) - (self.first_token_at or 0.0)
        tps = (self.completion_tokens - 1) / decode_s if decode_s > 0 and self.completion_tokens > 1 else 0.0
        return Final(
            id=self.request.id,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                context_tokens=len(self.session.tokens),
                accepted_prediction_tokens=self.drafter.predicted_accepted if self.drafter else 0,
                rejected_prediction_tokens=self.drafter.predicted_rejected if self.drafter else 0,
            ),
            timings=Timings(
                queue_ms=ms(self.arrival, self.first_step_at or now),
                ttft_ms=ms(self.arrival, self.first_token_at),
                total_ms=ms(self.arrival, now),
                decode_tokens_per_s=round(tps, 3),
                restore_ms=self.restore_ms,
            ),
            eog=self.ended_by_eog,
            stop=self.text.matched if reason == FinishReason.STOP else None,
        )
