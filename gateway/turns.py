"""Stateless in, stateful inside: each request's whole conversation becomes one turn on a kvpool session.

- A conversation named by ``prompt_cache_key`` (or ``X-Session-Id``) keeps its session, and the gateway
  remembers what the session stands for (kvpool.client.conversation). When the next request's rendering
  continues it, only the rest is tokenized and sent, with ``after=`` (so a retried request can never apply
  twice); the tokens the session held are ``cached_tokens``.
- Anything else (the first turn, an edited or cut history, a stop string the next rendering does not continue
  with, a cancelled answer, a session that is gone) gets a new session, so an answer always comes from exactly
  the conversation sent.
- Requests on one conversation take turns (a lock per name), so two at once never interleave in a session.
- A request without a name continues the idle session (among those the gateway keeps for such requests) whose
  text is the longest prefix of its rendering, so a client that resends its history without naming it still
  gets its earlier turns back; else it starts one. The gateway keeps at most a quarter of the daemon's
  max_sessions for them (closing the least recently used), and closes one more whenever the daemon has no room
  for a new session.
- A request the daemon refuses before it applied anything (over budget, overloaded) leaves its conversation as
  it was, so it can be sent again.
- A turn may name what the next request will begin with (a tool call's result): once the turn is over,
  tool_result_prefill.py computes that opening into the session, the conversation's lock handed over to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvpool import protocol as p
from kvpool.client.aio import AsyncClient, AsyncSession
from kvpool.client.conversation import Held, after_answer
from kvpool.client.errors import (
    KvpoolError,
    NotOwner,
    QuotaExceeded,
    SessionCorrupt,
    SessionEvicted,
    UnknownSession,
)
from kvpool.client.media import Audio, Image

from .admission import Admission
from .conversations import ConversationStore, Mapping, Standing
from .media_parts import RequestMedia, holds_media
from .metrics import GatewayMetrics
from .tool_result_prefill import ToolResultPrefill

log = logging.getLogger("kvpool.gateway")
GONE = (UnknownSession, SessionEvicted, SessionCorrupt, NotOwner)  # the mapping names a session that is no more
Release = Callable[[], None]


@dataclass
class Turn:
    session: AsyncSession
    tokens: list[int]  # what this turn sends
    held: int  # tokens the session held before (sent as after=): the prompt tokens not computed
    rendered: str  # the conversation as rendered, up to the answer
    special: bool = True  # how its text is tokenized (special tokens parsed)
    before: Standing | None = None  # what the session stood for before this turn (restored if it is refused)
    generated: list[int] = field(default_factory=list)
    final: p.Final | None = None
    refused: bool = False  # the daemon refused it before applying anything
    # What the next request will begin with after this answer, from what the session then stands for (None: not
    # known): prefilled once the turn is over.
    next_opening: Callable[[Held], str | None] | None = None
    # A turn with images or audio: what it sends in order (token ids of its text pieces, then each medium), which
    # ``tokens`` then counts only the text of.
    parts: list[list[int] | Image | Audio] | None = None
    part_names: dict[int, str] = field(default_factory=dict)  # a medium's index in ``parts`` -> its request field

    def record(self, chunk: p.Chunk) -> None:
        self.generated.extend(chunk.tokens)


class Turns:
    def __init__(
        self,
        store: ConversationStore,
        metrics: GatewayMetrics,
        admission: Admission,
        reuse: bool = True,
        anonymous_max: int = 16,
        anonymous: ConversationStore | None = None,
    ):
        """``reuse`` False: every request runs on a fresh session, closed when it ends (to measure against, or
        where conversations must not be kept). ``anonymous_max``: sessions kept for requests without a name;
        ``anonymous``: where they are recorded (a file: a restarted gateway, even a killed one, finds the sessions
        its predecessor opened, continues or closes them, and never strands them in the daemon).
        ``admission``: the queue, whose in-flight places a prefill takes only when one is free."""
        self.store = store
        self.metrics = metrics
        self.admission = admission
        self.reuse = reuse
        self.anonymous_max = anonymous_max
        self.anonymous = (
            anonymous if anonymous is not None else ConversationStore(None)
        )  # session id -> what it holds (requests without a name)
        self._busy: set[str] = set()  # anonymous sessions in a turn now
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiting: Counter[str] = Counter()  # requests holding or waiting for each conversation's lock
        self.prefill = ToolResultPrefill(store, admission, metrics, self._close_session)

    @contextlib.asynccontextmanager
    async def turn(
        self,
        client: AsyncClient,
        key: str | None,
        rendered: str,
        task: str,
        *,
        special: bool,
        add_bos: bool,
        media: RequestMedia | None = None,
    ) -> AsyncIterator[Turn]:
        """The session this request runs on and the tokens it must send; one turn at a time per conversation.
        On the way out, what the session stands for is brought up to date (from the turn's final message).
        ``media``: the images and audio the rendering's markers name."""
        if not self.reuse:
            turn = await self._fresh(client, rendered, task, special, add_bos, media)
            try:
                yield turn
            finally:
                await self._close_session(turn.session)
            return
        if key is None:
            async with self._anonymous_turn(client, rendered, task, special, add_bos, media) as turn:
                yield turn
            return
        release: Release | None = await self._lock(key)
        try:
            turn = await self._named(client, key, rendered, task, special, add_bos, media)
            try:
                yield turn
            finally:
                await self._remember(client, self.store, key, turn)
                if self.prefill.start(client, key, turn, release):
                    release = None  # the prefill holds the lock now, and gives it back when done
        finally:
            if release is not None:
                release()

    async def _lock(self, key: str) -> Release:
        """Take the conversation's lock; returns what gives it back. One lock per conversation, dropped once
        nobody holds or waits for it (names are unbounded)."""
        self._waiting[key] += 1
        lock = self._locks.setdefault(key, asyncio.Lock())

        def done_waiting() -> None:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]
                self._locks.pop(key, None)

        try:
            await lock.acquire()
        except BaseException:
            done_waiting()
            raise

        def release() -> None:
            lock.release()
            done_waiting()

        return release

    async def close(self) -> None:
        """Wait for the prefills still running (a stopping gateway keeps the conversations it was prefilling)."""
        await self.prefill.close()

    async def _named(
        self,
        client: AsyncClient,
        key: str,
        rendered: str,
        task: str,
        special: bool,
        add_bos: bool,
        media: RequestMedia | None = None,
    ) -> Turn:
        mapping = self.store.get(key)
        if mapping is not None:
            turn = await self._continue(client, mapping, rendered, special, media)
            if turn is not None:
                return turn
            self.store.forget(key)
        return await self._fresh(client, rendered, task, special, add_bos, media)

    @contextlib.asynccontextmanager
    async def _anonymous_turn(
        self,
        client: AsyncClient,
        rendered: str,
        task: str,
        special: bool,
        add_bos: bool,
        media: RequestMedia | None = None,
    ) -> AsyncIterator[Turn]:
        """A request without a name continues the idle anonymous session whose text is the longest prefix of its
        rendering (a client resending its history), else starts one; the session is then known by its id."""
        candidates = [
            (m.held.text_chars, session_id)
            for session_id, m in self.anonymous.items()
            if session_id not in self._busy
            and m.special == special
            and m.held is not None
            and m.held.rest(rendered) is not None
        ]
        turn: Turn | None = None
        if candidates:
            matched = max(candidates)[1]
            mapping = self.anonymous.get(matched)
            self.anonymous.forget(matched)  # this request owns it now: nobody else matches or evicts it
            assert mapping is not None
            try:
                turn = await self._continue(client, mapping, rendered, special, media)
            except BaseException:
                await self._close(client, mapping)  # nobody else can reach it any more
                raise
        if turn is None:
            turn = await self._fresh(client, rendered, task, special, add_bos, media)
        self._busy.add(turn.session.id)
        # Recorded while in use (nothing to continue from yet): a gateway killed now leaves it findable.
        self.anonymous.put(turn.session.id, Mapping(turn.session.id, turn.session.token, None, special))
        try:
            yield turn
        finally:
            self._busy.discard(turn.session.id)
            await self._remember(client, self.anonymous, turn.session.id, turn)
            while len(self.anonymous) > self.anonymous_max and await self._close_oldest_anonymous(client):
                pass

    async def _continue(
        self, client: AsyncClient, mapping: Mapping, rendered: str, special: bool, media: RequestMedia | None = None
    ) -> Turn | None:
        """The turn that continues ``mapping``'s session, or None (then its session is closed: it is not this
        conversation any more, or it is gone)."""
        rest = mapping.held.rest(rendered) if mapping.held is not None and mapping.special == special else None
        if mapping.held is not None and rest is not None:
            try:
                session = await client.resume_session(mapping.session, mapping.token)
                # (the resume says how many tokens it holds: the transcript is read only where the map says other)
                held = mapping.held.tokens
                beyond = await session.history(held) if session.context_tokens != held else []
            except GONE:
                return None
            tokens, parts = await pieces(client, rest, False, special, mapping.held.trim, media)
            if beyond and tokens and beyond[: len(tokens)] == tokens:
                # It holds this very turn already, and part of an answer: the turn was cut after it went in (a
                # daemon stopped mid-answer, a gateway killed before it could write the answer down). A new session
                # answers it. (Other tokens there are another program's doing: the daemon's CONFLICT says so.)
                self.metrics.reused.labels("edited").inc()
                await self._close_session(session)
                return None
            if tokens or parts:
                self.metrics.reused.labels("continued").inc()
                names = media.part_names(parts) if media is not None and parts else {}
                return Turn(
                    session,
                    tokens,
                    mapping.held.tokens,
                    rendered,
                    special,
                    before=mapping.held,
                    parts=parts,
                    part_names=names,
                )
        self.metrics.reused.labels("edited").inc()
        await self._close(client, mapping)
        return None

    async def _fresh(
        self,
        client: AsyncClient,
        rendered: str,
        task: str,
        special: bool,
        add_bos: bool,
        media: RequestMedia | None = None,
    ) -> Turn:
        tokens, parts = await pieces(client, rendered, add_bos, special, lambda tokens: tokens, media)
        session = await self.open_session(client, task, "")
        self.metrics.reused.labels("new").inc()
        names = media.part_names(parts) if media is not None and parts else {}
        return Turn(session, tokens, 0, rendered, special, parts=parts, part_names=names)

    async def open_session(self, client: AsyncClient, task: str, system_prompt: str | list[int]) -> AsyncSession:
        """A new session; when the daemon holds as many sessions as it may, the least recently used anonymous one
        is given back first."""
        try:
            return await client.open_session(task, system_prompt=system_prompt)
        except QuotaExceeded:
            if not await self._close_oldest_anonymous(client):
                raise
            return await client.open_session(task, system_prompt=system_prompt)

    async def _close_oldest_anonymous(self, client: AsyncClient) -> bool:
        for session_id, mapping in self.anonymous.items():
            if session_id not in self._busy:
                self.anonymous.forget(session_id)
                await self._close(client, mapping)
                return True
        return False

    async def _remember(self, client: AsyncClient, store: ConversationStore, key: str, turn: Turn) -> None:
        """What the session stands for now: as before when the daemon refused the turn before applying anything, or
        cut it (a killed daemon loses the turn in flight: the next request that continues the session finds out
        whether it holds more, _continue); else from its answer (nothing to continue from after a cancelled one)."""
        if (turn.refused and not turn.generated) or turn.final is None:
            held = turn.before
        else:
            try:
                generated = await client.detokenize(turn.generated) if turn.generated else ""
            except KvpoolError:
                turn.final = None
                generated = ""
            held = after_answer(turn.rendered, generated, turn.generated, turn.final)
        if held is None and store is self.anonymous:
            store.forget(key)
            await self._close_session(turn.session)  # an anonymous session nobody can continue is closed
            return
        store.put(key, Mapping(turn.session.id, turn.session.token, held, turn.special))

    async def _close(self, client: AsyncClient, mapping: Mapping) -> None:
        with contextlib.suppress(KvpoolError):
            await self._close_session(await client.resume_session(mapping.session, mapping.token))

    @staticmethod
    async def _close_session(session: AsyncSession) -> None:
        with contextlib.suppress(KvpoolError):
            await session.close()


async def pieces(
    client: AsyncClient,
    text: str,
    add_bos: bool,
    special: bool,
    trim: Callable[[list[int]], list[int]],
    media: RequestMedia | None,
) -> tuple[list[int], list[list[int] | Image | Audio] | None]:
    """What a turn sends of ``text``: its tokens (``trim`` applied to the first), and, when it holds media, its
    parts (each text piece's tokens, each medium) with the text pieces' tokens."""
    if media is None or not holds_media(text):
        return trim(await client.tokenize(text, add_bos=add_bos, special=special)), None
    parts: list[list[int] | Image | Audio] = []
    tokens: list[int] = []
    for i, piece in enumerate(media.parts(text)):
        if not isinstance(piece, str):
            parts.append(piece)
            continue
        ids = await client.tokenize(piece, add_bos=add_bos and i == 0, special=special)
        ids = trim(ids) if i == 0 else ids
        tokens += ids
        parts.append(ids)
    if add_bos and not isinstance(parts[0], list):  # (a rendering that begins with a medium)
        parts.insert(0, await client.tokenize("", add_bos=True, special=special))
    return tokens, parts
