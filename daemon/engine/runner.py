"""The runner: one step's work through llama.cpp, as one batch (decoded in parts where the cost model predicts
them faster than one decode, llama/decode_groups.py); then one token sampled per finished chunk, and with a guess
(engine/drafts.py) one more per guessed token taken. A step that feeds a medium feeds its cells alone, as
embeddings, after its encode (engine/step_work.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvpool.daemon.engine.cost_model import CostModel, StepShape
from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.step_work import Work
from kvpool.daemon.llama.model import Model, Sampled
from kvpool.daemon.llama.model.mtmd import MediaError
from kvpool.daemon.media.media_cache import MediaCache


@dataclass(frozen=True, slots=True)
class StepOutcome:
    rc: int  # llama_decode's answer: 0 done, 1 no room in the unified KV (nothing changed), else a failure
    # Per work item, the tokens sampled for it: one, or with a guess (Work.draft) one more than it took of it; none
    # for a chunk with pending tokens left, or a prefill.
    tokens: list[list[Sampled]]
    batch_tokens: int  # tokens fed in the batch
    shape: StepShape  # what the cost model predicts a step's time from
    seconds: float  # decode plus sampling: what the cost model predicts
    encode_seconds: float = 0.0  # a medium's encode before its rows (the media cache keeps its own estimate)
    medium_error: str = ""  # the medium could not be encoded (nothing was decoded): why


class Runner:
    def __init__(self, model: Model, cost: CostModel, media: MediaCache | None = None):
        self.model = model
        self.cost = cost  # (the scheduler's: it says whether a step is decoded in parts)
        self.media = media

    def run(self, step_work: list[Work[Generation]]) -> StepOutcome:
        if len(step_work) == 1 and step_work[0].item.feeds_medium:
            return self._run_medium(step_work[0])
        batch = self.model.batch
        batch.clear()
        # A prefill's last chunk needs no logits; a guess needs them for each of its rows, and the row before.
        outputs = [1 + len(w.draft) if w.completes and w.item.samples else 0 for w in step_work]
        sizes = [w.n_tokens + len(w.draft) for w in step_work]
        chunks = [(w.item.position, size, out) for w, size, out in zip(step_work, sizes, outputs, strict=True)]
        groups, shape = self.cost.plan(chunks)  # the batch holds the items in the order they are decoded
        rows = [0] * len(step_work)
        for i in (i for group in groups for i in group):
            s = step_work[i].item.session
            assert s.slot is not None  # the scheduler runs only generations whose session is hot
            fed = s.tokens[s.n_kv : s.n_kv + step_work[i].n_tokens] + list(step_work[i].draft)
            rows[i] = batch.add(s.slot, fed, s.position(s.n_kv), outputs[i])  # (kv/positions.py)
        started = time.perf_counter()
        rc = self.model.decode([sum(sizes[i] for i in group) for group in groups])
        if rc != 0:
            return StepOutcome(rc, [], batch.n, shape, 0.0)
        tokens = [self._sample(w, row) if out else [] for w, row, out in zip(step_work, rows, outputs, strict=True)]
        return StepOutcome(0, tokens, batch.n, shape, time.perf_counter() - started)

    def _sample(self, work: Work[Generation], last_row: int) -> list[Sampled]:
        """The work's token, and while each one sampled is the guess's next, the one after it (its row's)."""
        sampler = work.item.sampler
        first = last_row - len(work.draft)
        run = [sampler.sample(first)]
        for i, guessed in enumerate(work.draft):
            token = run[-1].token
            if token != guessed or self.model.is_end_of_generation(token):
                break
            run.append(sampler.sample(first + 1 + i))
        return run

    def _run_medium(self, work: Work[Generation]) -> StepOutcome:
        """A step that feeds one medium's cells: its encode if it is not encoded yet, then its rows as embeddings."""
        assert self.media is not None
        g = work.item
        s = g.session
        assert s.slot is not None
        start, piece = s.medium_ahead()
        shape = StepShape.of([(s.n_kv, work.n_tokens, work.completes and g.samples)])
        if piece.error:  # (its encode beside the steps failed)
            return StepOutcome(0, [], 0, shape, 0.0, medium_error=piece.error)
        try:
            encode_seconds = self.media.encode(piece)  # (0 when it was encoded beside the steps)
        except MediaError as exc:
            return StepOutcome(0, [], 0, shape, 0.0, medium_error=str(exc))
        assert piece.embeddings is not None
        first = s.n_kv - start
        samples = work.completes and g.samples
        # An M-RoPE model's medium takes four positions a cell, from where the session's next cell sits
        positions = piece.positions.at(s.position(start))[:, first : first + work.n_tokens] if piece.positions else None
        started = time.perf_counter()
        rc = self.model.decode_embeddings(
            s.slot,
            piece.embeddings[first : first + work.n_tokens],
            s.position(s.n_kv),
            piece.non_causal,
            samples,
            positions,
        )
        if rc != 0:
            return StepOutcome(rc, [], work.n_tokens, shape, 0.0, encode_seconds)
        tokens = [g.sampler.sample(work.n_tokens - 1)] if samples else []
        return StepOutcome(0, [tokens], work.n_tokens, shape, time.perf_counter() - started, encode_seconds)
