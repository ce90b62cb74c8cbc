"""Checks the engine runs between steps, each at most a few times a second: clients that went away or stopped
reading (serve/liveness.py), the daemon's resident memory against its high-water mark, sessions idle past
session_timeout."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import psutil

from kvpool.daemon.config import Config
from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.scheduler import Scheduler
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.media.frame_areas import FrameAreas
from kvpool.daemon.serve.liveness import Liveness
from kvpool.protocol import ErrorCode
from kvpool.protocol.status import Counters

log = logging.getLogger("kvpool.engine")
Cut = Callable[[Generation, ErrorCode, str, float], None]


class Housekeeping:
    def __init__(
        self,
        config: Config,
        scheduler: Scheduler,
        kv: KvManager,
        counters: Counters,
        cut: Cut,
        liveness: Liveness,
        frame_areas: FrameAreas | None = None,
    ):
        """``liveness``: what the I/O thread knows of each client; ``cut``: Engine.cut, which ends a generation
        the daemon has to stop with an error; ``frame_areas``: connections' shared memory, freed when they go."""
        self.config, self.scheduler, self.kv, self.counters, self.cut = config, scheduler, kv, counters, cut
        self.liveness = liveness
        self.frame_areas = frame_areas
        self._next_area_check = 0.0
        self._next_client_check = 0.0
        self._next_memory_check = 0.0
        self._next_expiry_check = 0.0

    def run(self) -> None:
        self.expire_idle_sessions()
        self.watch_memory()
        self.watch_clients()
        self.release_frame_areas()

    def release_frame_areas(self) -> None:
        """The frame areas of connections that are gone (one merely quiet keeps its area: at the most areas, the
        least recently used goes instead)."""
        now = time.monotonic()
        if self.frame_areas is None or not len(self.frame_areas) or now < self._next_area_check:
            return
        self._next_area_check = now + 1.0
        for client in self.frame_areas.clients():
            if self.liveness.gone(client):
                self.frame_areas.release(client)

    def watch_clients(self) -> None:
        """A generation waits while its client has replies it has not read (it is paused, not gone); it stops when
        its client's connection closed, or when the client sent nothing or read nothing for client_patience. Its
        session stays until session_timeout, holding what was generated: a client that comes back resumes it."""
        now = time.monotonic()
        if now < self._next_client_check:
            return
        self._next_client_check = now + 0.05
        patience = self.config.client_patience
        for g in self.scheduler.generations():
            verdict = self.liveness.verdict(g.client, patience, now)
            if verdict == "paused" and not g.paused:
                self.counters.client_pauses += 1
            g.paused = verdict == "paused"
            if verdict in ("ok", "paused"):
                continue
            if verdict == "not_reading":
                self.counters.clients_not_reading += 1
                why = f"read no reply for {patience:g} s (client_patience)"
            else:
                self.counters.clients_lost += 1
                why = "closed its connection" if verdict == "gone" else f"sent nothing for {patience:g} s"
            log.warning("the client of session %s %s: stopping its generation", g.session.id, why)
            self.cut(
                g,
                ErrorCode.CLIENT_UNRESPONSIVE,
                f"This client {why}, so the daemon stopped its generation after {g.completion_tokens} tokens "
                "(the session keeps them). Resume the session and continue; raise client_patience if the client "
                "may pause longer.",
                now,
            )

    def watch_memory(self) -> None:
        limit = self.config.memory_high_water
        now = time.monotonic()
        if not limit or now < self._next_memory_check:
            return
        self._next_memory_check = now + 2.0
        rss = psutil.Process().memory_info().rss
        if (rss > limit) != self.scheduler.over_memory:
            self.scheduler.over_memory = rss > limit
            log.warning(
                "resident memory %.0f MiB is %s memory_high_water (%.0f MiB): %s new sessions",
                rss / 2**20,
                "above" if self.scheduler.over_memory else "back under",
                limit / 2**20,
                "refusing" if self.scheduler.over_memory else "accepting",
            )

    def expire_idle_sessions(self) -> None:
        timeout = self.config.session_timeout
        now = time.monotonic()
        if timeout <= 0 or now < self._next_expiry_check:
            return
        self._next_expiry_check = now + 1.0  # a scan per second is plenty for timeouts counted in seconds
        for s in self.kv.sessions.idle_longer_than(timeout, now):
            log.info("session %s (%s tier) expired after %.0f s idle", s.id, s.tier, timeout)
            self.kv.drop(s)
