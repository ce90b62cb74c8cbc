"""One request's way from its Job (what it asks the daemon for, its fields honoured, routes.py) to its answer: a
place in the queue (admission.py), the generations behind its choices (generations.py), then OpenAI's body (or
another API's), or its stream once every choice has its first token."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvpool import protocol as p
from kvpool.client.errors import KvpoolError

from .generations import ConversationGenerations, Generations, SharedPrefixGenerations
from .http_errors import HttpError, longest_prefix
from .media_parts import RequestMedia
from .middleware import unless_disconnected
from .shaping import ChoiceFormat, ChoiceState, usage
from .streaming import Stream, chat_events, completion_events
from .tool_result_prefill import ToolResultOpening

if TYPE_CHECKING:
    from .state import Gateway


@dataclass
class Job:
    """What a request asks the daemon for, once its fields were honoured or refused (routes.py)."""

    route: str
    prompt: str | list[int]  # chat: the rendered conversation (special tokens parsed); completions: text or ids
    special: bool
    add_bos: bool
    params: dict[str, Any]  # the daemon's generate parameters
    choice_format: ChoiceFormat
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    conversation: str | None = None  # prompt_cache_key / X-Session-Id
    fairness: str = ""  # the queue's key
    service_tier: str | None = None
    # Where the schemas a request wrote stand in the json_schema sent (daemon path, request field): a refusal of a
    # schema then names the field the client wrote.
    schema_fields: list[tuple[str, str]] = field(default_factory=list)
    # A request offering tools: what the request with the results of its calls will begin with (tool_result_prefill.py).
    tool_results: ToolResultOpening | None = None
    # Another API's answer shape (anthropic_messages.py); None: OpenAI's.
    answer: OtherAnswer | None = None
    # The images and audio the prompt's markers name (media_parts.py); None: the prompt is text.
    media: RequestMedia | None = None


class OtherAnswer(Protocol):
    def whole(self, states: list[ChoiceState], prompt_tokens: int, cached: int) -> dict[str, Any]: ...

    def events(self, stream: Stream, prompt_tokens: int, cached: int) -> AsyncIterator[bytes]: ...


async def respond(request: Request, gateway: Gateway, model_id: str, job: Job) -> Response:
    """The answer to ``job``: admitted, generated and shaped; streamed or whole."""
    conversing = job.n == 1 and isinstance(job.prompt, str)
    if job.media is not None and job.n != 1:
        raise HttpError(
            400, "`n` > 1 is not served with images or audio; ask for one choice.", "invalid_value", param="n"
        )
    if job.conversation is not None and not conversing:
        # A conversation continues from one answer to a text: n choices are not kept (the client picks one, which
        # the gateway cannot know), and token ids cannot be matched against what a session holds.
        raise HttpError(
            400,
            "`prompt_cache_key` (or X-Session-Id) names a conversation, which continues from one "
            "answer to a text prompt: send n = 1 and text to continue it.",
            "invalid_value",
            param="prompt_cache_key",
        )
    client = await gateway.client()
    chat = job.choice_format.chat
    started = time.monotonic()
    if conversing:
        generations: Generations = ConversationGenerations(
            gateway.turns,
            client,
            job.conversation,
            str(job.prompt),
            job.special,
            job.add_bos,
            job.params,
            resume_wait=gateway.config.resume_wait,
            on_continued=lambda code: gateway.metrics.continued.labels(code).inc(),
            media=job.media,
        )
    else:  # n choices sharing the prompt's KV, or a prompt of token ids: fresh sessions, closed after
        generations = SharedPrefixGenerations(
            gateway.turns,
            client,
            job.prompt,
            job.special,
            job.add_bos,
            job.params,
            job.n,
        )
    states = [ChoiceState(index, job.choice_format) for index in range(job.n)]
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": ("chat.completion" if chat else "text_completion") + (".chunk" if job.stream and chat else ""),
        "created": int(time.time()),
        "model": model_id,
    }
    if job.service_tier is not None:
        head["service_tier"] = "default"
    metrics = gateway.metrics

    def answer_usage() -> dict[str, Any]:
        finals = [s.final.usage for s in states if s.final is not None]
        generated = sum(u.completion_tokens for u in finals)
        prediction = None
        if "prediction" in job.params:
            prediction = (
                sum(u.accepted_prediction_tokens for u in finals),
                sum(u.rejected_prediction_tokens for u in finals),
            )
        return usage(generations.prompt_tokens, generated, generations.cached_tokens, prediction)

    def first_text() -> None:
        metrics.first_token.labels(job.route).observe(time.monotonic() - started)

    def cut(exc: KvpoolError) -> None:
        metrics.streams_cut.labels(job.route, exc.code).inc()

    def expect_results() -> None:
        """An answer that called tools: its conversation's next request carries their results."""
        state = states[0]
        if job.tool_results is None or state.finish_reason() != "tool_calls":
            return
        opening, raw, names = job.tool_results, state.raw, [name for name, _ in state.calls()]
        generations.follow_with(lambda held: opening.after(held, raw, names))

    held = contextlib.AsyncExitStack()

    async def begin() -> None:
        """Wait for a place in the queue, then send, and wait for every choice's first token."""
        await held.enter_async_context(gateway.admission.slot(job.fairness, job.n))
        held.push_async_callback(generations.close)
        try:
            await generations.start()
        except KvpoolError as exc:
            raise refusal(exc, job) from None
        metrics.prompt_tokens.inc(generations.prompt_tokens)
        metrics.cached_tokens.inc(generations.cached_tokens)

    async def whole() -> Response:
        async with held:
            await begin()
            first = True
            try:
                async for index, item in generations.events():
                    if isinstance(item, p.Final):
                        states[index].final = item
                    else:
                        if first:
                            first_text()
                            first = False
                        states[index].add(item)
            except KvpoolError as exc:
                raise refusal(exc, job) from None
            expect_results()
        for state in states:
            state.remember(gateway.memory)
        if job.answer is not None:
            return JSONResponse(job.answer.whole(states, generations.prompt_tokens, generations.cached_tokens))
        choices = [s.chat_choice() if chat else s.completion_choice() for s in states]
        return JSONResponse(head | {"choices": choices, "usage": answer_usage()})

    if not job.stream:
        return await unless_disconnected(request, whole())

    try:
        await unless_disconnected(request, begin())
    except BaseException:
        with anyio.CancelScope(shield=True):
            await held.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            usage = answer_usage if job.include_usage else None
            stream = Stream(generations, states, head, usage, first_text, cut)
            if job.answer is not None:
                events = job.answer.events(stream, generations.prompt_tokens, generations.cached_tokens)
            else:
                events = (chat_events if chat else completion_events)(stream)
            async for event in events:
                yield event
            for state in states:
                state.remember(gateway.memory)
            expect_results()
        finally:
            # The client may close the connection as soon as it has [DONE], and Starlette then cancels this body:
            # the conversation's record must still be brought up to date, and the place in the queue given back.
            with anyio.CancelScope(shield=True):
                await held.aclose()
            metrics.latency.labels(job.route).observe(time.monotonic() - started)

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


_PATH = re.compile(r"^(\$[^:\s]*)")


def refusal(exc: KvpoolError, job: Job) -> HttpError:
    """The daemon's refusal as an HTTP error; a refused schema, or a prediction longer than the answer can be, names
    the request field it came from."""
    error = HttpError.from_kvpool(exc.code, exc.message)
    if exc.code == p.ErrorCode.CONTEXT_OVERFLOW and "prediction_tokens" in exc.detail:
        error.param = "prediction"
    if exc.code == "BAD_REQUEST" and job.schema_fields:
        at = _PATH.match(exc.message)
        daemon_path = at.group(1) if at else ""
        found = longest_prefix(daemon_path, job.schema_fields)
        if found is not None:
            prefix, field_name = found
            error.param = field_name
            error.message = field_name + daemon_path[len(prefix) :] + exc.message[len(daemon_path) :]
        elif "schema" in exc.message.lower() or "grammar" in exc.message.lower():
            error.param = job.schema_fields[0][1].split(".")[0].split("[")[0]  # tools, or response_format
    return error
