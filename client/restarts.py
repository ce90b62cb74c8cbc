"""Telling a request lost to a daemon restart from one the new daemon received.

Every reply names the daemon process that sent it (its instance, new at each start). A request is lost with
the old daemon only if the old daemon spoke after the request was sent: then the request had reached it. A
request sent after the old daemon's last word went to the new one, even if its replies arrive before the
client has noticed the restart (they are the new daemon's, by their instance).
"""

from __future__ import annotations

import time

from kvpool import protocol as p


class RestartWatch:
    def __init__(self) -> None:
        self.instance = ""  # the daemon process answering
        self.last_heard = time.monotonic()  # when anything last came from the daemon (any process)
        self.restarted_at = 0.0  # when a reply showed a new daemon process
        self.heard_before_restart = 0.0  # the old process's last reply before that
        self._heard_from_instance = 0.0

    def heard(self, reply: p.Reply, now: float) -> None:
        if reply.instance and reply.instance != self.instance:
            if self.instance:  # not the first daemon this client meets: a restart
                self.restarted_at, self.heard_before_restart = now, self._heard_from_instance
            self.instance = reply.instance
        if not reply.instance or reply.instance == self.instance:  # untagged: an older daemon, the current one
            self._heard_from_instance = now
        self.last_heard = now

    def lost(self, sent: float) -> bool:
        """A request sent at ``sent`` went down with an old daemon."""
        return self.restarted_at > sent and self.heard_before_restart >= sent
