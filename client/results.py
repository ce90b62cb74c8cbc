"""What the sync and asyncio clients share: request building, reply checking and the result types."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from kvpool import protocol as p
from kvpool.protocol.status import DaemonStatus

from .errors import BadRequest, KvpoolError, error_from_code

T = TypeVar("T")


@dataclass
class Completion:
    """The whole result of one generation (what ``Session.complete`` returns)."""

    text: str
    tokens: list[int]
    finish_reason: str
    usage: p.Usage
    timings: p.Timings
    logprobs: list[p.TokenLogprob] = field(default_factory=list)  # one per token, when asked for (logprobs=)

    @property
    def ttft_ms(self) -> float:
        return self.timings.ttft_ms


@dataclass
class Collector:
    """Folds a stream of chunks and its final message into a Completion."""

    parts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[p.TokenLogprob] = field(default_factory=list)

    def add(self, chunk: p.Chunk) -> None:
        self.parts.append(chunk.text)
        self.tokens.extend(chunk.tokens)
        self.logprobs.extend(chunk.logprobs or ())

    def result(self, final: p.Final) -> Completion:
        text = "".join(self.parts)
        return Completion(text, self.tokens, str(final.finish_reason), final.usage, final.timings, self.logprobs)


WirePart = str | list[int] | p.Medium  # a part as the protocol carries it
Prompt = str | list[int] | list[WirePart]  # text, token ids, or parts with media (client/media.py)


def _in_parts(prompt: list[Any]) -> bool:
    """A list of parts (text, token-id pieces, media), not a list of token ids."""
    return any(isinstance(x, str | list | p.Medium) for x in prompt)


def _checked_prompt(prompt: object, what: str) -> None:
    """BadRequest for a prompt of another type than text, a list (or tuple) of token ids, or a list of parts:
    anything else would be read as one of them (a dict as its keys, bytes as token ids)."""
    if not isinstance(prompt, str | list | tuple):
        raise BadRequest(
            f"The {what} is text, a list of token ids or a list of parts (text, token ids, media), "
            f"not {type(prompt).__name__}."
        )


def generate_request(session: str, token: str, prompt: Prompt, params: dict[str, Any]) -> p.Generate:
    """Build a Generate message; bad parameter types or values raise BadRequest before anything is sent."""
    _checked_prompt(prompt, "prompt")
    fields: dict[str, Any] = {"session": session, "token": token, **params}
    if isinstance(fields.get("json_schema"), dict):  # a schema as Python data travels as its JSON text
        fields["json_schema"] = json.dumps(fields["json_schema"])
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    elif _in_parts(prompt):
        return _converted({**fields, "parts": []}, p.Generate, "generate", parts=list(prompt))
    else:
        fields["prompt_tokens"] = list(prompt)
    try:
        # Round-tripping through the schema applies its constraints on the client side too.
        return msgspec.convert(fields, p.Generate)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid generate parameters: {exc}.") from None


def _converted(fields: dict[str, Any], kind: type[T], what: str, parts: list[WirePart]) -> T:
    """A message with parts: the media are Structs already, the rest is checked against the schema."""
    try:
        message = msgspec.convert(fields, kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid {what} parameters: {exc}.") from None
    name = "parts" if kind is p.Generate else "system_parts"
    setattr(message, name, parts)
    try:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=kind)  # (the parts' limits apply)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid {what} parameters: {exc}.") from None


def open_request(task: str, system_prompt: Prompt | None) -> p.OpenSession:
    """Build an OpenSession message: a system prompt is text, token ids or parts; None leaves the task's own."""
    if system_prompt is not None:
        _checked_prompt(system_prompt, "system prompt")
    fields: dict[str, Any] = {"task": task}
    if isinstance(system_prompt, str):
        fields["system_prompt"] = system_prompt
    elif system_prompt is not None and _in_parts(system_prompt):
        return _converted({**fields, "system_parts": []}, p.OpenSession, "open_session", parts=list(system_prompt))
    elif system_prompt is not None:
        fields["system_prompt_tokens"] = list(system_prompt)
    try:
        return msgspec.convert(fields, p.OpenSession)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"Invalid open_session parameters: {exc}.") from None


def check_migration_target(status: DaemonStatus, address: str) -> None:
    """BadRequest before a session is let go, when the daemon it would move to could not take it over."""
    if status.remote is None:
        raise BadRequest(
            f"The daemon at {address} has no remote tier (`remote` is not set there): a session moves only between "
            "daemons that share one; it stays where it is."
        )


def left_for_the_remote_tier(exc: KvpoolError, session: str) -> KvpoolError:
    """The error of a resume that failed after the session was handed over, saying where the session is now."""
    return exc.reworded(
        f"{exc.message} Session {session} has left the daemon it was on and waits in the remote tier: resume it on "
        "any daemon that shares that tier."
    )


def raise_if_error(reply: p.AnyReply) -> p.AnyReply:
    """The reply, unless it is an error; a generation cut short always raises (an Error whose detail says what the
    session kept, or an older daemon's `shutdown` finish), so a cut answer never reads as a finished one."""
    if isinstance(reply, p.Error):
        raise error_from_code(reply.code, reply.message, reply.detail)
    if isinstance(reply, p.Final) and reply.finish_reason == p.FinishReason.SHUTDOWN:
        raise error_from_code(
            p.ErrorCode.SHUTTING_DOWN,
            "The daemon stopped during this generation; resume the session once it is back and continue it.",
            p.cut_detail(reply.usage.completion_tokens, reply.usage.context_tokens),
        )
    return reply


def expect(reply: p.AnyReply, kind: type[T]) -> T:
    reply = raise_if_error(reply)
    if not isinstance(reply, kind):
        raise KvpoolError(
            f"Expected a {kind.__name__} reply, got {type(reply).__name__}; is the daemon a matching kvpool version?",
            code="PROTOCOL",
        )
    return reply
