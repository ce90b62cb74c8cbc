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
  gets its earlier turns back; else it starts one. The least recently used beyond ANONYMOUS_MAX are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvpool import protocol as p
from kvpool.client.aio import AsyncClient, AsyncSession
from kvpool.client.conversation import after_answer
from kvpool.client.errors import KvpoolError, NotOwner, SessionCorrupt, SessionEvicted, UnknownSession

from .conversations import ConversationStore, Mapping
from .metrics import GatewayMetrics

log = logging.getLogger("kvpool.gateway")
GONE = (UnknownSession, SessionEvicted, SessionCorrupt, NotOwner)  # the mapping names a session that is no more


@dataclass
class Turn:
    session: AsyncSession
    tokens: list[int]  # what this turn sends
    held: int  # tokens the session held before (sent as after=): the prompt tokens not computed
    rendered: str  # the conversation as rendered, up to the answer
    keep: bool  # the session outlives the request (a named conversation)
    generated: list[int] = field(default_factory=list)
    final: p.Final | None = None

    def record(self, chunk: p.Chunk) -> None:
        self.generated.extend(chunk.tokens)


ANONYMOUS_MAX = 256  # sessions kept for requests without a name; the least recently used is closed beyond


class Turns:
    def __init__(self, store: ConversationStore, metrics: GatewayMetrics, reuse: bool = True):
        """``reuse`` False: every request runs on a fresh session, closed when it ends (to measure against, or
        where conversations must not be kept)."""
        self.store = store
        self.metrics = metrics
        self.reuse = reuse
        self.anonymous = ConversationStore(None)  # session id -> what it holds, for requests without a name
        self._busy: set[str] = set()  # anonymous sessions in a turn now
        self._locks: dict[str, asyncio.Lock] = {}

    @contextlib.asynccontextmanager
    async def turn(
        self, client: AsyncClient, key: str | None, rendered: str, task: str, *, special: bool, add_bos: bool
    ) -> AsyncIterator[Turn]:
        """The session this request runs on and the tokens it must send; one turn at a time per conversation.
        On the way out, what the session stands for is brought up to date (from the turn's final message)."""
        if not self.reuse:
            turn = await self._fresh(client, rendered, task, special, add_bos, keep=False)
            try:
                yield turn
            finally:
                await self._close_session(turn.session)
            return
        if key is None:
            async with self._anonymous_turn(client, rendered, task, special, add_bos) as turn:
                yield turn
            return
        async with self._locks.setdefault(key, asyncio.Lock()):
            turn = await self._begin(client, self.store, key, rendered, task, special, add_bos)
            try:
                yield turn
            finally:
                await self._remember(client, self.store, key, turn)

    @contextlib.asynccontextmanager
    async def _anonymous_turn(
        self, client: AsyncClient, rendered: str, task: str, special: bool, add_bos: bool
    ) -> AsyncIterator[Turn]:
        """A request without a name continues the idle anonymous session whose text is the longest prefix of its
        rendering (a client resending its history), else starts one; the session is then known by its id."""
        candidates = [
            (m.held.text_chars, session_id)
            for session_id, m in self.anonymous.items()
            if session_id not in self._busy and m.held is not None and m.held.rest(rendered) is not None
        ]
        matched = max(candidates)[1] if candidates else None
        if matched is not None:
            self._busy.add(matched)
            turn = await self._begin(client, self.anonymous, matched, rendered, task, special, add_bos)
            self.anonymous.forget(matched)
            self._busy.discard(matched)
        else:
            turn = await self._fresh(client, rendered, task, special, add_bos, keep=True)
        self._busy.add(turn.session.id)
        try:
            yield turn
        finally:
            self._busy.discard(turn.session.id)
            await self._remember(client, self.anonymous, turn.session.id, turn)
            while len(self.anonymous) > ANONYMOUS_MAX:
                oldest = next(iter(self.anonymous.items()))
                self.anonymous.forget(oldest[0])
                await self._close(client, oldest[1])

    async def _begin(
        self,
        client: AsyncClient,
        store: ConversationStore,
        key: str,
        rendered: str,
        task: str,
        special: bool,
        add_bos: bool,
    ) -> Turn:
        mapping = store.get(key)
        if mapping is not None:
            rest = mapping.held.rest(rendered) if mapping.held is not None else None
            if mapping.held is not None and rest is not None:
                try:
                    session = await client.resume_session(mapping.session, mapping.token)
                except GONE:
                    store.forget(key)
                else:
                    tokens = mapping.held.trim(await client.tokenize(rest, add_bos=False, special=special))
                    if tokens:
                        self.metrics.reused.labels("continued").inc()
                        return Turn(session, tokens, mapping.held.tokens, rendered, keep=True)
            self.metrics.reused.labels("edited").inc()
            await self._close(client, mapping)
        return await self._fresh(client, rendered, task, special, add_bos, keep=True)

    async def _fresh(
        self, client: AsyncClient, rendered: str, task: str, special: bool, add_bos: bool, keep: bool
    ) -> Turn:
        tokens = await client.tokenize(rendered, add_bos=add_bos, special=special)
        session = await client.open_session(task, system_prompt="")
        self.metrics.reused.labels("new").inc()
        return Turn(session, tokens, 0, rendered, keep=keep)

    async def _remember(self, client: AsyncClient, store: ConversationStore, key: str, turn: Turn) -> None:
        """What the session stands for now (nothing to continue from after a cancelled or failed answer)."""
        try:
            generated = await client.detokenize(turn.generated) if turn.generated else ""
        except KvpoolError:
            turn.final = None
            generated = ""
        held = after_answer(turn.rendered, generated, turn.generated, turn.final)
        store.put(key, Mapping(turn.session.id, turn.session.token, held))

    async def _close(self, client: AsyncClient, mapping: Mapping) -> None:
        with contextlib.suppress(KvpoolError):
            await self._close_session(await client.resume_session(mapping.session, mapping.token))

    @staticmethod
    async def _close_session(session: AsyncSession) -> None:
        with contextlib.suppress(KvpoolError):
            await session.close()
