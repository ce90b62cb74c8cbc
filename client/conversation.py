"""A chat conversation on one kvpool session, as a client that renders a chat template sees it: what the session
stands for, and which part of the next rendering is new. Shared by `kvpool chat` and the HTTP gateway.

The session stands for the conversation as the template rendered it up to the last answer, plus the text of
every token generated (a stop string's included: the session holds it). When the next rendering begins with
that text, only the rest needs computing; comparing text, not tokens, keeps that true when an answer's tokens
would tokenize differently when sent back. Anything else (an edited history, a cancelled answer) needs a new
session, so an answer always comes from exactly the conversation sent.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvpool import protocol as p

# Daemon error codes that come before a turn applied anything to its session: it can be sent again as it was.
REFUSALS = frozenset(
    {"BUDGET_UNMEETABLE", "OVERLOADED", "QUOTA_EXCEEDED", "CONTEXT_OVERFLOW", "BAD_REQUEST", "SHUTTING_DOWN"}
)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Held:
    """``tokens`` the session holds, standing for the first ``text_chars`` characters of the rendering (their
    sha256 is ``text_hash``); ``eog_token``: the end-of-generation token the last answer ended with (-1: none)."""

    tokens: int
    text_chars: int
    text_hash: str
    eog_token: int = -1

    def rest(self, rendered: str) -> str | None:
        """The new part of ``rendered`` when it continues what the session holds, else None."""
        if 0 < self.text_chars < len(rendered) and digest(rendered[: self.text_chars]) == self.text_hash:
            return rendered[self.text_chars :]
        return None

    def trim(self, tokens: list[int]) -> list[int]:
        """The session holds the end-of-generation token its answer ended with; the template writes it again."""
        return tokens[1:] if tokens[:1] == [self.eog_token] else tokens


def after_answer(rendered: str, generated_text: str, generated: list[int], final: p.Final | None) -> Held | None:
    """What the session stands for after an answer to ``rendered``; None when it cannot be continued (the answer
    was cancelled, or failed)."""
    if final is None or final.finish_reason not in (p.FinishReason.LENGTH, p.FinishReason.STOP):
        return None
    text = rendered + generated_text
    eog = generated[-1] if final.eog and generated else -1
    return Held(final.usage.context_tokens, len(text), digest(text), eog)
