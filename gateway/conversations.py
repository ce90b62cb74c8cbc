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

from kvpool.client.conversation import Held, digest

log = logging.getLogger("kvpool.gateway")
MAX_CONVERSATIONS = 4096  # the oldest mapping goes first beyond this (the daemon's sessions expire on their own)


@dataclass(frozen=True)
class Followed:
    """A session that holds, right after the answer ``held`` stands for, text computed before the next rendering
    came (the opening of a tool's result, tool_result_prefill.py): it holds ``tokens`` now, and the next rendering
    must go on with that text (``then_chars`` characters, sha256 ``then_hash``)."""

    held: Held
    tokens: int
    then_chars: int
    then_hash: str

    @classmethod
    def after(cls, held: Held, text: str, tokens: int) -> Followed:
        return cls(held, tokens, len(text), digest(text))

    @property
    def text_chars(self) -> int:
        return self.held.text_chars + self.then_chars

    def rest(self, rendered: str) -> str | None:
        """The new part of ``rendered`` when it continues the answer and the text after it, else None."""
        rest = self.held.rest(rendered)
        if rest is None or len(rest) <= self.then_chars or digest(rest[: self.then_chars]) != self.then_hash:
            return None
        return rest[self.then_chars :]

    def trim(self, tokens: list[int]) -> list[int]:
        """The answer's end-of-generation token came before the text: nothing of the rest is held twice."""
        return tokens

    def to_json(self) -> dict[str, object]:
        return {"held": asdict(self.held), "tokens": self.tokens, "then_chars": self.then_chars, "then": self.then_hash}

    @classmethod
    def load(cls, record: object) -> Followed | None:
        if not isinstance(record, dict):
            return None
        held = Held.load(record.get("held"))
        try:
            return cls(held, int(record["tokens"]), int(record["then_chars"]), str(record["then"])) if held else None
        except (KeyError, TypeError, ValueError):
            return None


Standing = Held | Followed  # what a conversation's session stands for


@dataclass(frozen=True)
class Mapping:
    """A conversation's session, and what it stands for (None: nothing to continue from)."""

    session: str
    token: str
    held: Standing | None = None
    # How its text was tokenized (special tokens parsed: the chat routes; as text: /v1/completions). The same text
    # tokenized the other way is other tokens, so a request of the other kind does not continue it. None: not
    # recorded (a map an older gateway wrote), so no request continues it.
    special: bool | None = True

    def to_json(self) -> dict[str, object]:
        raw: dict[str, object] = {"session": self.session, "token": self.token, "held": None, "special": self.special}
        if isinstance(self.held, Followed):
            raw["followed"] = self.held.to_json()
        elif self.held is not None:
            raw["held"] = asdict(self.held)
        return raw

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> Mapping:
        held: Standing | None = Followed.load(raw["followed"]) if "followed" in raw else Held.load(raw.get("held"))
        special = raw.get("special")
        return cls(str(raw["session"]), str(raw["token"]), held, special if isinstance(special, bool) else None)


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
