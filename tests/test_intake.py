"""The engine's intake (engine/intake.py): connections in turns, each one's requests in order, a bounded slice. Pure."""

from __future__ import annotations

from kvpool import protocol as p
from kvpool.daemon.engine import intake as intake_module
from kvpool.daemon.engine.intake import Intake


def ids(items: list[intake_module.Item]) -> list[tuple[bytes, int]]:
    return [(client, request.id) for client, request, _ in items]


def test_connections_take_turns_and_each_keeps_its_order() -> None:
    intake = Intake()
    for i in range(1, 6):
        assert intake.put(b"flood", p.Status(id=i))
    assert intake.put(b"other", p.Status(id=100))
    assert intake.put(b"other", p.Status(id=101))
    taken = ids(list(intake.take(0.0)))
    # The other connection's first request is second, not sixth; each connection's own order is kept.
    assert taken[:4] == [(b"flood", 1), (b"other", 100), (b"flood", 2), (b"other", 101)]
    assert [i for c, i in taken if c == b"flood"] == [1, 2, 3, 4, 5]


def test_a_slice_ends_and_the_rest_waits_for_the_next_round(monkeypatch: object) -> None:
    intake = Intake()
    for i in range(1, 4):
        intake.put(b"a", p.Status(id=i))
    monkeypatch.setattr(intake_module, "SLICE_S", 0.0)  # type: ignore[attr-defined]
    assert ids(list(intake.take(0.0))) == [(b"a", 1)]  # (the first always goes)
    assert ids(list(intake.take(0.0))) == [(b"a", 2)]
    left = intake.close()
    assert ids(left) == [(b"a", 3)]  # answered by the engine as it stops
    assert not intake.put(b"a", p.Status(id=4))  # closed: the I/O thread answers it itself
