"""When will a session speak next? A guess from its own turns: pure logic, no I/O.

Devices wake sessions on a rhythm (a voice assistant's periodic wake-ups, a sensor summariser every minute).
A session whose recent gaps between turns are regular is expected again one typical gap after its last turn;
a session with irregular gaps, or too few turns, gets no prediction (a guess that is usually wrong only costs
restores). The caller preloads only into free room, so a wrong guess never evicts anything.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Container

KEEP_TURNS = 8  # the gaps of the last few turns: a rhythm that changes is followed within a few turns
MIN_GAPS = 2
MAX_SPREAD = 0.25  # median absolute deviation of the gaps, relative to their median, for a rhythm to count


class TurnHistory:
    def __init__(self, keep: int = KEEP_TURNS):
        self.keep = keep
        self._times: dict[str, deque[float]] = {}

    def note(self, session: str, when: float) -> None:
        """A turn of ``session`` arrived at ``when`` (monotonic seconds)."""
        times = self._times.get(session)
        if times is None:
            times = self._times[session] = deque(maxlen=self.keep)
        times.append(when)

    def forget(self, session: str) -> None:
        self._times.pop(session, None)

    def keep_only(self, sessions: Container[str]) -> None:
        """Forget the turns of every session not in ``sessions`` (those that left the daemon)."""
        for session in [x for x in self._times if x not in sessions]:
            self.forget(session)

    def next_turn(self, session: str) -> float | None:
        """When the session's next turn is expected, or None when its turns show no rhythm."""
        times = self._times.get(session)
        if times is None or len(times) < MIN_GAPS + 1:
            return None
        gaps = [b - a for a, b in zip(times, list(times)[1:], strict=False)]
        typical = statistics.median(gaps)
        if typical <= 0:
            return None
        spread = statistics.median(abs(g - typical) for g in gaps)
        if spread > MAX_SPREAD * typical:
            return None
        return times[-1] + typical

    def due(self, now: float, horizon: float) -> list[str]:
        """Sessions expected within ``horizon`` seconds from ``now`` (or a little overdue), soonest first."""
        due: list[tuple[float, str]] = []
        for session in self._times:
            expected = self.next_turn(session)
            if expected is None:
                continue
            last = self._times[session][-1]
            # overdue by up to half a gap still counts: the turn may simply be late
            if now - (expected - last) * 0.5 <= expected <= now + horizon:
                due.append((expected, session))
        return [session for _, session in sorted(due)]
