"""Which kvpool session holds which conversation: the gateway's only state, kept in a small JSON file so that
it survives a gateway restart (the sessions themselves survive a daemon restart in its pool).

A conversation is named by OpenAI's ``prompt_cache_key`` (or an ``X-Session-Id`` header). A mapping whose
session is gone (closed, expired with the daemon's session_timeout, evicted) is dropped when found so.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpool.client.conversation import Held

log = logging.getLogger("kvpool.gateway")
MAX_CONVERSATIONS = 4096  # the oldest mapping goes first beyond this (the daemon's sessions expire on their own)


@dataclass(frozen=True)
class Mapping:
    """A conversation's session, and what it stands for (None: nothing to continue from)."""

    session: str
    token: str
    held: Held | None = None

    def to_json(self) -> dict[str, object]:
        return {"session": self.session, "token": self.token, "held": asdict(self.held) if self.held else None}

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> Mapping:
        held = raw.get("held")
        return cls(str(raw["session"]), str(raw["token"]), Held.load(held))


class ConversationStore:
    def __init__(self, path: Path | None):
        self.path = path
        self._by_key: dict[str, Mapping] = {}
        if path is not None and path.exists():
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
                self._by_key = {k: Mapping.from_json(v) for k, v in raw.items()}  # a damaged file: ignored whole
            except (OSError, ValueError, TypeError) as exc:
                log.warning("ignoring the conversation map %s (%s): conversations start over", path, exc)

    def get(self, key: str) -> Mapping | None:
        return self._by_key.get(key)

    def put(self, key: str, mapping: Mapping) -> None:
        self._by_key.pop(key, None)
        self._by_key[key] = mapping  # most recent last
        while len(self._by_key) > MAX_CONVERSATIONS:
            del self._by_key[next(iter(self._by_key))]
        self._save()

    def forget(self, key: str) -> None:
        if self._by_key.pop(key, None) is not None:
            self._save()

    def items(self) -> list[tuple[str, Mapping]]:
        """Least recently stored first."""
        return list(self._by_key.items())

    def __len__(self) -> int:
        return len(self._by_key)

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
            partial.write_text(json.dumps({k: v.to_json() for k, v in self._by_key.items()}), encoding="utf-8")
            os.replace(partial, self.path)
        except OSError as exc:  # the mapping stays in memory; only a gateway restart would lose it
            log.warning("could not save the conversation map to %s: %s", self.path, exc)
