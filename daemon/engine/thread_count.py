"""How many CPU threads the next engine step decodes with: as many as the daemon may use while it has the cores to
itself, fewer while other processes take some of them. Pure logic: the loop reports each step's slowdown (its time
over what the cost model calibrated at start predicts for its shape) and asks for the next step's count.

Why: llama.cpp's threads meet at a barrier after every operation of every layer and wait there by spinning. When a
neighbour process takes a core, one of the threads is descheduled for a time slice and the others spin through it:
on 2 cores beside one busy process, 2 threads decoded a quarter as fast as alone, and 1 thread more than half as fast
(docs/operations.md has the table). The right count is the one that measures fastest now, so it is measured:

- At its current count the governor keeps the steps' recent slowdown. When it grows by WORSE over its settled level
  (a neighbour started), a probe runs a few steps at one thread fewer; a probe that measures clearly faster
  (BETTER) is kept. It is judged against the current count's steps right after it, not before: a probe called for
  because the steps sped up (a neighbour left) would otherwise be compared with the slower steps before, and win
  on stale numbers; a probe whose steps and those after it lie more than PAIR_WITHIN_S apart (the engine waited
  between them) gives no verdict.
- Below the ceiling it probes one thread more (and one fewer, if any) every PROBE_EVERY_S, doubling the interval
  after each probe that did not pay (up to PROBE_MAX_S), and at once when the CPUs it may use show an idle core
  while it steps (/proc/stat: the neighbour left). At the ceiling it probes one fewer on the same schedule only
  while the steps' threads get less CPU than their count (the process's CPU time over the step's: a daemon started
  beside a neighbour calibrated slow and sees no slowdown, but its threads wait for a core). Alone it never probes.
- The loop does not probe while a first token with a deadline is due (a probe may be slower), and ignores steps that
  ran with a thread lent to an encode beside them.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.protocol.status import CpuStatus

RECENT = 8  # steps at the current count its slowdown is judged over
PROBE_STEPS = 4  # steps a probe runs at the other count, and at least PROBE_MIN_S
PROBE_MIN_S = 0.1
PAIR_WITHIN_S = 2.0  # a probe and the steps it is judged against this long apart compare two moments: dropped
CLEARLY_STEPS, CLEARLY_WORSE = 2, 1.5  # a probe whose first steps are all this much slower ends at once
WORSE = 1.3  # the recent slowdown over the settled level that suspects a neighbour
BETTER = 0.9  # a probed count is kept when its slowdown is below this fraction of the current one's
PROBE_EVERY_S = 2.0
PROBE_MAX_S = 32.0
CORES_SHORT = 0.5  # at the ceiling, steps whose threads got this much less CPU than their count call for a probe
IDLE_CORE = 0.5  # an idle core's share of a CPU over the last reading that calls for a probe up


@dataclass
class _Probe:
    threads: int
    started: float
    slowdowns: list[float] = field(default_factory=list)
    measured_at: float | None = None  # its steps are done: the current count's next steps are what it is judged against
    after: list[float] = field(default_factory=list)


class ThreadCount:
    def __init__(
        self,
        most: int,
        adaptive: bool,
        fixed_because: str = "",
        idle_cores: Callable[[], float | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.most = max(1, most)
        self.now = self.most
        self.adaptive = adaptive and self.most > 1
        self.fixed_because = fixed_because if not self.adaptive else ""
        if not self.adaptive and not self.fixed_because:
            self.fixed_because = "one core" if self.most == 1 else "adapt_threads = false"
        self._idle_cores = idle_cores
        self._clock = clock
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._cores: deque[float] = deque(maxlen=RECENT)  # the CPU the steps' threads got, in cores
        self._level: float | None = None  # the settled slowdown at the current count
        self._probe: _Probe | None = None
        self._suspect = False  # the current count got slower: probe one fewer next
        self._interval = PROBE_EVERY_S
        self._next_probe = clock() + PROBE_EVERY_S
        self._up_next = True  # below the ceiling, periodic probes alternate up and down
        self._probe_ended = clock()
        self.probes = 0
        self.switches = 0

    @property
    def probing(self) -> bool:
        """The next step runs at a count other than the current one, to measure it."""
        return self._probe is not None and self._probe.measured_at is None

    def for_next_step(self, may_probe: bool) -> int:
        """The threads the next step decodes with."""
        if not self.adaptive:
            return self.most
        if self.probing and not may_probe:
            self._close_probe()  # a deadline is due: no step at a count that may be slower
        if self._probe is None and may_probe and len(self._recent) >= RECENT // 2:
            candidate = self._candidate()
            if candidate is not None:
                self._probe = _Probe(candidate, self._clock())
                self.probes += 1
        return self._probe.threads if self._probe is not None and self.probing else self.now

    def _candidate(self) -> int | None:
        if self._suspect and self.now > 1:
            return self.now - 1
        now = self._clock()
        due = now >= self._next_probe
        if self.now < self.most:
            idle = self._idle_cores()
            if idle is not None and idle >= IDLE_CORE and now >= self._probe_ended + PROBE_EVERY_S / 2:
                self._up_next = True  # a core sits idle: one thread more may have it
                due = True
        if not due:
            return None
        if self.now >= self.most:
            # Started beside a neighbour, calibrated slow, the steps show no slowdown: but their threads got less
            # CPU than there are threads (waiting for a core), and one fewer may be faster.
            short = self._cores and statistics.median(self._cores) < self.now - CORES_SHORT
            return self.now - 1 if short else None
        up, self._up_next = self._up_next or self.now == 1, not self._up_next
        return self.now + 1 if up else self.now - 1

    def observe(self, threads: int, slowdown: float, lent: bool = False, cores: float | None = None) -> None:
        """A step ran with ``threads`` (one of them ``lent`` to an encode beside it), took ``slowdown`` times its
        calibrated prediction, and its process had ``cores`` CPUs' worth of time while it ran."""
        if slowdown <= 0 or lent:
            return  # a step with a thread lent to an encode: not this count's speed
        if cores is not None and threads == self.now and not self.probing:
            self._cores.append(cores)  # (also when fixed: shown)
        if not self.adaptive:
            self._recent.append(slowdown)  # still shown: an operator sees the neighbours' cost
            return
        probe = self._probe
        if probe is not None and probe.measured_at is None and threads == probe.threads:
            probe.slowdowns.append(slowdown)
            n = len(probe.slowdowns)
            if n >= PROBE_STEPS and self._clock() - probe.started >= PROBE_MIN_S:
                probe.measured_at = self._clock()
            elif n >= CLEARLY_STEPS and min(probe.slowdowns) > self._current() * CLEARLY_WORSE:
                self._end_probe(probe, self._current())  # a probe that is clearly slower costs no more steps
            return
        if threads != self.now:
            return
        if probe is not None and probe.measured_at is not None:
            if self._clock() - probe.measured_at > PAIR_WITHIN_S:
                self._close_probe()  # the engine waited between the probe and these steps: two moments, no verdict
            else:
                probe.after.append(slowdown)
                if len(probe.after) >= PROBE_STEPS:
                    self._end_probe(probe, statistics.median(probe.after))
                    if self.now != threads:
                        return  # it switched: this step was the count it left
        self._recent.append(slowdown)
        if len(self._recent) < RECENT:
            return
        # The latest steps against the settled level: a neighbour shows within a few steps.
        latest = statistics.median(list(self._recent)[-RECENT // 2 :])
        if self._level is None:
            self._level = statistics.median(self._recent)
        elif latest > self._level * WORSE:
            self._suspect = self.now > 1
            self._level = latest
            self._recent = deque(list(self._recent)[-RECENT // 2 :], maxlen=RECENT)  # the count's speed now
        elif latest < self._level / WORSE:
            self._level = latest  # faster than it was (a neighbour left): more threads may pay now
            self._next_probe = self._clock()

    def _close_probe(self) -> None:
        """The probe is over (with no verdict, the count stays): the next one comes after the interval."""
        self._probe = None
        self._probe_ended = self._clock()
        self._next_probe = self._probe_ended + self._interval

    def _current(self) -> float:
        return statistics.median(self._recent) if self._recent else 1.0

    def _end_probe(self, probe: _Probe, current: float) -> None:
        """Keep the probed count if it measured clearly faster than ``current``: the current count's speed."""
        self._suspect = False
        measured = statistics.median(probe.slowdowns)
        if measured < current * BETTER:
            self.now = probe.threads
            self.switches += 1
            self._recent = deque(probe.slowdowns[-RECENT:], maxlen=RECENT)
            self._cores.clear()
            self._level = measured
            self._interval = PROBE_EVERY_S
        else:
            self._interval = min(self._interval * 2, PROBE_MAX_S)
        self._close_probe()

    def status(self) -> CpuStatus:
        return CpuStatus(
            threads=self.now,
            most_threads=self.most,
            adaptive=self.adaptive,
            fixed_because=self.fixed_because,
            slowdown=round(statistics.median(self._recent), 3) if self._recent else None,
            cores=round(statistics.median(self._cores), 2) if self._cores else None,
            probes=self.probes,
            switches=self.switches,
        )
