"""Turn a stream of token byte pieces into text chunks that are valid UTF-8 and never show a stop string.

A character may span several tokens (byte-fallback vocabularies, emoji), so bytes are held until they form
whole characters. Text that could be the beginning of a stop string is held back until it is clear whether
the stop string follows; when it does, everything from the stop string on is dropped.
"""

from __future__ import annotations

import codecs


class StreamText:
    def __init__(self, stop: list[str]):
        self._stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not emitted yet because it may start a stop string
        self.stopped = False  # a stop string was found; nothing more will be emitted
        self.matched: str | None = None  # which one (the first in the text; the first listed where two start there)

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to show."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(piece)
        found = [(i, s) for s in self._stop if (i := self._held.find(s)) >= 0]
        cut = min((i for i, _ in found), default=-1)
        if cut >= 0:
            self.stopped = True
            self.matched = next(s for i, s in found if i == cut)
            out, self._held = self._held[:cut], ""
            return out
        keep = self._longest_stop_prefix_suffix()
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return out

    def flush(self) -> str:
        """The generation ended for another reason: release what was held (incomplete bytes become U+FFFD)."""
        if self.stopped:
            return ""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._held)), best, -1):
                if self._held.endswith(s[:n]):
                    best = n
                    break
        return best
