"""The one exception the engine raises to refuse a request: a stable code and a sentence a person can act on."""

from __future__ import annotations

from typing import Any

from kvpool.protocol import ErrorCode


class RequestRefused(Exception):
    def __init__(self, code: ErrorCode, message: str, detail: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail
