"""Preloading against a real daemon: a client's prefetch hint lifts a session into a free hot slot ahead of its
turn, never by evicting anything, and the counters tell whether it paid."""

from __future__ import annotations

import time
from collections.abc import Callable

from .daemon_process import DaemonProcess, wait_until

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0}


def test_prefetch_takes_only_room_that_costs_nobody_anything(start_daemon: Start) -> None:
    # on_evict: a hot session's checkpoint is not fresh after its turn, so its slot is not free for a hint.
    daemon = start_daemon("--hot-slots", "2", "--context-size", "2048", "--threads", "1", "--checkpoint", "on_evict")
    with daemon.client() as client:
        a, b, c = (client.open_session() for _ in range(3))
        for s in (a, b, c):
            s.complete("wake up and report", max_tokens=4, **GREEDY)
        assert client.status().sessions_by_tier == {"hot": 2, "pool": 1}  # a went to the pool
        before = client.status().moves
        assert a.prefetch() == "pool"  # nothing is checkpointed, spilled or evicted for a hint
        after = client.status().moves
        assert (after.hibernations, after.checkpoints) == (before.hibernations, before.checkpoints)

        b.close()  # a slot is free now
        assert a.prefetch() == "hot"
        restored = client.status().moves.restores_pool
        assert restored == before.restores_pool + 1
        turn = a.complete("and again", max_tokens=4, **GREEDY)
        status = client.status()
        assert status.moves.restores_pool == restored  # the turn found it hot: no restore on its path
        assert turn.timings.restore_ms == 0.0  # and says so
        assert (status.preload.preloads, status.preload.hinted, status.preload.hits) == (1, 1, 1)
        assert status.preload.wasted == 0


def test_prefetch_takes_the_slot_of_an_idle_session_with_a_fresh_checkpoint(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "2", "--context-size", "2048", "--threads", "1")
    with daemon.client() as client:
        a, b, c = (client.open_session() for _ in range(3))
        for s in (a, b, c):
            s.complete("wake up and report", max_tokens=4, **GREEDY)
        before = client.status().moves
        assert a.prefetch() == "hot"
        after = client.status().moves
        assert after.hibernations == before.hibernations + 1 and after.checkpoints == before.checkpoints
        assert next(i.tier for i in client.sessions() if i.session == b.id) == "pool"  # the least recently used
        a.complete("and again", max_tokens=4, **GREEDY)
        assert client.status().preload.hits == 1


def test_resume_with_prefetch_and_a_wasted_preload(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1", "--context-size", "2048", "--threads", "1")
    with daemon.client() as client:
        a, b = client.open_session(), client.open_session()
        a.complete("first", max_tokens=3, **GREEDY)
        b.complete("second", max_tokens=3, **GREEDY)
        b.close()
        again = client.resume_session(a.id, a.token, prefetch=True)
        assert client.status().sessions_by_tier == {"hot": 1}
        c = client.open_session()
        c.complete("someone else's turn takes the slot", max_tokens=3, **GREEDY)
        late = again.complete("late", max_tokens=3, **GREEDY)
        assert 0.0 < late.timings.restore_ms <= late.timings.ttft_ms  # it had to come back from the pool
        preload = client.status().preload
        assert (preload.preloads, preload.hits, preload.wasted) == (1, 0, 1)


def test_preloading_off_ignores_hints(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "2", "--context-size", "2048", "--threads", "1", "--preload", "off")
    with daemon.client() as client:
        a, b, c = (client.open_session() for _ in range(3))
        for s in (a, b, c):
            s.complete("wake up", max_tokens=2, **GREEDY)
        b.close()
        assert a.prefetch() == "pool"
        assert client.status().preload.preloads == 0


def test_prediction_lifts_a_session_with_a_rhythm_before_its_turn(start_daemon: Start) -> None:
    daemon = start_daemon(
        "--hot-slots",
        "1",
        "--context-size",
        "2048",
        "--threads",
        "1",
        "--preload",
        "predict",
        config="preload_horizon_s = 5.0\n",
    )
    with daemon.client() as client:
        rhythmic, other = client.open_session(), client.open_session()
        start = time.monotonic()

        def at(t: float) -> None:
            time.sleep(max(0.0, start + t - time.monotonic()))  # the trace's clock (a rhythm), not a wait for state

        at(0.0)
        rhythmic.complete("tick", max_tokens=2, **GREEDY)
        other.complete("first", max_tokens=2, **GREEDY)
        at(1.0)
        rhythmic.complete("tick", max_tokens=2, **GREEDY)
        at(2.0)
        rhythmic.complete("tick", max_tokens=2, **GREEDY)  # gaps of 1 s: expected again at about 3 s
        other.complete("second", max_tokens=2, **GREEDY)  # takes the only slot; no rhythm of its own
        wait_until(lambda: client.status().preload.predicted >= 1, "the predictor to lift the rhythmic session")
        assert next(i.tier for i in client.sessions() if i.session == rhythmic.id) == "hot"
        rhythmic.complete("tick", max_tokens=2, **GREEDY)
        assert client.status().preload.hits == 1
