"""An answer the daemon cut short, continued where it stopped, so that the caller sees a delay and not an error.

A cut (docs/protocol.md) leaves the session holding the prompt and every token streamed before it, and says so in
its detail. When the session outlives the cause — the daemon stopping (a restart), or this gateway unresponsive for
longer than the daemon's client_patience — the gateway resumes the session, waiting up to --resume-wait for a daemon
that restarts, and generates the rest with the request's own parameters: max_tokens less what was generated, a
grammar and the text stream replayed over the answer so far (grammar_from, text_from: a stop string or a character
split by the cut is seen whole), and after= the context the cut reported, so the rest can never apply to anything
else.

It does not continue (the caller gets the cut's error) when the daemon is not back in time, the session holds
something else, or the answer had reached max_tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvpool import protocol as p
from kvpool.client.aio import AsyncClient, AsyncStream
from kvpool.client.errors import DaemonUnavailable, KvpoolError, RequestTimeout, ShuttingDown

RESUMABLE = frozenset({p.ErrorCode.SHUTTING_DOWN, p.ErrorCode.CLIENT_UNRESPONSIVE})
RETRY_PAUSE_S = 0.25  # between attempts to resume on a daemon that is not back yet
NOT_BACK = (DaemonUnavailable, RequestTimeout, ShuttingDown)  # the daemon is down, starting or stopping


def rest_of(params: dict[str, Any], answer_start: int, generated: int) -> dict[str, Any] | None:
    """The parameters that generate the rest of an answer begun at context position ``answer_start`` with
    ``generated`` tokens so far; None when nothing is left to generate."""
    left = params["max_tokens"] - generated
    if left <= 0:
        return None
    rest = {**params, "max_tokens": left, "text_from": answer_start}
    # The rest goes without the prediction: the place the answer had reached in it went with the cut, and the whole
    # of it may no longer fit the answer's room (docs/gateway.md).
    rest.pop("prediction", None)
    if "json_schema" in params or "grammar" in params:
        rest["grammar_from"] = answer_start
    return rest


async def resume_and_generate(
    client: AsyncClient,
    session_id: str,
    token: str,
    kept: int,
    params: dict[str, Any],
    wait: float,
    read: Callable[[AsyncStream], Awaitable[p.Chunk | p.Final]],
) -> tuple[AsyncStream, p.Chunk | p.Final] | None:
    """Resume the session and generate the rest after exactly ``kept`` tokens; the stream and its first item (read
    with ``read``), or None when the daemon did not take it back within ``wait`` seconds, or refused it."""
    deadline = time.monotonic() + wait
    while True:
        try:
            session = await client.resume_session(session_id, token)
            stream = session.generate("", after=kept, **params)
            return stream, await read(stream)
        except NOT_BACK as exc:
            if exc.cut or time.monotonic() + RETRY_PAUSE_S > deadline:
                return None
            await asyncio.sleep(RETRY_PAUSE_S)  # the daemon is restarting: try again shortly
        except KvpoolError:  # the session is gone, holds something else, or the rest is refused
            return None
