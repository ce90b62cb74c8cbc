"""The preload predictor: pure logic, no model."""

from __future__ import annotations

import pytest

from kvpool.daemon.preload.predictor import TurnHistory


def history(**turns: list[float]) -> TurnHistory:
    h = TurnHistory()
    for session, times in turns.items():
        for t in times:
            h.note(session, t)
    return h


def test_a_regular_rhythm_predicts_the_next_turn() -> None:
    h = history(voice=[0.0, 10.0, 20.1, 29.9])
    assert h.next_turn("voice") == pytest.approx(29.9 + 10.0)


def test_too_few_turns_or_irregular_gaps_predict_nothing() -> None:
    h = history(new=[0.0, 5.0], chatty=[0.0, 1.0, 9.0, 10.0, 30.0], zero=[1.0, 1.0, 1.0])
    assert h.next_turn("new") is None
    assert h.next_turn("chatty") is None
    assert h.next_turn("zero") is None
    assert h.next_turn("unknown") is None


def test_due_lists_sessions_expected_within_the_horizon_soonest_first() -> None:
    h = history(a=[0.0, 10.0, 20.0], b=[0.0, 4.0, 8.0], far=[0.0, 100.0, 200.0], late=[0.0, 2.0, 4.0])
    # a expected at 30, b at 12, far at 300, late at 6 (overdue by 6.5 at 12.5: more than half a gap)
    assert h.due(now=11.0, horizon=20.0) == ["b", "a"]
    assert h.due(now=12.5, horizon=1.0) == ["b"]  # b is overdue by 0.5 s: its turn may simply be late
    assert "late" not in h.due(now=12.5, horizon=100.0)


def test_the_rhythm_follows_recent_turns_and_forgets_closed_sessions() -> None:
    h = TurnHistory(keep=4)
    for t in [0.0, 100.0, 200.0, 205.0, 210.0, 215.0]:
        h.note("s", t)
    assert h.next_turn("s") == pytest.approx(220.0)  # the old 100 s gaps have left the window
    h.forget("s")
    assert h.next_turn("s") is None and h.due(0.0, 1e9) == []
