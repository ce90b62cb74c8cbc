"""Checks the engine runs between steps, each at most a few times a second: clients that died or stopped
reading, the daemon's resident memory against its high-water mark, sessions idle past session_timeout."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import psutil

from kvpool.daemon.config import Config
from kvpool.daemon.engine.scheduler import Scheduler
from kvpool.daemon.kv.tiers import Tiers
from kvpool.protocol import FinishReason
from kvpool.protocol.status import Counters

log = logging.getLogger("kvpool.engine")
CLIENT_SILENCE_S = 1.0  # clients ping every 0.25 s while they wait; four missed pings mean the client is gone


class Housekeeping:
    def __init__(
        self,
        config: Config,
        scheduler: Scheduler,
        tiers: Tiers,
        counters: Counters,
        finish: Callable[..., None],
        last_heard: dict[bytes, float],
        lagging: set[bytes],
    ):
        """``last_heard`` (client -> when its last frame came) and ``lagging`` (clients whose send queue is full)
        are kept by the I/O thread; ``finish`` is Engine.finish."""
        self.config, self.scheduler, self.tiers, self.counters, self.finish = config, scheduler, tiers, counters, finish
        self.last_heard, self.lagging = last_heard, lagging
        self._next_client_check = 0.0
        self._next_memory_check = 0.0
        self._next_expiry_check = 0.0

    def run(self) -> None:
        self.expire_idle_sessions()
        self.watch_memory()
        self.stop_for_silent_clients()

    def stop_for_silent_clients(self) -> None:
        """A client that sends heartbeats and then falls silent has died (or hung): its generations stop, so its
        slot and cells go to the living. Its sessions stay until session_timeout: a restarted client resumes."""
        now = time.monotonic()
        if now < self._next_client_check:
            return
        self._next_client_check = now + 0.1
        for g in self.scheduler.generations():
            if g.client in self.lagging:
                log.warning("the client of session %s stopped reading: stopping its generation", g.session.id)
                self.counters.clients_not_reading += 1
                self.finish(g, FinishReason.CANCELLED, now)
                continue
            heard = self.last_heard.get(g.client)
            if heard is not None and now - heard > CLIENT_SILENCE_S:
                log.warning(
                    "client of session %s is silent for %.1f s: stopping its generation", g.session.id, now - heard
                )
                self.counters.clients_lost += 1
                self.finish(g, FinishReason.CANCELLED, now)
        for client, heard in list(self.last_heard.items()):
            if now - heard > 300.0:  # forget long-gone clients
                self.last_heard.pop(client, None)

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
        for s in self.tiers.sessions.idle_longer_than(timeout, now):
            log.info("session %s (%s tier) expired after %.0f s idle", s.id, s.tier, timeout)
            self.tiers.drop(s)
