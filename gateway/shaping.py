"""OpenAI's response bodies from the daemon's chunks: one ``ChoiceState`` per choice folds its chunks into a chat
message or a text completion (whole, or as the deltas of a stream), with log-probabilities in OpenAI's two forms
and tool calls read from kvpool's envelope (tools.py)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

from kvpool import protocol as p

from .tools import AnswerMemory, Call, EnvelopeParser

# The daemon's finish reasons that end an answer normally; any other end reaches the caller as an error
# (generations.py), never as one of these.
FINISH = {"stop": "stop", "length": "length"}


@dataclass(frozen=True)
class ChoiceFormat:
    """How a request's choices are shaped."""

    chat: bool
    logprobs: int | None = None  # top entries per token (None: no logprobs)
    tools: bool = False  # the answer is the tool envelope
    echo: str = ""  # completions: the prompt, put before the text


def usage(
    prompt_tokens: int, completion_tokens: int, cached: int, prediction: tuple[int, int] | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; ``prediction``: a predicted output's tokens guessed and taken, and guessed and
    refused (the request had a prediction)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if prediction is not None:
        accepted, rejected = prediction
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": rejected,
        }
    return out


def token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def legacy_token(piece: bytes) -> str:
    """A token in OpenAI's legacy completions logprobs: its text, or ``bytes:\\xNN...`` when it is not whole UTF-8."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def chat_logprob(entry: p.TokenLogprob) -> dict[str, Any]:
    return {
        "token": token_text(entry.piece),
        "logprob": entry.logprob,
        "bytes": list(entry.piece),
        "top_logprobs": [
            {"token": token_text(top.piece), "logprob": top.logprob, "bytes": list(top.piece)} for top in entry.top
        ],
    }


@dataclass
class ChoiceState:
    """One choice's answer so far."""

    index: int
    choice_format: ChoiceFormat
    text: list[str] = field(default_factory=list)  # the generated text, as the daemon streamed it
    logprobs: list[p.TokenLogprob] = field(default_factory=list)  # those of the tokens whose text is shown
    offsets: list[int] = field(default_factory=list)  # each one's token's first character in the text
    final: p.Final | None = None
    envelope: EnvelopeParser | None = None
    _announced: int = 0  # calls whose first delta (id, name) went out
    _arguments_sent: list[int] = field(default_factory=list)
    _response_sent: int = 0
    _held: list[p.TokenLogprob] = field(default_factory=list)  # entries whose text the daemon has not shown yet
    _shown: int = 0  # characters of text shown
    _covered: int = 0  # characters the shown entries' bytes decode to (a character they begin and not end: not)
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )

    def __post_init__(self) -> None:
        if self.choice_format.tools:
            self.envelope = EnvelopeParser()

    def add(self, chunk: p.Chunk) -> list[p.TokenLogprob]:
        """Fold in one chunk; the log-probability entries its text shows (those of tokens it completes)."""
        self.text.append(chunk.text)
        self._shown += len(chunk.text)
        # A token that stands for no text (the end of generation) has no entry: it is not part of the answer.
        self._held.extend(entry for entry in chunk.logprobs or () if entry.piece)
        shown = self._show_entries()
        if self.envelope is not None:
            self.envelope.feed(chunk.text)
        return shown

    def _show_entries(self) -> list[p.TokenLogprob]:
        """The held entries whose text has been shown, in order. The daemon holds back text that may begin a stop
        string and drops the stop string's, but sends every token's entry at once: an entry is shown with the
        text its bytes decode to (decoded as the daemon decodes them), and a stop string's entries never are."""
        shown = []
        while self._held:
            entry, state = self._held[0], self._decoder.getstate()
            chars = self._covered + len(self._decoder.decode(entry.piece))
            if chars + (1 if self._decoder.getstate()[0] else 0) > self._shown:
                self._decoder.setstate(state)  # (not shown yet: decoded again when more text comes)
                break
            self.offsets.append(self._covered)
            self._covered = chars
            shown.append(self._held.pop(0))
        self.logprobs.extend(shown)
        return shown

    @property
    def raw(self) -> str:
        return "".join(self.text)

    def finish_reason(self) -> str:
        if self.final is None or str(self.final.finish_reason) not in FINISH:
            raise RuntimeError("an answer that did not end normally was about to be reported as finished")
        reason = FINISH[str(self.final.finish_reason)]
        envelope = self.envelope
        if reason == "stop" and envelope is not None and envelope.calls and not envelope.responding:
            # Calls whose envelope a stop string cut (a template's implied one, written as text inside it) are not
            # whole: the answer stopped, and says so, rather than hand over half a call's arguments as a call.
            return "tool_calls" if envelope.whole else "stop"
        return reason

    # ------------------------------------------------------------------ whole answers

    def content(self) -> str | None:
        if self.envelope is None:
            return self.raw
        return self.envelope.response if self.envelope.responding else None

    def named_calls(self) -> list[Call]:
        """The calls the answer hands over: those named so far. None where the answer stopped with its envelope
        open (a stop string inside it: half a call is no call); an answer its limit cut hands them over as they
        are, and says so (length)."""
        envelope = self.envelope
        if envelope is None or envelope.responding:
            return []
        if not envelope.whole and self.final is not None and str(self.final.finish_reason) == "stop":
            return []
        return [call for call in envelope.calls if call.named]

    def calls(self) -> list[tuple[str, str]]:
        return [(call.name, call.arguments) for call in self.named_calls()]

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content(), "refusal": None}
        if calls := self.named_calls():
            message["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in calls
            ]
        return message

    def remember(self, memory: AnswerMemory) -> None:
        """Keep the raw text behind a reshaped answer, for when the client sends it back."""
        if self.envelope is not None:
            memory.remember(self.content(), self.calls(), self.raw)

    def chat_choice(self) -> dict[str, Any]:
        logprobs = {"content": [chat_logprob(e) for e in self.logprobs], "refusal": None}
        return {
            "index": self.index,
            "message": self.message(),
            "logprobs": logprobs if self.choice_format.logprobs is not None else None,
            "finish_reason": self.finish_reason(),
        }

    def completion_choice(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.choice_format.echo + self.raw,
            "logprobs": self.completion_logprobs(self.logprobs, self.offsets),
            "finish_reason": self.finish_reason(),
        }

    def completion_logprobs(self, entries: list[p.TokenLogprob], offsets: list[int]) -> dict[str, Any] | None:
        """OpenAI's legacy form: tokens, their log-probabilities, the top ones as {token: logprob}, and each
        token's first character in the text (a token inside a character: that character's). A token that is not
        whole UTF-8 is written as its bytes, ``bytes:\\xNN``, as OpenAI writes one, so that two such tokens are
        two keys."""
        if self.choice_format.logprobs is None:
            return None
        return {
            "tokens": [legacy_token(e.piece) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{legacy_token(t.piece): t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ streamed answers

    def chat_deltas(self, chunk: p.Chunk) -> list[dict[str, Any]]:
        """The choices of the chat stream's chunks for ``chunk``: usually one; a call's opening and its first
        arguments go out as two, as OpenAI streams them. The log-probabilities of the text it shows ride on the
        first."""
        entries = self.add(chunk)
        deltas = self._envelope_deltas() if self.envelope is not None else [{"content": chunk.text}]
        deltas = [delta for delta in deltas if delta.get("content") != ""]
        if not deltas and entries:
            deltas = [{}]
        choices = [{"index": self.index, "delta": delta, "finish_reason": None} for delta in deltas]
        if choices and self.choice_format.logprobs is not None:
            for choice in choices:
                choice["logprobs"] = None
            choices[0]["logprobs"] = {"content": [chat_logprob(e) for e in entries], "refusal": None}
        return choices

    def _envelope_deltas(self) -> list[dict[str, Any]]:
        """What the envelope has grown by: a call's id and name first (as OpenAI streams them), then pieces of
        its arguments; or pieces of the response."""
        assert self.envelope is not None
        envelope = self.envelope
        if envelope.responding:
            piece, self._response_sent = envelope.response[self._response_sent :], len(envelope.response)
            return [{"content": piece}] if piece else []
        deltas = []
        for index, call in enumerate(envelope.calls):
            if not call.named:
                break
            if index >= self._announced:
                self._announced += 1
                self._arguments_sent.append(0)
                opening = {
                    "index": index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
                deltas.append({"tool_calls": [opening]})
            piece = call.arguments[self._arguments_sent[index] :]
            if piece:
                self._arguments_sent[index] = len(call.arguments)
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return deltas

    def completion_delta(self, chunk: p.Chunk) -> dict[str, Any] | None:
        entries = self.add(chunk)
        if not chunk.text and not entries:
            return None
        return {
            "index": self.index,
            "text": chunk.text,
            "logprobs": self.completion_logprobs(entries, self.offsets[len(self.offsets) - len(entries) :]),
            "finish_reason": None,
        }
