"""A tool loop's next request, computed while the tool runs: what it begins with, and its prefill.

A client that gets tool calls sends their results next (OpenAI's API requires a tool message for each call right
after the assistant message that made them), so the next rendering goes on from the answer with the template's
end of turn, a user turn and ``{"tool_response": {"name": "<the first call's name>", "content": "`` (the name is
left out when several calls came: their results may come in any order). Once the call's turn is over,
ToolResultPrefill computes that opening into the conversation's session, holding the conversation's lock (handed
over by the turn, so the next request waits for it and the HTTP answer does not), only when a place in the queue
is free (requests go first), and records what the session then stands for (conversations.Followed). The request
that carries the result computes only the rest. A next request that does not go on with it (a history edited, a
result left out) starts a new session, as any conversation that does not continue its session does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from kvpool.client.aio import AsyncClient, AsyncSession
from kvpool.client.chat_template import ChatTemplate, TemplateError
from kvpool.client.conversation import REFUSALS, Held
from kvpool.client.errors import KvpoolError

from .admission import Admission
from .conversations import ConversationStore, Followed, Mapping
from .messages import MARK, tool_result_text
from .metrics import GatewayMetrics

log = logging.getLogger("kvpool.gateway")

# Tool results the opening's tokens are checked against: its tokens must be those the whole rendering has, whatever
# the result (a tokenizer may merge the quote that opens the content with what follows it).
SAMPLE_RESULTS = ("ok", "18 C, light rain", '"quoted"', " spaced", "{", "Done.")
MAX_CUT = 8  # characters the opening may give up at its end for that


@dataclass(frozen=True)
class ToolResultOpening:
    """The rendering of a request's conversation, to find what follows its answer when that answer is a call."""

    template: ChatTemplate
    messages: list[dict[str, str]]  # the request's conversation as the template reads it (messages.py)

    def after(self, held: Held, raw_answer: str, names: list[str]) -> str | None:
        """The text the rendering with the calls' results goes on with after the answer ``held`` stands for, up to
        the first result's content (None: the template does not write it after the answer)."""
        if not names:
            return None
        name = names[0] if len(names) == 1 else MARK
        probe = [
            *self.messages,
            {"role": "assistant", "content": raw_answer},
            {"role": "user", "content": tool_result_text(name, MARK)},
        ]
        try:
            rendered = self.template.render(probe, add_generation_prompt=True)
        except TemplateError:
            return None
        rest = held.rest(rendered)
        if rest is None or MARK not in rest:
            return None
        return rest[: rest.index(MARK)] or None


async def stable_start(client: AsyncClient, text: str, special: bool) -> tuple[str, list[int]] | None:
    """The longest start of ``text`` (it may leave out a few characters at its end) whose tokens are the ones any
    result after it would be tokenized with, and those tokens; None when there is none."""
    tokenized = [await client.tokenize(text + sample, add_bos=False, special=special) for sample in SAMPLE_RESULTS]
    differ = (i for i, column in enumerate(zip(*tokenized, strict=False)) if len(set(column)) > 1)
    common = tokenized[0][: next(differ, min(map(len, tokenized)))]
    for cut in range(len(text), max(0, len(text) - MAX_CUT), -1):
        tokens = await client.tokenize(text[:cut], add_bos=False, special=special)
        if tokens and tokens == common[: len(tokens)]:
            return text[:cut], tokens
    return None


class Turn(Protocol):
    """What a prefill reads of the turn that called the tools (turns.Turn)."""

    session: AsyncSession
    special: bool  # how its text is tokenized
    next_opening: Callable[[Held], str | None] | None  # what the next request begins with after the answer


class ToolResultPrefill:
    """Prefills the opening of a tool's result into a named conversation's session after the turn that called it
    (the turn names it through ``Turn.next_opening``)."""

    def __init__(
        self,
        store: ConversationStore,
        admission: Admission,
        metrics: GatewayMetrics,
        close_session: Callable[[AsyncSession], Awaitable[None]],
    ):
        """``admission``: the queue, whose in-flight places a prefill takes only when one is free."""
        self.store, self.admission, self.metrics = store, admission, metrics
        self._close_session = close_session
        self._running: set[asyncio.Task[None]] = set()  # kept referenced until done

    def start(self, client: AsyncClient, key: str, turn: Turn, release: Callable[[], None]) -> bool:
        """Start prefilling what the next request will begin with; True when it started, and then it holds the
        conversation's lock (``release`` gives it back) until done. False: nothing to prefill, the caller keeps
        the lock."""
        mapping = self.store.get(key)
        if turn.next_opening is None or turn.final is None or mapping is None or not isinstance(mapping.held, Held):
            return False  # (a session already followed by an opening is followed by no other; a cut turn's waits)
        opening = turn.next_opening(mapping.held)
        if not opening or not self.admission.try_hold():  # (busy: requests go first)
            return False

        async def prefill() -> None:
            try:
                await self._prefill(client, key, turn, mapping, opening)
            except Exception:  # a prefill is an optimisation: a failure costs it, never the conversation
                log.exception("could not prefill the next turn of conversation %s", key)
                await self._start_afresh(key, turn)
            finally:
                self.admission.give_back()
                release()

        task = asyncio.get_running_loop().create_task(prefill())
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return True

    async def _prefill(self, client: AsyncClient, key: str, turn: Turn, mapping: Mapping, opening: str) -> None:
        held = mapping.held
        assert isinstance(held, Held)
        try:
            start = await stable_start(client, opening, turn.special)
        except KvpoolError:  # nothing was applied: the conversation goes on without it
            return
        if start is None:
            return
        text, tokens = start
        tokens = held.trim(tokens)
        if not tokens:
            return
        stream = turn.session.generate(tokens, after=held.tokens, max_tokens=0)
        try:
            async for _ in stream:
                pass
        except KvpoolError as exc:
            if exc.cut or exc.code not in REFUSALS:  # it may have applied part of it
                await self._start_afresh(key, turn)
            return
        final = stream.final
        if final is None or final.usage.context_tokens != held.tokens + len(tokens):
            await self._start_afresh(key, turn)
            return
        followed = Followed.after(held, text, final.usage.context_tokens)
        self.store.put(key, Mapping(mapping.session, mapping.token, followed, mapping.special))
        self.metrics.prefilled_tokens.inc(len(tokens))

    async def _start_afresh(self, key: str, turn: Turn) -> None:
        """Its session may hold part of the opening: the next request starts a new one."""
        self.store.forget(key)
        await self._close_session(turn.session)

    async def close(self) -> None:
        """Wait for the prefills still running (a stopping gateway keeps the conversations it was prefilling)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
