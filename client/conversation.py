"""A chat conversation on one kvpool session, as a client that renders a chat template sees it: what the session
stands for, and which part of the next rendering is new. Shared by `kvpool chat` and the HTTP gateway.

The session stands for the conversation as the template rendered it up to the last answer, plus the text of
every token generated (a stop string's included: the session holds it). When the next rendering begins with
that text (give or take the whitespace around the answer, which templates trim), only the rest needs computing;
comparing text, not tokens, keeps that true when an answer's tokens would tokenize differently when sent back.
Anything else (an edited history, a cancelled answer) needs a new session, so an answer always comes from exactly
the conversation sent.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvpool import protocol as p

# Daemon error codes that come before a turn applied anything to its session, unless the error is a cut
# (KvpoolError.cut: SHUTTING_DOWN mid-answer): such a turn can be sent again as it was.
REFUSALS = frozenset(
    {
        "BUDGET_UNMEETABLE",
        "OVERLOADED",
        "QUOTA_EXCEEDED",
        "CONTEXT_OVERFLOW",
        "BAD_REQUEST",
        "SHUTTING_DOWN",
        "SPILL_UNAVAILABLE",  # (the session is kept: its state could not be read or moved, nothing was applied)
    }
)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Held:
    """``tokens`` the session holds, standing for a rendering (its first ``prompt_chars`` characters, whitespace at
    their end left out; sha256 ``prompt_hash``) and the answer generated to it (``answer_chars`` characters,
    whitespace around them left out; sha256 ``answer_hash``). ``eog_token``: the end-of-generation token the answer
    ended with (-1: none).

    The whitespace between the rendering and the answer, and around the answer, is not compared: templates trim
    an answer's content, and write their own separator before it (a transcript's ``Assistant:`` prompt, answered
    by a JSON grammar with ``{``, comes back as ``Assistant: {``). The session keeps the answer as generated."""

    tokens: int
    prompt_chars: int
    prompt_hash: str
    answer_chars: int
    answer_hash: str
    eog_token: int = -1

    @property
    def text_chars(self) -> int:
        """How much of a rendering this session stands for (to prefer the longest of several)."""
        return self.prompt_chars + self.answer_chars

    def rest(self, rendered: str) -> str | None:
        """The new part of ``rendered`` when it continues what the session holds, else None."""
        if not 0 < self.prompt_chars <= len(rendered) or digest(rendered[: self.prompt_chars]) != self.prompt_hash:
            return None
        start = self.prompt_chars
        while start < len(rendered) and rendered[start].isspace():
            start += 1
        end = start + self.answer_chars
        if end >= len(rendered) or digest(rendered[start:end]) != self.answer_hash:
            return None
        return rendered[end:]

    def trim(self, tokens: list[int]) -> list[int]:
        """The session holds the end-of-generation token its answer ended with; the template writes it again."""
        return tokens[1:] if tokens[:1] == [self.eog_token] else tokens

    @classmethod
    def load(cls, record: object) -> Held | None:
        """A saved Held, or None when the record is not one (then the next turn starts a new session)."""
        if not isinstance(record, dict):
            return None
        record = dict(record)
        # Records written before the gateway kept a prefilled text apart (gateway/conversations.py's Followed)
        # have these fields: empty, they are the same Held; else the conversation starts afresh.
        if record.pop("then_chars", 0) or record.pop("then_hash", ""):
            return None
        try:
            return cls(**record)
        except TypeError:
            return None


def starting_with(text: str, tokens: int) -> Held:
    """A session that holds ``tokens`` standing for ``text`` (a conversation's start, opened as its system
    prompt), before any answer."""
    prompt = text.rstrip()
    return Held(tokens, len(prompt), digest(prompt), 0, digest(""))


def after_answer(rendered: str, generated_text: str, generated: list[int], final: p.Final | None) -> Held | None:
    """What the session stands for after an answer to ``rendered``; None when it cannot be continued (the answer
    was cancelled, or failed)."""
    if final is None or final.finish_reason not in (p.FinishReason.LENGTH, p.FinishReason.STOP):
        return None
    prompt, answer = rendered.rstrip(), generated_text.strip()
    eog = generated[-1] if final.eog and generated else -1
    return Held(final.usage.context_tokens, len(prompt), digest(prompt), len(answer), digest(answer), eog)
