"""The daemon generations behind one request's choices, started before any HTTP status goes out.

``start()`` sends them and waits for each choice's first chunk (or the daemon's refusal), so a streamed request's
refusal is an HTTP status, never an error event after 200. ``events()`` then yields every (choice index, chunk)
and each choice's final message; ``close()`` cancels what still runs and gives the sessions back.

- ``ConversationGenerations``: one choice on the conversation's session (turns.py), so earlier turns' KV is reused.
- ``SharedPrefixGenerations``: n choices on n fresh sessions that share the prompt's KV through the daemon's prefix
  machinery (docs/prefix-sharing.md): each session starts with the prompt but its last token as its "system prompt";
  the first choice computes it, the daemon turns those cells into a shared prefix as the computation passes their
  end, and the other choices, started once the first has its first token, take the cells instead of computing them.
  The last token is each choice's own prompt, since a session must compute at least one token for its logits; this
  keeps the share whole on sliding-window models (Gemma 3), where a prefix is shared only at its full length.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec

from kvpool import protocol as p
from kvpool.client.aio import AsyncClient, AsyncSession, AsyncStream
from kvpool.client.conversation import REFUSALS, Held
from kvpool.client.errors import KvpoolError

from .continuation import RESUMABLE, rest_of, resume_and_generate
from .http_errors import CANCELLED
from .media_parts import RequestMedia
from .shaping import FINISH
from .turns import Turn, Turns

Event = tuple[int, p.Chunk | p.Final]
log = logging.getLogger("kvpool.gateway")


async def _next(stream: AsyncStream) -> p.Chunk | p.Final:
    """The stream's next chunk, or its final message once it ended normally. Any other end raises: a cut is an
    Error from the daemon already; a generation cancelled by someone else (its session cancelled or closed by
    another request with its token) raises CANCELLED here, so it is never reported as finished."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        final = stream.final
        assert final is not None
        if str(final.finish_reason) not in FINISH:
            raise KvpoolError(
                f"This answer was cancelled after {final.usage.completion_tokens} tokens: its session was cancelled "
                "or closed by another request. Send the request again.",
                code=CANCELLED,
                detail=p.cut_detail(final.usage.completion_tokens, final.usage.context_tokens),
            ) from None
        return final


_PART = re.compile(r"\bparts\[(\d+)\]")


def with_part_names(exc: KvpoolError, names: dict[int, str]) -> KvpoolError:
    """The daemon's refusal of a medium (``parts[3]: ...``) naming the request field it came from instead."""

    def field(match: re.Match[str]) -> str:
        name = names.get(int(match.group(1)))
        return f"`{name}`" if name is not None else match.group(0)

    return exc.reworded(_PART.sub(field, exc.message))


class Generations:
    n: int = 1
    prompt_tokens: int = 0  # the request's prompt (a conversation's whole history), counted once
    cached_tokens: int = 0  # of those, what the session held already

    async def start(self) -> None:
        raise NotImplementedError

    def follow_with(self, opening: Callable[[Held], str | None]) -> None:
        """What the next request will begin with after this answer: a conversation prefills it (tool_result_prefill)."""

    def events(self) -> AsyncIterator[Event]:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class ConversationGenerations(Generations):
    def __init__(
        self,
        turns: Turns,
        client: AsyncClient,
        key: str | None,
        text: str,
        special: bool,
        add_bos: bool,
        params: dict[str, Any],
        resume_wait: float = 0.0,
        on_continued: Callable[[str], None] | None = None,
        media: RequestMedia | None = None,
    ):
        """``resume_wait``: how long an answer cut short waits for its daemon to take it back and continue it
        (continuation.py; 0: a cut is the caller's error). ``on_continued`` is told each continuation's cause.
        ``media``: the images and audio ``text``'s markers name."""
        self._context = turns.turn(client, key, text, "default", special=special, add_bos=add_bos, media=media)
        self._client = client
        self._params = params
        self._resume_wait = resume_wait
        self._on_continued = on_continued
        self._entered = False
        self._turn: Turn | None = None
        self._stream: AsyncStream | None = None
        self._first: p.Chunk | p.Final | None = None
        self._before_continuing = 0  # tokens generated before the latest continuation (its final counts the rest)

    async def start(self) -> None:
        self._turn = await self._context.__aenter__()
        self._entered = True
        turn = self._turn
        self.prompt_tokens, self.cached_tokens = turn.held + len(turn.tokens), turn.held
        # (a turn with media: its cells are counted once the daemon answered, from its final message)
        self._stream = turn.session.generate(turn.parts or turn.tokens, after=turn.held, **self._params)
        self._first = await self._read()

    def follow_with(self, opening: Callable[[Held], str | None]) -> None:
        if self._turn is not None:
            self._turn.next_opening = opening

    async def _read(self) -> p.Chunk | p.Final:
        assert self._turn is not None and self._stream is not None
        try:
            item = await _next(self._stream)
        except KvpoolError as exc:
            continued = await self._continue(exc)
            if continued is None:
                # A refusal (over budget, overloaded) comes before anything was applied to the session.
                self._turn.refused = exc.code in REFUSALS and not exc.cut
                if self._turn.part_names and _PART.search(exc.message):
                    raise with_part_names(exc, self._turn.part_names) from None
                raise
            item = continued
        if isinstance(item, p.Chunk):
            self._turn.record(item)
        else:
            if self._before_continuing:
                usage = msgspec.structs.replace(
                    item.usage, completion_tokens=item.usage.completion_tokens + self._before_continuing
                )
                item = msgspec.structs.replace(item, usage=usage)
            self._turn.final = item
            if self._turn.parts:
                self.prompt_tokens = self._turn.held + item.usage.prompt_tokens
        return item

    async def _continue(self, cut: KvpoolError) -> p.Chunk | p.Final | None:
        """The first item of the rest of an answer the daemon cut short, or None when it cannot go on."""
        turn = self._turn
        assert turn is not None
        if not self._resume_wait or not cut.cut or cut.code not in RESUMABLE:
            return None
        start = turn.held + len(turn.tokens)
        if turn.parts:  # (its media's cells are counted by the daemon only: the cut's detail says where it began)
            start = cut.detail["context_tokens"] - cut.detail["completion_tokens"]
        kept, seen = cut.detail["context_tokens"], start + len(turn.generated)
        params = rest_of(self._params, start, len(turn.generated))
        if params is None or kept != seen:
            why = "it reached max_tokens" if params is None else f"it keeps {kept} tokens, this gateway saw {seen}"
            log.info("an answer cut short (%s) is not continued: %s", cut.code, why)
            return None
        log.info("continuing an answer cut short (%s) after %d tokens", cut.code, len(turn.generated))
        resumed = await resume_and_generate(
            self._client, turn.session.id, turn.session.token, kept, params, self._resume_wait, _next
        )
        if resumed is None:
            return None
        self._stream, first = resumed
        self._before_continuing = len(turn.generated)
        if self._on_continued is not None:
            self._on_continued(str(cut.code))
        return first

    async def events(self) -> AsyncIterator[Event]:
        item = self._first
        assert item is not None
        while True:
            yield 0, item
            if isinstance(item, p.Final):
                return
            item = await self._read()

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):  # a client that went away cancels the caller: finish the cleanup
            if self._stream is not None:
                await self._stream.aclose()  # a generation still running is cancelled
            if self._entered:
                self._entered = False
                await self._context.__aexit__(None, None, None)  # the conversation's record brought up to date


class SharedPrefixGenerations(Generations):
    def __init__(
        self,
        turns: Turns,
        client: AsyncClient,
        prompt: str | list[int],
        special: bool,
        add_bos: bool,
        params: dict[str, Any],
        n: int,
    ):
        self.n = n
        self._turns, self._client = turns, client
        self._prompt, self._special, self._add_bos = prompt, special, add_bos
        self._params = params
        self._sessions: list[AsyncSession] = []
        self._streams: list[AsyncStream] = []
        self._firsts: list[p.Chunk | p.Final] = []
        self._pumps: list[asyncio.Task[None]] = []

    def _choice_params(self, index: int) -> dict[str, Any]:
        """A request's seed gives each choice its own (seed + index): the same seed and prompt would otherwise make
        n identical choices."""
        seed = self._params.get("seed")
        return self._params if seed is None else {**self._params, "seed": (seed + index) % 2**32}

    async def start(self) -> None:
        prompt = self._prompt
        tokens = (
            prompt
            if isinstance(prompt, list)
            else await self._client.tokenize(prompt, add_bos=self._add_bos, special=self._special)
        )
        self.prompt_tokens = len(tokens)
        shared = self.n > 1 and len(tokens) > 1
        system, own = (tokens[:-1], tokens[-1:]) if shared else ([], tokens)
        for _ in range(self.n):
            self._sessions.append(await self._turns.open_session(self._client, "default", system or ""))
        # The first choice computes the prompt (and makes the shared prefix on the way); the others start once its
        # first token is out, when the prefix exists.
        self._streams.append(self._sessions[0].generate(own, **self._choice_params(0)))
        self._firsts.append(await _next(self._streams[0]))
        for index in range(1, self.n):
            self._streams.append(self._sessions[index].generate(own, **self._choice_params(index)))
        self._firsts += await asyncio.gather(*(_next(stream) for stream in self._streams[1:]))

    async def events(self) -> AsyncIterator[Event]:
        for index, first in enumerate(self._firsts):
            yield index, first
        queue: asyncio.Queue[tuple[int, p.Chunk | p.Final | Exception]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                while True:
                    item = await _next(self._streams[index])
                    queue.put_nowait((index, item))
                    if isinstance(item, p.Final):
                        return
            except Exception as exc:  # the reader raises it, in order with the chunks before it
                queue.put_nowait((index, exc))

        running = sum(1 for first in self._firsts if isinstance(first, p.Chunk))
        self._pumps = [
            asyncio.get_running_loop().create_task(pump(i))
            for i, first in enumerate(self._firsts)
            if isinstance(first, p.Chunk)
        ]
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield index, item
            if isinstance(item, p.Final):
                running -= 1

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            for pump in self._pumps:
                pump.cancel()
            for pump in self._pumps:
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
            for stream in self._streams:
                await stream.aclose()
            for session in self._sessions:
                with contextlib.suppress(KvpoolError):
                    await session.close()
