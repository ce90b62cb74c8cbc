"""The gateway's HTTP routes (a Starlette app): OpenAI's /v1/models, /v1/chat/completions and /v1/completions,
a health path and /metrics. Every request is checked (key, size, JSON, fields) before it reaches the daemon."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import jinja2
import msgspec
from prometheus_client.exposition import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool.client.aio import AsyncClient
from kvpool.client.chat_template import ChatTemplate, TemplateError, template_for
from kvpool.client.conversation import REFUSALS
from kvpool.client.errors import DaemonUnavailable, KvpoolError, RequestTimeout
from kvpool.protocol.status import ModelStatus

from .config import GatewayConfig
from .conversations import ConversationStore
from .errors import HttpError
from .metrics import GatewayMetrics
from .schema import (
    ChatCompletionRequest,
    CompletionRequest,
    Unsupported,
    chat_messages,
    stop_list,
)
from .turns import Turn, Turns

log = logging.getLogger("kvpool.gateway")

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "shutdown": "stop"}
DEFAULT_MAX_TOKENS = 256  # a chat request without max_tokens: enough for an answer, bounded for a device


@dataclass
class Model:
    """What the gateway knows of the daemon's model: its id for clients, and its chat template."""

    id: str
    status: ModelStatus
    template: ChatTemplate


class Gateway:
    """The app's state: one asyncio client of kvpoold (connected lazily, so the gateway starts before the daemon
    and outlives its restarts), the conversation map and the metrics."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = GatewayMetrics()
        self.turns = Turns(ConversationStore(config.state_file), self.metrics, reuse=config.reuse)
        self._client: AsyncClient | None = None
        self._model: Model | None = None
        self._connecting = asyncio.Lock()  # concurrent first requests share one connection

    async def client(self) -> AsyncClient:
        async with self._connecting:
            if self._client is None:
                self._client = await AsyncClient.connect(
                    self.config.daemon, timeout=self.config.timeout, name="gateway", curve=self.config.curve()
                )
                status = await self._client.status()
                # Sessions kept for requests without a name: a quarter of what the daemon may hold.
                self.turns.anonymous_max = max(1, status.sessions.max // 4)
        return self._client

    async def model(self) -> Model:
        if self._model is None:
            status = (await (await self.client()).status()).model
            name = status.path.rsplit("/", 1)[-1].removesuffix(".gguf") or "kvpool"
            try:
                source, stops = template_for(self.config.chat_template, status.chat_template)
                template = ChatTemplate(source, status.bos_token, status.eos_token, tuple(stops))
            except (TemplateError, jinja2.TemplateError) as exc:
                raise HttpError(
                    500, f"The chat template cannot be used ({exc}); fix --chat-template.", "template", "server_error"
                ) from None
            self._model = Model(name, status, template)
        return self._model

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


# ---------------------------------------------------------------------- request checks


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it passes ``limit`` bytes (nothing more is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(
            413, f"The request body is {declared} bytes; this gateway accepts at most {limit}.", "too_large"
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HttpError(413, f"The request body is over {limit} bytes, the most this gateway accepts.", "too_large")
    return bytes(body)


T = TypeVar("T")


def decode(body: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise HttpError(400, f"Invalid request: {exc}.", "invalid_request") from None
    except msgspec.DecodeError:
        raise HttpError(400, "The request body is not valid JSON.", "invalid_json") from None


def check_model(requested: str, model: Model) -> None:
    if requested != model.id:
        raise HttpError(
            404, f"The model {requested!r} does not exist here; this gateway serves {model.id!r}.", "model_not_found"
        )


def sampling(
    max_tokens: int | None, temperature: float | None, top_p: float | None, seed: int | None
) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": max_tokens or DEFAULT_MAX_TOKENS}
    if temperature is not None:
        params["temperature"] = temperature
    if top_p is not None:
        params["top_p"] = top_p
    if seed is not None:
        params["seed"] = seed
    return params


def conversation_key(request: Request, body_key: str | None) -> str | None:
    return body_key or request.headers.get("x-session-id") or None


# ---------------------------------------------------------------------- answers


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def generate(turn: Turn, stop: list[str], params: dict[str, Any]) -> AsyncIterator[str]:
    """The answer's text as it comes; the turn records what the session now holds."""
    stream = turn.session.generate(turn.tokens, stop=stop, after=turn.held, **params)
    try:
        async for chunk in stream:
            turn.record(chunk)
            if chunk.text:
                yield chunk.text
        turn.final = stream.final
    except KvpoolError as exc:
        # A refusal (over budget, overloaded, a full queue) comes before anything was applied to the session.
        turn.refused = exc.code in REFUSALS
        raise
    finally:
        with anyio.CancelScope(shield=True):  # a client that went away cancels this body: finish the cleanup
            await stream.aclose()  # a reader that stopped early cancels the generation


def finish_reason(turn: Turn) -> str:
    return FINISH.get(str(turn.final.finish_reason), "stop") if turn.final is not None else "stop"


def completion_tokens(turn: Turn) -> int:
    return turn.final.usage.completion_tokens if turn.final is not None else 0


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n".encode()


# ---------------------------------------------------------------------- routes


def build_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)

    def route(
        name: str,
    ) -> Callable[[Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]]:
        """Authentication, error answers and metrics around one route."""

        def wrap(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
            async def run(request: Request) -> Response:
                started = time.monotonic()
                try:
                    if (name.startswith("/v1") or name == "/status") and config.api_key:
                        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
                        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
                            raise HttpError(
                                401,
                                "Invalid or missing API key: send Authorization: Bearer KEY.",
                                "invalid_api_key",
                                "authentication_error",
                            )
                    response = await handler(request)
                except HttpError as exc:
                    response = exc.response()
                except (DaemonUnavailable, RequestTimeout) as exc:
                    status = 504 if isinstance(exc, RequestTimeout) else 503
                    response = HttpError(status, str(exc), "daemon_unavailable", "server_error").response()
                except KvpoolError as exc:
                    response = HttpError.from_kvpool(exc.code, str(exc)).response()
                gateway.metrics.requests.labels(name, str(response.status_code)).inc()
                if not isinstance(response, StreamingResponse):
                    gateway.metrics.latency.labels(name).observe(time.monotonic() - started)
                return response

            return run

        return wrap

    @route("/v1/models")
    async def models(request: Request) -> Response:
        model = await gateway.model()
        entry = {"id": model.id, "object": "model", "created": 0, "owned_by": "kvpool"}
        return JSONResponse({"object": "list", "data": [entry]})

    @route("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = decode(await read_body(request, config.max_body_bytes), ChatCompletionRequest)
        model = await gateway.model()
        check_model(body.model, model)
        try:
            text = model.template.render(chat_messages(body), add_generation_prompt=True)
        except (Unsupported, TemplateError) as exc:
            raise HttpError(400, str(exc), "unsupported" if isinstance(exc, Unsupported) else "template") from None
        params = sampling(body.max_completion_tokens or body.max_tokens, body.temperature, body.top_p, body.seed)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        own = stop_list(body.stop)
        stops = [*own, *(implied for implied in model.template.stops if implied not in own)]
        return await answer(
            request, model, text, body.prompt_cache_key, body.stream, include_usage, stops, params, chat=True
        )

    @route("/v1/completions")
    async def completions(request: Request) -> Response:
        body = decode(await read_body(request, config.max_body_bytes), CompletionRequest)
        model = await gateway.model()
        check_model(body.model, model)
        if body.n not in (None, 1) or body.echo:
            raise HttpError(400, "`n` > 1 and `echo` are not supported: ask for one plain completion.", "unsupported")
        if isinstance(body.prompt, list):
            if len(body.prompt) != 1:
                raise HttpError(400, "Send one prompt per request (a list of one string at most).", "unsupported")
            prompt = body.prompt[0]
        else:
            prompt = body.prompt
        params = sampling(body.max_tokens, body.temperature, body.top_p, body.seed)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await answer(
            request,
            model,
            prompt,
            body.prompt_cache_key,
            body.stream,
            include_usage,
            stop_list(body.stop),
            params,
            chat=False,
        )

    async def answer(
        request: Request,
        model: Model,
        text: str,
        body_key: str | None,
        stream: bool,
        include_usage: bool,
        stop: list[str],
        params: dict[str, Any],
        chat: bool,
    ) -> Response:
        client = await gateway.client()
        # A chat template writes BOS itself (as text, parsed as the special token); a raw completion gets the
        # model's BOS the way kvpool's own sessions do.
        add_bos = model.template.needs_bos(text) if chat else bool(model.status.bos_token)
        key = conversation_key(request, body_key)
        route_name = "/v1/chat/completions" if chat else "/v1/completions"
        created, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"
        started = time.monotonic()

        def choice(content: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": content or "", "finish_reason": finish, "logprobs": None}
            message = {"content": content} if delta else {"role": "assistant", "content": content}
            return {"index": 0, ("delta" if delta else "message"): message, "finish_reason": finish}

        def turn_usage(turn: Turn) -> dict[str, Any]:
            return usage(turn.held + len(turn.tokens), completion_tokens(turn), turn.held)

        def first_text() -> None:
            gateway.metrics.first_token.labels(route_name).observe(time.monotonic() - started)

        context = gateway.turns.turn(client, key, text, "default", special=chat, add_bos=add_bos)
        if not stream:
            async with context as turn:
                gateway.metrics.prompt_tokens.inc(turn.held + len(turn.tokens))
                gateway.metrics.cached_tokens.inc(turn.held)
                parts = []
                async for piece in generate(turn, stop, params):
                    if not parts:
                        first_text()
                    parts.append(piece)
            return JSONResponse(
                {
                    "id": ident,
                    "object": kind,
                    "created": created,
                    "model": model.id,
                    "choices": [choice("".join(parts), finish_reason(turn), delta=False)],
                    "usage": turn_usage(turn),
                }
            )

        # Streamed: the turn (and its conversation's lock) lives as long as the response body. A client that
        # goes away stops the body; leaving generate() then cancels the generation.
        turn = await context.__aenter__()
        gateway.metrics.prompt_tokens.inc(turn.held + len(turn.tokens))
        gateway.metrics.cached_tokens.inc(turn.held)
        head = {"id": ident, "object": f"{kind}.chunk" if chat else kind, "created": created, "model": model.id}

        async def body() -> AsyncIterator[bytes]:
            try:
                if chat:
                    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield sse(head | {"choices": [opening]})
                first = True
                async for piece in generate(turn, stop, params):
                    if first:
                        first_text()
                        first = False
                    yield sse(head | {"choices": [choice(piece, None, delta=True)]})
                last = finish_reason(turn)
                ending = {"index": 0, "delta": {}, "finish_reason": last} if chat else choice("", last, True)
                yield sse(head | {"choices": [ending]})
                if include_usage:
                    yield sse(head | {"choices": [], "usage": turn_usage(turn)})
                yield sse("[DONE]")
            except KvpoolError as exc:  # the status line went out already: the error travels as an event
                yield sse(HttpError.from_kvpool(exc.code, str(exc)).body())
            finally:
                # The client may close the connection as soon as it has [DONE], and Starlette then cancels
                # this body: the conversation's record must still be brought up to date.
                with anyio.CancelScope(shield=True):
                    await context.__aexit__(None, None, None)
                gateway.metrics.latency.labels(route_name).observe(time.monotonic() - started)

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @route(config.health_path)
    async def health(request: Request) -> Response:
        status = await (await gateway.client()).status()
        ok = status.stepping()
        return JSONResponse(
            {"ok": ok, "engine_idle_s": status.engine_idle_s, "sessions": status.sessions.open},
            status_code=200 if ok else 503,
        )

    page = (Path(__file__).parent / "static" / "index.html").read_text(encoding="utf-8")

    @route("/")
    async def index(request: Request) -> Response:
        """The status page: the daemon's live state and a chat box, all through this gateway's own API."""
        return HTMLResponse(page)

    @route("/status")
    async def status(request: Request) -> Response:
        daemon_status = await (await gateway.client()).status()
        model = await gateway.model()
        conversations = len(gateway.turns.store)
        body = {"model": model.id, "conversations": conversations, "daemon": msgspec.to_builtins(daemon_status)}
        return JSONResponse(body)

    @route("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await gateway.close()

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route(config.health_path, health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/", index, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gateway
    return app
