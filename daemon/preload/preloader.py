"""Smart preloading: moving a session up the tiers before its turn comes, on a client's hint (prefetch) or on
the predictor's guess (predictor.py). Counts preloads, hits and wasted preloads. Engine thread only. The request
handlers tell it of hints and turns, and the engine lets it predict between steps; mode "off" does nothing but
count (what a daemon without preloading has).

Only into room that costs nobody anything: a free hot slot, or the slot of an idle session whose checkpoint is
fresh (leaving costs it no copy, only a forget) and which is not itself expected within the horizon; and free
KV cells. Nothing is spilled, evicted or checkpointed for a preload, and a preloaded session is never pushed
out by another preload.
"""

from __future__ import annotations

import logging
import time

import msgspec

from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.preload.predictor import TurnHistory
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol.status import PreloadStatus

log = logging.getLogger("kvpool.engine")
PREDICT_EVERY_S = 0.05


class Preloader:
    def __init__(self, kv: KvManager, mode: str, horizon_s: float):
        self.kv, self.mode, self.horizon_s = kv, mode, horizon_s
        self.counts = PreloadStatus(mode=mode)
        self.history = TurnHistory()
        # Sessions lifted ahead of a turn that has not come yet -> (that session, the tier the preload put it in).
        # The session object, not only its id: one that left (closed, expired, evicted, moved to another node) is
        # told apart from a newcomer under the same id without the tiers having to tell anyone.
        self._preloaded: dict[str, tuple[Session, str]] = {}
        self._next_prediction = 0.0

    def hint(self, s: Session) -> str:
        """A client says the session's turn is coming: lift it if there is room; where its KV is now."""
        if self.mode != "off" and self._lift(s):
            self.counts.hinted += 1
        return s.tier

    def fetched(self, s: Session) -> None:
        """A session just came from the remote tier into the pool ahead of its turn (a hint)."""
        self.counts.preloads += 1
        self.counts.hinted += 1
        self._lift(s, count=False)
        self._preloaded[s.id] = (s, s.tier)

    def turn(self, s: Session) -> None:
        """A turn of ``s`` arrived (before it is scheduled): was it preloaded, and did that pay? (Preloads of
        sessions that left are counted by _forget_gone, from status() and predict().)"""
        self.history.note(s.id, time.monotonic())
        preloaded = self._preloaded.pop(s.id, None)
        if preloaded is not None:
            old, target = preloaded
            # a hit only if it is the session preloaded, still where the preload put it (or higher)
            if old is s and (s.slot is not None or (target == "pool" and s.tier == "pool")):
                self.counts.hits += 1
            else:
                self.counts.wasted += 1

    def status(self) -> PreloadStatus:
        self._forget_gone()
        return msgspec.structs.replace(self.counts)

    def _forget_gone(self) -> None:
        """Sessions that left the daemon: a preload of one was wasted, and its turns are history."""
        by_id = self.kv.sessions.by_id
        for session, (s, _) in list(self._preloaded.items()):
            if by_id.get(session) is not s:
                del self._preloaded[session]
                self.counts.wasted += 1
        self.history.keep_only(by_id)

    def predict(self) -> None:
        """Between steps: lift the sessions the predictor expects within the horizon, while there is room."""
        now = time.monotonic()
        if now < self._next_prediction:
            return
        self._next_prediction = now + PREDICT_EVERY_S
        self._forget_gone()
        if self.mode != "predict":
            return
        due = self.history.due(now, self.horizon_s)
        for session in due:
            s = self.kv.sessions.by_id.get(session)
            if s is not None and s.id not in self._preloaded and self._lift(s, keep=set(due)):
                self.counts.predicted += 1

    def _room_giver(self, keep: set[str]) -> Session | None:
        """An idle hot session that can leave its slot at no cost: fresh checkpoint, not expected soon, not
        preloaded itself; the least recently used of them."""
        soon = keep | set(self.history.due(time.monotonic(), self.horizon_s)) | set(self._preloaded)
        givers = [
            r
            for r in self.kv.resident.values()
            if not r.busy and r.checkpoint_fresh and r.id not in soon and not r.shares_hot
        ]
        return min(givers, key=lambda r: r.last_used, default=None)

    def _lift(self, s: Session, count: bool = True, keep: set[str] | None = None) -> bool:
        """Into a hot slot, free or given up at no cost, when the unified KV has free cells for it too."""
        if s.slot is not None or s.busy or s.snapshot is None:
            return False
        giver = None
        if not self.kv.free_slot_count:
            giver = self._room_giver((keep or set()) | {s.id})
            if giver is None:
                return False
        freed = giver.n_kv if giver is not None else 0
        if self.kv.cells_used() - freed + s.snapshot.n_kv > self.kv.context_size:
            return False
        if giver is not None:
            self.kv.hibernate(giver)  # its checkpoint is fresh: no copy, its cells and slot are freed
        try:
            lifted = self.kv.make_resident(s)
        except RequestRefused as refused:  # a damaged snapshot shows at the turn, with its own error
            log.warning("could not preload session %s: %s", s.id, refused.message)
            return False
        if lifted:
            # Most recently used now: the next session that needs a slot takes someone else's, not this one's.
            s.last_used = time.monotonic()
        if lifted and count:
            self.counts.preloads += 1
            self._preloaded[s.id] = (s, "hot")
        return lifted
