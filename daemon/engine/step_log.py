"""One JSON line per engine step, for tracing where a workload's time goes (the ``step_log`` setting): when the
step ended, its time and what the cost model had predicted for it, and for each sequence in it the tokens fed, the
guessed ones after them, the tokens sampled and the kind of guess. A line a step: for measuring, not for a device's
everyday log (docs/operations.md)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import msgspec

from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.step_work import Work

log = logging.getLogger(__name__)


class StepItem(msgspec.Struct, kw_only=True):
    session: str
    pending: int  # its tokens not in the KV before the step (1: it was decoding; more: a prompt)
    fed: int  # of them, fed in this step
    guessed: int  # guessed tokens fed after them, each with its row of logits
    sampled: int  # tokens the step gave it: 1 plus the guesses taken (0: a prompt chunk that does not end it)
    guess_kind: int | None = None  # the guess's match length (0: the grammar's forced text; negative: a substitution)
    predicted: bool = False  # the guess came from the request's prediction, not from the session's context


class StepRecord(msgspec.Struct, kw_only=True):
    at: float  # time.monotonic() when the step ended
    ms: float  # decode and sampling
    predicted_ms: float  # what the cost model predicted for its shape, before it learnt this step's time
    items: list[StepItem]
    decodes: int = 1  # llama_decode calls it ran as (llama/decode_groups.py)


class StepLog:
    def __init__(self, path: str):
        """Appends to ``path`` (created if missing); OSError when it cannot be opened."""
        self.path = path
        self._file: BinaryIO | None = Path(path).open("ab")  # noqa: SIM115 (open for the daemon's life)
        self._encoder = msgspec.json.Encoder()

    def write(
        self,
        step_work: Sequence[Work[Generation]],
        sampled: Sequence[Sequence[int]],
        seconds: float,
        predicted: float,
        decodes: int = 1,
    ) -> None:
        if self._file is None:
            return
        items = [_item(w, len(run)) for w, run in zip(step_work, sampled, strict=True)]
        record = StepRecord(
            at=time.monotonic(),
            ms=round(seconds * 1e3, 3),
            predicted_ms=round(predicted * 1e3, 3),
            items=items,
            decodes=decodes,
        )
        try:
            self._file.write(self._encoder.encode(record) + b"\n")
            self._file.flush()
        except OSError as exc:  # (a full disk): the log stops, the steps go on
            log.warning("step_log: writing %s failed (%s); no more steps are logged", self.path, exc.strerror)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):
                file.close()


def _item(w: Work[Generation], sampled: int) -> StepItem:
    drafter = w.item.drafter if w.draft else None  # (the guess's kind and source, where the step fed one)
    return StepItem(
        session=w.item.session.id,
        pending=w.item.pending_tokens,
        fed=w.n_tokens,
        guessed=len(w.draft),
        sampled=sampled,
        guess_kind=drafter.matched if drafter is not None else None,
        predicted=drafter is not None and drafter.from_prediction,
    )
