"""Smart preloading: moving a session up the tiers before its turn comes, on a client's hint (prefetch) or on
the predictor's guess (daemon/kv/preload/predictor.py). Counts preloads, hits and wasted preloads. Engine
thread only.

Only into room that costs nobody anything: a free hot slot, or the slot of an idle session whose checkpoint is
fresh (leaving costs it no copy, only a forget) and which is not itself expected within the horizon; and free
KV cells. Nothing is spilled, evicted or checkpointed for a preload, and a preloaded session is never pushed
out by another preload.
"""

from __future__ import annotations

import logging
import time

from kvpool.daemon.errors import RequestRefused
from kvpool.daemon.kv.preload.predictor import TurnHistory
from kvpool.daemon.kv.sessions import Session
from kvpool.daemon.kv.tiers import Tiers
from kvpool.protocol.status import PreloadStatus

log = logging.getLogger("kvpool.engine")
PREDICT_EVERY_S = 0.05


class Preloader:
    def __init__(self, tiers: Tiers, mode: str, horizon_s: float):
        self.tiers, self.mode, self.horizon_s = tiers, mode, horizon_s
        self.counts = PreloadStatus(mode=mode)
        self.history = TurnHistory()
        # Sessions lifted ahead of a turn that has not come yet -> the tier the preload put them in.
        self._preloaded: dict[str, str] = {}
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
        self._preloaded[s.id] = s.tier

    def turn(self, s: Session) -> None:
        """A turn of ``s`` arrived (before it is scheduled): was it preloaded, and did that pay?"""
        self.history.note(s.id, time.monotonic())
        target = self._preloaded.pop(s.id, None)
        if target is not None:
            # a hit only if the session is still where the preload put it (or higher)
            if s.slot is not None or (target == "pool" and s.tier == "pool"):
                self.counts.hits += 1
            else:
                self.counts.wasted += 1

    def dropped(self, s: Session) -> None:
        self.history.forget(s.id)
        if self._preloaded.pop(s.id, None) is not None:
            self.counts.wasted += 1

    def predict(self) -> None:
        """Between steps: lift the sessions the predictor expects within the horizon, while there is room."""
        if self.mode != "predict":
            return
        now = time.monotonic()
        if now < self._next_prediction:
            return
        self._next_prediction = now + PREDICT_EVERY_S
        due = self.history.due(now, self.horizon_s)
        for session in due:
            s = self.tiers.sessions.by_id.get(session)
            if s is not None and s.id not in self._preloaded and self._lift(s, keep=set(due)):
                self.counts.predicted += 1

    def _room_giver(self, keep: set[str]) -> Session | None:
        """An idle hot session that can leave its slot at no cost: fresh checkpoint, not expected soon, not
        preloaded itself; the least recently used of them."""
        soon = keep | set(self.history.due(time.monotonic(), self.horizon_s)) | set(self._preloaded)
        givers = [
            r
            for r in self.tiers.resident.values()
            if not r.busy and r.checkpoint_fresh and r.id not in soon and not r.shares_hot
        ]
        return min(givers, key=lambda r: r.last_used, default=None)

    def _lift(self, s: Session, count: bool = True, keep: set[str] | None = None) -> bool:
        """Into a hot slot, free or given up at no cost, when the unified KV has free cells for it too."""
        if s.slot is not None or s.busy or s.snapshot is None:
            return False
        giver = None
        if not self.tiers.free_slots:
            giver = self._room_giver((keep or set()) | {s.id})
            if giver is None:
                return False
        freed = giver.n_kv if giver is not None else 0
        if self.tiers.cells_used() - freed + s.snapshot.n_kv > self.tiers.model.context_size:
            return False
        if giver is not None:
            self.tiers.hibernate(giver)  # its checkpoint is fresh: no copy, its cells and slot are freed
        try:
            lifted = self.tiers.make_resident(s)
        except RequestRefused as refused:  # a damaged snapshot shows at the turn, with its own error
            log.warning("could not preload session %s: %s", s.id, refused.message)
            return False
        if lifted:
            # Most recently used now: the next session that needs a slot takes someone else's, not this one's.
            s.last_used = time.monotonic()
        if lifted and count:
            self.counts.preloads += 1
            self._preloaded[s.id] = "hot"
        return lifted
