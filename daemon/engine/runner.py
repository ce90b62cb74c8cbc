"""The runner: one step's work through llama.cpp, as one batch; then one token sampled per finished chunk."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvpool.daemon.engine.cost_model import StepShape
from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.step_work import Work
from kvpool.daemon.llama.model import Model, Sampled


@dataclass(frozen=True, slots=True)
class StepOutcome:
    rc: int  # llama_decode's answer: 0 done, 1 no room in the unified KV (nothing changed), else a failure
    tokens: list[Sampled | None]  # per work item, the token sampled for it (None: pending tokens left, or a prefill)
    batch_tokens: int  # tokens fed in the batch
    shape: StepShape  # what the cost model predicts a step's time from
    seconds: float  # decode plus sampling: what the cost model predicts


class Runner:
    def __init__(self, model: Model):
        self.model = model

    def run(self, step_work: list[Work[Generation]]) -> StepOutcome:
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
