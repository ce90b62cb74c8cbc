"""Stateless in, stateful inside: each request's whole conversation becomes one turn on a kvpool session.

- A conversation named by ``prompt_cache_key`` (or ``X-Session-Id``) keeps its session. The gateway remembers
  the text that session stands for: the conversation as the chat template rendered it, plus the text of every
  token generated (a stop string's included: the session holds it). When the next request's rendering begins
  with that text, only the rest is tokenized and sent, with ``after=`` (so a retried request can never apply
  twice); the tokens the session held are ``cached_tokens``. Comparing text, not tokens, keeps the reuse when
  an answer's tokens would tokenize differently when sent back.
- Anything else (the first turn, an edited or cut history, a stop string the next rendering does not continue
  with, a cancelled answer, a session that is gone) gets a new session, so an answer always comes from exactly
  the conversation sent.
- Requests on one conversation take turns (a lock per name), so two at once never interleave in a session.
- A request without a name runs on a session of its own, closed when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvpool import protocol as p
from kvpool.client.aio import AsyncClient, AsyncSession
from kvpool.client.errors import KvpoolError, NotOwner, SessionCorrupt, SessionEvicted, UnknownSession

from .conversations import ConversationStore, Mapping
from .metrics import GatewayMetrics

log = logging.getLogger("kvpool.gateway")
GONE = (UnknownSession, SessionEvicted, SessionCorrupt, NotOwner)  # the mapping names a session that is no more


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


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


class Turns:
    def __init__(self, store: ConversationStore, metrics: GatewayMetrics):
        self.store = store
        self.metrics = metrics
        self._locks: dict[str, asyncio.Lock] = {}

    @contextlib.asynccontextmanager
    async def turn(
        self, client: AsyncClient, key: str | None, rendered: str, task: str, *, special: bool, add_bos: bool
    ) -> AsyncIterator[Turn]:
        """The session this request runs on and the tokens it must send; one turn at a time per conversation.
        On the way out, the conversation's mapping is brought up to date (from the turn's final message)."""
        lock = self._locks.setdefault(key, asyncio.Lock()) if key else contextlib.nullcontext()
        async with lock:
            turn = await self._begin(client, key, rendered, task, special, add_bos)
            try:
                yield turn
            finally:
                if turn.keep and key:
                    await self._remember(client, key, turn)
                else:
                    with contextlib.suppress(KvpoolError):
                        await turn.session.close()

    async def _begin(
        self, client: AsyncClient, key: str | None, rendered: str, task: str, special: bool, add_bos: bool
    ) -> Turn:
        mapping = self.store.get(key) if key else None
        if key and mapping is not None:
            if (
                mapping.text_chars
                and len(rendered) > mapping.text_chars
                and digest(rendered[: mapping.text_chars]) == mapping.text_hash
            ):
                try:
                    session = await client.resume_session(mapping.session, mapping.token)
                except GONE:
                    self.store.forget(key)
                else:
                    tokens = await client.tokenize(rendered[mapping.text_chars :], add_bos=False, special=special)
                    if tokens[:1] == [mapping.eog_token]:
                        tokens = tokens[1:]  # the session holds the end of the answer already
                    if tokens:
                        self.metrics.reused.labels("continued").inc()
                        return Turn(session, tokens, mapping.held, rendered, keep=True)
            self.metrics.reused.labels("edited").inc()
            await self._close(client, mapping)
        tokens = await client.tokenize(rendered, add_bos=add_bos, special=special)
        session = await client.open_session(task, system_prompt="")
        self.metrics.reused.labels("new").inc()
        return Turn(session, tokens, 0, rendered, keep=bool(key))

    async def _remember(self, client: AsyncClient, key: str, turn: Turn) -> None:
        """What the session stands for now: the rendering plus the text of what was generated. A cancelled or
        failed answer leaves nothing to continue from."""
        final = turn.final
        if final is None or final.finish_reason not in (p.FinishReason.LENGTH, p.FinishReason.STOP):
            self.store.put(key, Mapping(turn.session.id, turn.session.token))  # known session, no continuation
            return
        try:
            generated = await client.detokenize(turn.generated) if turn.generated else ""
        except KvpoolError:
            self.store.put(key, Mapping(turn.session.id, turn.session.token))
            return
        text = turn.rendered + generated
        self.store.put(
            key,
            Mapping(
                turn.session.id,
                turn.session.token,
                held=final.usage.context_tokens,
                text_chars=len(text),
                text_hash=digest(text),
                eog_token=turn.generated[-1] if final.eog and turn.generated else -1,
            ),
        )

    async def _close(self, client: AsyncClient, mapping: Mapping) -> None:
        with contextlib.suppress(KvpoolError):
            session = await client.resume_session(mapping.session, mapping.token)
            await session.close()
