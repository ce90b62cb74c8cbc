"""The step log (engine/step_log.py): a JSON line a step, and a log that cannot be written stops, not the steps.
Pure logic on stand-ins for a step's work (the daemon's own lines are checked against its counters in
tests/test_speculative.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvpool.daemon.engine.step_log import StepLog, StepRecord
from kvpool.daemon.engine.step_work import Work


@dataclass
class Session:
    id: str


@dataclass
class Drafter:
    matched: int
    from_prediction: bool = False


@dataclass
class Item:
    session: Session
    pending_tokens: int
    drafter: Drafter | None = field(default=None)


def step() -> tuple[list[Work[Any]], list[list[int]]]:
    prompt = Work(Item(Session("s1"), 40), 32, False)
    decoding = Work(Item(Session("s2"), 1, Drafter(8)), 1, True, draft=(5, 6, 7))
    predicted = Work(Item(Session("s3"), 1, Drafter(4, from_prediction=True)), 1, True, draft=(3,))
    return [prompt, decoding, predicted], [[], [9, 5, 6], [3, 4]]


def test_each_step_is_a_json_line_with_its_sequences(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    log = StepLog(str(path))
    work, sampled = step()
    log.write(work, sampled, 0.0421, 0.05)
    log.write(work[1:], sampled[1:], 0.01, 0.012)
    log.close()
    first, second = (msgspec.json.decode(line, type=StepRecord) for line in path.read_bytes().splitlines())
    assert (first.ms, first.predicted_ms) == (42.1, 50.0)
    prompt, decoding, predicted = first.items
    assert (prompt.session, prompt.pending, prompt.fed, prompt.guessed, prompt.sampled) == ("s1", 40, 32, 0, 0)
    assert prompt.guess_kind is None and not prompt.predicted
    assert (decoding.pending, decoding.fed, decoding.guessed, decoding.sampled, decoding.guess_kind) == (1, 1, 3, 3, 8)
    assert not decoding.predicted  # (a guess from the context)
    assert (predicted.guessed, predicted.sampled, predicted.guess_kind, predicted.predicted) == (1, 2, 4, True)
    assert len(second.items) == 2 and second.at >= first.at


def test_a_log_that_cannot_be_written_stops_with_a_warning_and_the_steps_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = StepLog("/dev/full")  # (every write fails: no space left)
    work, sampled = step()
    with caplog.at_level(logging.WARNING):
        log.write(work, sampled, 0.01, 0.01)
        log.write(work, sampled, 0.01, 0.01)  # (no more tries)
    assert [r.getMessage() for r in caplog.records if "step_log" in r.getMessage()] == [
        "step_log: writing /dev/full failed (No space left on device); no more steps are logged"
    ]
