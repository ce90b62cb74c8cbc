"""llama.cpp for the whole process: its log routed into the daemon's, the backend initialised once, what it was
built with, the RPC workers registered with ggml, and what llama.cpp says while a call runs (a grammar's parser
prints its reason to stderr)."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp as lc

from kvpool.daemon.llama import ggml_rpc
from kvpool.daemon.llama.ggml_rpc import RemoteDevice

log = logging.getLogger("kvpool.llama")

# ggml.h: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5. llama.cpp is chatty at load time, so everything
# but its errors goes to debug; its errors (a failed load, say) are worth a warning in the daemon's log.
_GGML_LOG_LEVEL_ERROR = 4


@lc.llama_log_callback
def _route_llama_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp prints progress dots and continuation pieces too; only whole lines are worth a record.
    message = text.decode("utf-8", errors="replace").rstrip("\n") if text else ""
    if _capture is not None:
        _capture.append(message)
    if message.strip(" ."):
        log.log(logging.WARNING if level == _GGML_LOG_LEVEL_ERROR else logging.DEBUG, "%s", message)


_backend_ready = False


def init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        lc.llama_log_set(_route_llama_log, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _backend_ready = True


_media_log_routed = False


def route_media_log() -> None:
    """libmtmd (the projector) logs through its own callback, everything down to debug by default: route it
    into the daemon's log as llama.cpp's is."""
    global _media_log_routed
    if not _media_log_routed:
        import llama_cpp.mtmd_cpp as mtmd  # (loads libmtmd: only a daemon with a projector needs it)

        mtmd.mtmd_helper_log_set(_route_llama_log, ctypes.c_void_p(0))
        _media_log_routed = True


def system_info() -> str:
    """llama.cpp's compiled-in features per backend, e.g. "CPU : SSE3 = 1 | AVX2 = 1 | ... | REPACK = 1 | "."""
    init_backend()
    return lc.llama_print_system_info().decode("utf-8", errors="replace")


def supports_rpc() -> bool:
    """Whether this llama-cpp-python build has the RPC backend (GGML_RPC=ON)."""
    init_backend()
    return bool(lc.llama_supports_rpc()) and ggml_rpc.has_rpc_backend()


def register_workers(endpoints: list[str]) -> list[RemoteDevice]:
    """Connect to each RPC worker and register its devices with ggml (llama-cpp-python 0.3.36 no longer takes
    ``rpc_servers``). A worker that is down makes ggml abort: check each one answers first."""
    init_backend()
    devices: list[RemoteDevice] = []
    for endpoint in endpoints:
        devices += ggml_rpc.add_server(endpoint)
    return devices


_capture: list[str] | None = None  # llama.cpp's log lines, while llama_messages() listens


@contextmanager
def llama_messages() -> Iterator[list[str]]:
    """What llama.cpp says while the block runs: its log lines, and what it prints to stderr (the grammar parser
    prints its reason there). fd 2 is redirected only for that call."""
    global _capture
    messages: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as printed:
        os.dup2(printed.fileno(), 2)
        _capture = messages
        try:
            yield messages
        finally:
            _capture = None
            os.dup2(saved, 2)
            os.close(saved)
            printed.seek(0)
            messages.insert(0, printed.read(1 << 16).decode("utf-8", errors="replace"))
