"""Server-sent events in OpenAI's stream format: ``data: {chunk}`` lines, then ``data: [DONE]``.

A chat stream opens with each choice's role, then sends each choice's deltas (text, or a tool call's id and name
followed by pieces of its arguments), then each choice's finish reason, then the usage when asked for. The
generations were started (and their first tokens received) before the 200 status went out; an error after that
can only travel as a final event with OpenAI's error body."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpool import protocol as p
from kvpool.client.errors import KvpoolError

from .generations import Generations
from .http_errors import HttpError
from .shaping import ChoiceState


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n".encode()


@dataclass(frozen=True)
class Stream:
    """What a stream's events are made of: the running generations and their choices' states, the chunks' common
    fields (``head``), the usage chunk's body at the end (None: not asked for), what to call at the first text, and
    what to call when the stream ends with an error event instead of its own end."""

    generations: Generations
    states: list[ChoiceState]
    head: dict[str, Any]
    usage: Callable[[], dict[str, Any]] | None
    on_first_text: Callable[[], None]
    on_cut: Callable[[KvpoolError], None]


async def first_choice_deltas(stream: Stream) -> AsyncIterator[dict[str, Any]]:
    """The deltas of the stream's one choice as chat chunks carry them (text, tool calls), for another API's events
    (anthropic_messages.py, responses_api.py); its final message is kept in its state."""
    state = stream.states[0]
    first = True
    async for _, item in stream.generations.events():
        if isinstance(item, p.Final):
            state.final = item
            continue
        for choice in state.chat_deltas(item):
            if first:
                stream.on_first_text()
                first = False
            yield choice["delta"]


async def chat_events(stream: Stream) -> AsyncIterator[bytes]:
    """The chat stream's events."""
    states, head = stream.states, stream.head
    opening = {"role": "assistant", "content": None if states[0].envelope is not None else ""}
    # Every choice's opening in the first chunk: clients (the openai SDK's stream helpers) build their list of
    # choices from it.
    yield sse(head | {"choices": [{"index": s.index, "delta": opening, "finish_reason": None} for s in states]})

    def ending(state: ChoiceState) -> dict[str, Any]:
        return {"index": state.index, "delta": {}, "finish_reason": state.finish_reason()}

    async for event in _events(stream, ChoiceState.chat_deltas, ending):
        yield event


async def completion_events(stream: Stream) -> AsyncIterator[bytes]:
    """The completion stream's events (the prompt first, with `echo`)."""
    states, head = stream.states, stream.head
    if states[0].choice_format.echo:
        for state in states:
            echoed = {"index": state.index, "text": state.choice_format.echo, "logprobs": None, "finish_reason": None}
            yield sse(head | {"choices": [echoed]})

    def deltas(state: ChoiceState, chunk: p.Chunk) -> list[dict[str, Any]]:
        choice = state.completion_delta(chunk)
        return [] if choice is None else [choice]

    def ending(state: ChoiceState) -> dict[str, Any]:
        return {"index": state.index, "text": "", "logprobs": None, "finish_reason": state.finish_reason()}

    async for event in _events(stream, deltas, ending):
        yield event


async def _events(
    stream: Stream,
    deltas: Callable[[ChoiceState, p.Chunk], list[dict[str, Any]]],
    ending: Callable[[ChoiceState], dict[str, Any]],
) -> AsyncIterator[bytes]:
    """Each choice's deltas as they come, its ending when it ends, then the usage and [DONE]."""
    states, head = stream.states, stream.head
    first = True
    try:
        async for index, item in stream.generations.events():
            state = states[index]
            if isinstance(item, p.Final):
                state.final = item
                yield sse(head | {"choices": [ending(state)]})
                continue
            for choice in deltas(state, item):
                if first:
                    stream.on_first_text()
                    first = False
                yield sse(head | {"choices": [choice]})
        if stream.usage is not None:
            yield sse(head | {"choices": [], "usage": stream.usage()})
        yield sse("[DONE]")
    except KvpoolError as exc:  # the status line went out already: the error travels as an event
        stream.on_cut(exc)
        yield sse(HttpError.from_kvpool(exc.code, exc.message).body())
