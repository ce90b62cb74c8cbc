"""Stored responses (the Responses API's ``store``): each with the conversation it ends, so that a request naming it
as ``previous_response_id`` goes on from there. Kept in a SQLite file beside the conversation map, so they outlive
a gateway restart, and bounded: at most ``max_count`` responses and ``max_bytes`` of them, each for ``ttl_s`` (then
gone, as OpenAI's expire); the oldest go first.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("kvpool.gateway")


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    chain: str  # the named conversation (turns.py) its chain runs as ("": unnamed, found by its history)
    messages: list[dict[str, Any]]  # the conversation up to and with this response, as chat messages
    input_items: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, path: Path | None, max_count: int, max_bytes: int, ttl_s: float):
        """``path``: the SQLite file (None: kept in memory, gone with the gateway)."""
        self.max_count, self.max_bytes, self.ttl_s = max_count, max_bytes, ttl_s
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._db = sqlite3.connect(str(path) if path is not None else ":memory:", check_same_thread=False)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created REAL, expires REAL, bytes INTEGER,"
            " chain TEXT, body TEXT)"
        )
        self._db.commit()

    def put(
        self, response: dict[str, Any], chain: str, messages: list[dict[str, Any]], items: list[dict[str, Any]]
    ) -> None:
        body = json.dumps({"response": response, "messages": messages, "input_items": items}, ensure_ascii=False)
        now = time.time()
        try:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (response["id"], now, now + self.ttl_s, len(body), chain, body),
            )
            self._trim(now)
            self._db.commit()
        except sqlite3.Error as exc:  # the answer went out already; only its chaining is lost
            log.warning("could not store response %s: %s", response["id"], exc)

    def get(self, response_id: str) -> StoredResponse | None:
        row = self._db.execute(
            "SELECT chain, body FROM responses WHERE id = ? AND expires > ?", (response_id, time.time())
        ).fetchone()
        if row is None:
            return None
        body = json.loads(row[1])
        return StoredResponse(body["response"], row[0], body["messages"], body["input_items"])

    def delete(self, response_id: str) -> bool:
        gone = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
        self._db.commit()
        return gone

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def _trim(self, now: float) -> None:
        self._db.execute("DELETE FROM responses WHERE expires <= ?", (now,))
        count, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses").fetchone()
        if count <= self.max_count and size <= self.max_bytes:
            return
        for response_id, n in self._db.execute("SELECT id, bytes FROM responses ORDER BY created").fetchall():
            if count <= self.max_count and size <= self.max_bytes:
                break
            self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            count, size = count - 1, size - n

    def close(self) -> None:
        self._db.close()
