"""kvpool's errors as OpenAI-style error bodies with an HTTP status: ``{"error": {"message", "type", "code",
"param"}}``. Every daemon error code has its status; the message is the daemon's sentence."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from starlette.responses import JSONResponse

from kvpool.client.errors import DaemonUnavailable, RequestTimeout
from kvpool.protocol import ErrorCode

CANCELLED = "CANCELLED"  # the gateway's own code: a generation cancelled by another request (generations.py)
# daemon error code -> (HTTP status, OpenAI error type)
STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.UNKNOWN_OP: (400, "invalid_request_error"),
    ErrorCode.VERSION_MISMATCH: (502, "server_error"),
    ErrorCode.UNKNOWN_TASK: (400, "invalid_request_error"),
    ErrorCode.UNKNOWN_SESSION: (404, "invalid_request_error"),
    ErrorCode.NOT_OWNER: (403, "permission_error"),
    ErrorCode.SESSION_BUSY: (409, "conflict_error"),
    ErrorCode.CONFLICT: (409, "conflict_error"),
    ErrorCode.SESSION_EVICTED: (409, "conflict_error"),
    ErrorCode.SESSION_CORRUPT: (409, "conflict_error"),
    ErrorCode.POOL_FULL: (429, "insufficient_quota"),
    ErrorCode.QUOTA_EXCEEDED: (429, "insufficient_quota"),
    ErrorCode.CONTEXT_OVERFLOW: (400, "invalid_request_error"),
    ErrorCode.MEDIA_UNSUPPORTED: (400, "invalid_request_error"),
    ErrorCode.BUDGET_UNMEETABLE: (429, "rate_limit_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.SHUTTING_DOWN: (503, "server_error"),
    ErrorCode.WORKER_LOST: (503, "server_error"),
    ErrorCode.REMOTE_UNAVAILABLE: (503, "server_error"),
    ErrorCode.SPILL_UNAVAILABLE: (503, "server_error"),
    # An answer cut short: the gateway's own connection went quiet past the daemon's client_patience, the KV
    # filled up, or someone else cancelled it. Sending it again is the remedy.
    ErrorCode.CLIENT_UNRESPONSIVE: (503, "server_error"),
    ErrorCode.KV_FULL: (503, "server_error"),
    CANCELLED: (409, "conflict_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
    # The client library's own: no daemon connected (or one that went silent), no answer within --timeout.
    DaemonUnavailable.code: (503, "server_error"),
    RequestTimeout.code: (504, "server_error"),
}
# What an HTTP client can do, where the client library's sentence tells its own caller to resume a session (which an
# HTTP client does not hold).
AGAIN_LATER = "send the request again once it is back: a conversation is kept up to its last whole answer."
FOR_HTTP = {
    DaemonUnavailable.code: f"kvpoold did not answer (it stopped, is restarting, or is gone); {AGAIN_LATER}",
    ErrorCode.SHUTTING_DOWN.value: f"kvpoold is stopping; {AGAIN_LATER}",
}
RETRY_AFTER_S = 1  # for 429 and 503: most refusals clear within a turn or a restart
# Where OpenAI names the same error otherwise, its name (clients match on it); else the daemon's code, lower case.
OPENAI_CODES = {ErrorCode.CONTEXT_OVERFLOW: "context_length_exceeded", DaemonUnavailable.code: "daemon_unavailable"}


# A field a sentence names: in backquotes (`field`, `$.field.sub[2]`), or a path with an index (messages[3].name).
_FIELD_IN_SENTENCE = re.compile(r"`(\$\.)?([A-Za-z_][A-Za-z0-9_.\[\]]*)`|\b([a-z_]+\[\d+\](?:\.[A-Za-z_]\w*|\[\d+\])*)")


@contextlib.contextmanager
def named_as(names: Mapping[str, str]) -> Iterator[None]:
    """An HttpError raised inside, for a request translated into the chat route's, named as the client sent it
    (HttpError.renamed)."""
    try:
        yield
    except HttpError as exc:
        raise exc.renamed(names) from None


class Whole(str):
    """A client's name for a chat path and everything under it: nothing of the path past it is kept (a message of
    a stored chain is `previous_response_id`, whatever field of it was wrong)."""


def longest_prefix(path: str, names: Iterable[tuple[str, str]]) -> tuple[str, str] | None:
    """The longest of ``names``' paths that ``path`` begins with (whole, or followed by ``.`` or ``[``), with its
    name; None when it begins with none."""
    for prefix, name in sorted(names, key=lambda item: -len(item[0])):
        if path == prefix or path.startswith((prefix + ".", prefix + "[")):
            return prefix, name
    return None


def rename_path(path: str, names: Iterable[tuple[str, str]]) -> str | None:
    """``path`` with the longest of ``names``' paths it begins with replaced by its name; None when none."""
    found = longest_prefix(path, names)
    if found is None:
        return None
    prefix, name = found
    return name if isinstance(name, Whole) else name + path[len(prefix) :]


def refuse(param: str, message: str, code: str = "unsupported_parameter") -> HttpError:
    """A 400 that names the request field it refuses and says what to do instead."""
    return HttpError(400, message, code, param=param)


class HttpError(Exception):
    """An error to answer with: ``status``, an OpenAI error ``type`` and ``code``, and a sentence."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error", param: str = ""):
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param

    @classmethod
    def from_kvpool(cls, code: str | None, message: str) -> HttpError:
        status, kind = STATUS.get(code or "", (500, "server_error"))
        name = OPENAI_CODES.get(code or "", (code or "internal").lower())
        return cls(status, FOR_HTTP.get(code or "", message), name, kind)

    def renamed(self, names: Mapping[str, str]) -> HttpError:
        """The same error for a request translated into the chat route's (Responses, Messages): each chat field it
        names (``param``; in its sentence a field in backquotes, or a path with an index such as
        ``messages[3].tool_call_id``) named as the client sent it. ``names``: chat field or path -> the client's
        (a ``Whole`` name stands for everything under it too)."""

        def own(path: str) -> str:
            renamed = rename_path(path, names.items())
            return path if renamed is None else renamed

        def field(match: re.Match[str]) -> str:
            if match.group(3) is not None:
                return own(match.group(3))
            return f"`{match.group(1) or ''}{own(match.group(2))}`"

        message = _FIELD_IN_SENTENCE.sub(field, self.message)
        return HttpError(self.status, message, self.code, self.kind, own(self.param) if self.param else "")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param or None}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
