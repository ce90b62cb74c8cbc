"""What every route goes through: the API key, the body's size and JSON, error answers in OpenAI's form (any
failure is an HTTP status with an error body, never a traceback), metrics, and cancellation when the client goes
away before its answer."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvpool.client.errors import KvpoolError

from .http_errors import HttpError
from .metrics import GatewayMetrics
from .settings import GatewayConfig

log = logging.getLogger("kvpool.gateway")
Handler = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never received


class ClientGone(Exception):
    """The client closed its connection before its answer: what it asked for was cancelled."""


def route(
    name: str,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    errors: Callable[[HttpError], Response] = HttpError.response,
) -> Callable[[Handler], Handler]:
    """Authentication, error answers (``errors`` shapes them: OpenAI's by default) and metrics around one route."""

    def wrap(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            started = time.monotonic()
            try:
                if (name.startswith("/v1") or name == "/status") and config.api_key:
                    authorize(request, config.api_key)
                response = await handler(request)
            except HttpError as exc:
                response = errors(exc)
            except KvpoolError as exc:  # DaemonUnavailable (503) and RequestTimeout (504) too
                response = errors(HttpError.from_kvpool(exc.code, exc.message))
            except ClientGone:
                response = Response(status_code=CLIENT_GONE)
            except Exception:  # a bug costs one request, answered as such
                log.exception("internal error on %s", name)
                response = errors(
                    HttpError(500, "The gateway hit an internal error; it is logged.", "internal", "server_error")
                )
            metrics.requests.labels(name, str(response.status_code)).inc()
            if not isinstance(response, StreamingResponse):
                metrics.latency.labels(name).observe(time.monotonic() - started)
            return response

        return run

    return wrap


def authorize(request: Request, api_key: str) -> None:
    """The key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's (x-api-key)."""
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    given = given or request.headers.get("x-api-key", "").strip()
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise HttpError(
            401,
            "Invalid or missing API key: send Authorization: Bearer KEY (or x-api-key: KEY).",
            "invalid_api_key",
            "authentication_error",
        )


async def read_body(request: Request, limit: int, seconds: float) -> bytes:
    """The body, or 413 as soon as it passes ``limit`` bytes (nothing more is read), or 408 when it has not arrived
    whole within ``seconds``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(
            413, f"The request body is {declared} bytes; this gateway accepts at most {limit}.", "too_large"
        )
    body = bytearray()
    try:
        with anyio.fail_after(seconds):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise HttpError(
                        413, f"The request body is over {limit} bytes, the most this gateway accepts.", "too_large"
                    )
    except TimeoutError:
        raise HttpError(
            408,
            f"The request body did not arrive whole within {seconds:g} s (--body-timeout); send it at once.",
            "timeout",
        ) from None
    return bytes(body)


FIELD_AT = re.compile(r" - at `\$\.?([^`]*)`$")  # where msgspec says a field is wrong
_FIELD = re.compile(r"(?:unknown|missing required) field `([^`]*)`")


def decode(body: bytes, kind: type[T]) -> T:
    """The request body as ``kind``; a 400 naming the field that is wrong, unknown or missing."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        at = FIELD_AT.search(message)
        path = at.group(1) if at else ""
        named = _FIELD.search(message)
        if named:
            path = f"{path}.{named.group(1)}" if path else named.group(1)
        if "unknown field" in message:
            message = (
                f"Unknown field `{path}`: this gateway honours or refuses by name every field of the API's "
                "request, and this one is not among them"
            )
        raise HttpError(400, f"Invalid request: {message}.", "invalid_request", param=path) from None
    except msgspec.DecodeError:
        raise HttpError(400, "The request body is not valid JSON.", "invalid_json") from None
    except RecursionError:
        raise HttpError(400, "The request body nests too deeply.", "invalid_json") from None


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` (waiting in the queue, generating a whole answer); when the client disconnects first, cancel it
    (the daemon's generation with it) and raise ClientGone. The body was read already, so the next ASGI message is
    the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # it failed as it was cancelled: the client is gone anyway
                log.debug("work failed while cancelled: %s", exc)
            if watcher.done():
                raise ClientGone()
        watcher.cancel()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such path, a method the path does not take) in OpenAI's form."""
    assert isinstance(exc, HTTPException)
    message = {404: f"No such path: {request.url.path}.", 405: f"{request.method} is not allowed on this path."}
    error = HttpError(exc.status_code, message.get(exc.status_code, str(exc.detail)), "invalid_request")
    return error.response()
