"""systemd's notify protocol in pure Python: READY/STATUS/STOPPING and watchdog pings over $NOTIFY_SOCKET.

Without $NOTIFY_SOCKET (not started by systemd) every call does nothing. The watchdog pings only while the
engine loop keeps stepping: a hung engine stops them, and systemd (WatchdogSec=) restarts the daemon.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvpool.notify")


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET", "")
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process the watchdog is meant for; another process must not ping.
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else 0.0
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> None:
        if self._sock is None:
            return
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address  # abstract socket
        try:
            self._sock.sendto("\n".join(fields).encode(), target)
        except OSError as exc:  # systemd going away must not take the daemon with it
            log.debug("sd_notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping: finishing generations and checkpointing sessions")

    def start_watchdog(self, last_beat: Callable[[], float], status: Callable[[], str]) -> None:
        """Ping WATCHDOG=1 twice per interval while ``last_beat()`` (the engine loop's latest pass, monotonic
        seconds) is recent; refresh STATUS with ``status()`` on the way."""
        if not self.enabled:
            return
        period = self.watchdog_interval / 2 if self.watchdog_interval else 5.0

        def loop() -> None:
            while not self._stop.wait(period):
                if self.watchdog_interval and time.monotonic() - last_beat() < self.watchdog_interval:
                    self.send("WATCHDOG=1", f"STATUS={status()}")
                elif not self.watchdog_interval:
                    self.status(status())
                else:
                    log.error(
                        "engine loop has not stepped for %.0f s: withholding the watchdog ping",
                        time.monotonic() - last_beat(),
                    )

        self._thread = threading.Thread(target=loop, name="watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
