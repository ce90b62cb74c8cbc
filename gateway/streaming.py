"""Server-sent events in OpenAI's stream format: ``data: {chunk}`` lines, then ``data: [DONE]``.

A chat stream opens with each choice's role, then sends each choice's deltas (text, or a tool call's id and name
followed by pieces of its arguments), then each choice's finish reason, then the usage when asked for. The
generations were started (and their first tokens received) before the 200 status went out; an error after that
can only travel as a final event with OpenAI's error body."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from kvpool import protocol as p
from kvpool.client.errors import KvpoolError

from .errors import HttpError
from .generations import Generations
from .shaping import ChoiceState


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n".encode()


async def chat_events(
    generations: Generations,
    states: list[ChoiceState],
    head: dict[str, Any],
    usage: Callable[[], dict[str, Any]] | None,
    on_first_text: Callable[[], None],
) -> AsyncIterator[bytes]:
    """The chat stream's events. ``usage``: the usage chunk's body at the end (None: not asked for)."""
    opening = {"role": "assistant", "content": None if states[0].envelope is not None else ""}
    # Every choice's opening in the first chunk: clients (the openai SDK's stream helpers) build their list of
    # choices from it.
    yield sse(head | {"choices": [{"index": s.index, "delta": opening, "finish_reason": None} for s in states]})
    first = True
    try:
        async for index, item in generations.events():
            state = states[index]
            if isinstance(item, p.Final):
                state.final = item
                yield sse(head | {"choices": [{"index": index, "delta": {}, "finish_reason": state.finish_reason()}]})
                continue
            for choice in state.chat_deltas(item):
                if first:
                    on_first_text()
                    first = False
                yield sse(head | {"choices": [choice]})
        if usage is not None:
            yield sse(head | {"choices": [], "usage": usage()})
        yield sse("[DONE]")
    except KvpoolError as exc:  # the status line went out already: the error travels as an event
        yield sse(HttpError.from_kvpool(exc.code, exc.message).body())


async def completion_events(
    generations: Generations,
    states: list[ChoiceState],
    head: dict[str, Any],
    usage: Callable[[], dict[str, Any]] | None,
    on_first_text: Callable[[], None],
) -> AsyncIterator[bytes]:
    if states[0].shape.echo:
        for state in states:
            echoed = {"index": state.index, "text": state.shape.echo, "logprobs": None, "finish_reason": None}
            yield sse(head | {"choices": [echoed]})
    first = True
    try:
        async for index, item in generations.events():
            state = states[index]
            if isinstance(item, p.Final):
                state.final = item
                ending = {"index": index, "text": "", "logprobs": None, "finish_reason": state.finish_reason()}
                yield sse(head | {"choices": [ending]})
                continue
            choice = state.completion_delta(item)
            if choice is not None:
                if first:
                    on_first_text()
                    first = False
                yield sse(head | {"choices": [choice]})
        if usage is not None:
            yield sse(head | {"choices": [], "usage": usage()})
        yield sse("[DONE]")
    except KvpoolError as exc:
        yield sse(HttpError.from_kvpool(exc.code, exc.message).body())
