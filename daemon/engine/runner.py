"""The runner: one step's work through llama.cpp, as one batch; then one token sampled per finished chunk. A step
that feeds a medium feeds its cells alone, as embeddings, after its encode (engine/step_work.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvpool.daemon.engine.cost_model import StepShape
from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.step_work import Work
from kvpool.daemon.llama.model import Model, Sampled
from kvpool.daemon.llama.model.mtmd import MediaError
from kvpool.daemon.media.media_cache import MediaCache


@dataclass(frozen=True, slots=True)
class StepOutcome:
    rc: int  # llama_decode's answer: 0 done, 1 no room in the unified KV (nothing changed), else a failure
    tokens: list[Sampled | None]  # per work item, the token sampled for it (None: pending tokens left, or a prefill)
    batch_tokens: int  # tokens fed in the batch
    shape: StepShape  # what the cost model predicts a step's time from
    seconds: float  # decode plus sampling: what the cost model predicts
    encode_seconds: float = 0.0  # a medium's encode before its rows (the media cache keeps its own estimate)
    medium_error: str = ""  # the medium could not be encoded (nothing was decoded): why


class Runner:
    def __init__(self, model: Model, media: MediaCache | None = None):
        self.model = model
        self.media = media

    def run(self, step_work: list[Work[Generation]]) -> StepOutcome:
        if len(step_work) == 1 and step_work[0].item.feeds_medium:
            return self._run_medium(step_work[0])
        batch = self.model.batch
        batch.clear()
        rows = []
        sampling = [w.completes and w.item.samples for w in step_work]  # a prefill's last chunk needs no logits
        for work, samples in zip(step_work, sampling, strict=True):
            s = work.item.session
            assert s.slot is not None  # the scheduler runs only generations whose session is hot
            rows.append(batch.add(s.slot, s.tokens[s.n_kv : s.n_kv + work.n_tokens], s.n_kv, samples))
        shape = StepShape.of([(w.item.position, w.n_tokens, out) for w, out in zip(step_work, sampling, strict=True)])
        started = time.perf_counter()
        rc = self.model.decode()
        if rc != 0:
            return StepOutcome(rc, [], batch.n, shape, 0.0)
        tokens = [
            w.item.sampler.sample(row) if out else None for w, row, out in zip(step_work, rows, sampling, strict=True)
        ]
        return StepOutcome(0, tokens, batch.n, shape, time.perf_counter() - started)

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
        started = time.perf_counter()
        rc = self.model.decode_embeddings(
            s.slot, piece.embeddings[first : first + work.n_tokens], s.n_kv, piece.non_causal, samples
        )
        if rc != 0:
            return StepOutcome(rc, [], work.n_tokens, shape, 0.0, encode_seconds)
        token = g.sampler.sample(work.n_tokens - 1) if samples else None
        return StepOutcome(0, [token], work.n_tokens, shape, time.perf_counter() - started, encode_seconds)
