"""Exceptions raised by the client library: one subclass per stable error code, all under KvpoolError."""

from __future__ import annotations

from typing import Any

from kvpool.protocol import ErrorCode, is_cut


class KvpoolError(Exception):
    """Base of every error the client raises; ``code`` is the stable error code, ``message`` the sentence."""

    code: str = ErrorCode.INTERNAL

    def __init__(self, message: str, code: str | None = None, detail: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.detail = detail or {}

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def reworded(self, message: str) -> KvpoolError:
        """The same error (its class, code and detail) with another sentence."""
        return type(self)(message, code=self.code, detail=self.detail)

    @property
    def cut(self) -> bool:
        """True when this error ended a generation that had begun: the session keeps its prompt and the
        ``detail["completion_tokens"]`` tokens generated before the cut (``detail["context_tokens"]`` in all)."""
        return is_cut(self.detail)


class DaemonUnavailable(KvpoolError):
    """No daemon answered (client-side: the daemon is down, or the address is wrong)."""

    code = "UNAVAILABLE"


class NotConnected(DaemonUnavailable):
    """No connection to a daemon could be made within the client's ``reconnect_wait``: the request was not sent
    (so it is never resent: no daemon can run it later)."""


class RequestTimeout(KvpoolError):
    """The daemon stopped answering within the client's timeout (client-side)."""

    code = "TIMEOUT"


def closes_after(exc: BaseException | None) -> bool:
    """Whether a session left (``with``) on ``exc`` is closed: not when the daemon is gone, stopping or silent. A
    close would then wait for it and replace the error the caller must see (a cut, with what the session kept);
    the daemon keeps such a session, as it keeps every one across a restart, until its session_timeout."""
    if isinstance(exc, DaemonUnavailable | RequestTimeout):
        return False
    return not (isinstance(exc, KvpoolError) and exc.code == ErrorCode.SHUTTING_DOWN)


def _subclass(name: str, code: ErrorCode) -> type[KvpoolError]:
    return type(name, (KvpoolError,), {"code": code, "__doc__": f"The daemon answered {code.value}."})


BadRequest = _subclass("BadRequest", ErrorCode.BAD_REQUEST)
UnknownOp = _subclass("UnknownOp", ErrorCode.UNKNOWN_OP)
VersionMismatch = _subclass("VersionMismatch", ErrorCode.VERSION_MISMATCH)
UnknownTask = _subclass("UnknownTask", ErrorCode.UNKNOWN_TASK)
UnknownSession = _subclass("UnknownSession", ErrorCode.UNKNOWN_SESSION)
NotOwner = _subclass("NotOwner", ErrorCode.NOT_OWNER)
SessionBusy = _subclass("SessionBusy", ErrorCode.SESSION_BUSY)
SessionEvicted = _subclass("SessionEvicted", ErrorCode.SESSION_EVICTED)
SessionCorrupt = _subclass("SessionCorrupt", ErrorCode.SESSION_CORRUPT)
Conflict = _subclass("Conflict", ErrorCode.CONFLICT)
PoolFull = _subclass("PoolFull", ErrorCode.POOL_FULL)
QuotaExceeded = _subclass("QuotaExceeded", ErrorCode.QUOTA_EXCEEDED)
ContextOverflow = _subclass("ContextOverflow", ErrorCode.CONTEXT_OVERFLOW)
BudgetUnmeetable = _subclass("BudgetUnmeetable", ErrorCode.BUDGET_UNMEETABLE)
Overloaded = _subclass("Overloaded", ErrorCode.OVERLOADED)
ShuttingDown = _subclass("ShuttingDown", ErrorCode.SHUTTING_DOWN)
WorkerLost = _subclass("WorkerLost", ErrorCode.WORKER_LOST)
RemoteTierUnavailable = _subclass("RemoteTierUnavailable", ErrorCode.REMOTE_UNAVAILABLE)
SpillUnavailable = _subclass("SpillUnavailable", ErrorCode.SPILL_UNAVAILABLE)
ClientUnresponsive = _subclass("ClientUnresponsive", ErrorCode.CLIENT_UNRESPONSIVE)
KvFull = _subclass("KvFull", ErrorCode.KV_FULL)
MediaUnsupported = _subclass("MediaUnsupported", ErrorCode.MEDIA_UNSUPPORTED)
InternalError = _subclass("InternalError", ErrorCode.INTERNAL)

_BY_CODE: dict[str, type[KvpoolError]] = {
    cls.code: cls for cls in KvpoolError.__subclasses__() if isinstance(cls.code, ErrorCode)
}


def error_from_code(code: str, message: str, detail: dict[str, Any] | None = None) -> KvpoolError:
    """The exception for a daemon Error message; an unknown code (a newer daemon) still raises KvpoolError."""
    cls = _BY_CODE.get(code, KvpoolError)
    return cls(message, code=code, detail=detail)
