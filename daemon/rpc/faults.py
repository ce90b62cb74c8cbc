"""What happens when an RPC worker is lost. ggml-rpc cannot recover a broken connection: on the first request
that fails (ggml-rpc.cpp, RPC_STATUS_ASSERT) it calls ggml_abort(), which ends the process, on whichever thread
was talking to the worker, while the engine thread waits inside llama.cpp for an answer that will never come.
Nothing in llama.cpp's state can be saved at that point: the KV of the remote layers is gone with the worker.

So kvpoold makes that end an orderly one, from ggml's abort callback: it logs which worker was lost and why,
ends every generation in flight with WORKER_LOST (the I/O thread still runs), and exits with EXIT_WORKER_LOST
without touching llama.cpp again. The sessions stay in the shared-memory pool as of their last checkpoint (after
every completed turn by default), so the restarted daemon (systemd's Restart=on-failure) recovers them, once the
worker answers again: until then every start fails fast with the same exit code and a sentence naming it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from kvpool import protocol as p
from kvpool.daemon.llama import ggml_rpc
from kvpool.daemon.rpc.endpoints import parse_endpoint, unreachable

log = logging.getLogger("kvpool.rpc")

EXIT_WORKER_LOST = 75  # EX_TEMPFAIL: an rpc worker is down (at start, or lost while running); try again later
REPLY_FLUSH_S = 0.5  # time the I/O thread gets to send the WORKER_LOST replies before the process ends

# (client, request id, the tokens its session's last checkpoint holds) of every generation in flight
InFlight = Callable[[], list[tuple[bytes, int, int]]]
Send = Callable[[bytes, p.Reply], None]


class WorkerWatch:
    def __init__(self, endpoints: list[str]):
        self.endpoints = endpoints
        self._in_flight: InFlight | None = None
        self._send: Send | None = None
        self._handled = threading.Lock()

    def install(self) -> None:
        """From now on a ggml abort ends the daemon through lost()."""
        ggml_rpc.on_ggml_abort(self.lost)

    def attach(self, in_flight: InFlight, send: Send) -> None:
        """Once the engine runs: whom to tell, and how."""
        self._in_flight, self._send = in_flight, send

    def down(self) -> list[str]:
        """The workers that do not accept a connection now, with the reason. A worker that is being killed
        closes its connection to kvpoold a moment before its listening socket: ask again before concluding that
        it still listens."""
        for attempt in range(3):
            if attempt:
                time.sleep(0.1)
            down = [f"{e} ({why})" for e in self.endpoints if (why := unreachable(parse_endpoint(e), 0.5))]
            if down:
                return down
        return []

    def lost(self, message: str) -> None:
        """ggml's abort callback."""
        if "ggml-rpc" not in message:  # another llama.cpp fault: say what it was and let abort() go on
            log.critical("llama.cpp aborted: %s", message)
            return
        down = self.down()
        said = f"llama.cpp: {message.rsplit(': ', 1)[-1]}"
        if not down and self._in_flight is None:  # at start, from a peer that still listens: not a worker's fault
            log.critical(
                "rpc_servers %s accepted kvpoold's connection at start but did not answer as llama.cpp's RPC server "
                "(%s): is it a `kvpool rpc-worker` of this llama.cpp? Fix rpc_servers; exiting with 2.",
                ", ".join(self.endpoints),
                said,
            )
            self._flush()
            os._exit(2)
        if down:
            what = "rpc worker " + ", ".join(down) + " is gone"
        else:
            what = f"the connection to rpc worker {', '.join(self.endpoints)} broke"
        self._end(what, said)

    def watch_stalls(self, heartbeat: Callable[[], float], stopping: threading.Event, timeout: float) -> None:
        """ggml-rpc has no timeout: a worker whose host hangs, or a link that drops packets without a reset,
        leaves the engine waiting inside llama.cpp for ever. A step longer than ``timeout`` seconds (the engine's
        heartbeat, which it renews at least 4 times a second when idle) ends the daemon like a lost worker."""

        def run() -> None:
            while not stopping.wait(1.0):
                silent = time.monotonic() - heartbeat()
                if silent > timeout:
                    what = f"rpc worker {', '.join(self.endpoints)} stopped answering"
                    self._end(what, f"the engine has waited {silent:.0f} s for it; rpc_timeout is {timeout:g} s")

        threading.Thread(target=run, name="rpc-stall-watch", daemon=True).start()

    def _end(self, what: str, detail: str) -> None:
        if not self._handled.acquire(blocking=False):  # a second thread failing too: the first one handles it
            time.sleep(10 * REPLY_FLUSH_S)
            os._exit(EXIT_WORKER_LOST)
        log.critical(
            "%s (%s). The model cannot run without it: ending the generations in flight with WORKER_LOST and "
            "exiting with %d; sessions stay in the pool and are recovered when kvpoold restarts with its workers "
            "answering.",
            what,
            detail,
            EXIT_WORKER_LOST,
        )
        told = self._tell_clients(what)
        if told:
            time.sleep(REPLY_FLUSH_S)  # bounded: the I/O thread forwards them, then the process ends regardless
        self._flush()
        os._exit(EXIT_WORKER_LOST)

    @staticmethod
    def _flush() -> None:
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()

    def _tell_clients(self, what: str) -> int:
        if self._in_flight is None or self._send is None:
            return 0
        try:
            in_flight = self._in_flight()
            for client, request_id, saved in in_flight:
                message = (
                    f"The {what}; this generation ended without its answer. kvpoold restarts once the worker is "
                    f"back, and recovers the session as it was last saved: {saved} tokens (detail.saved_tokens), "
                    "which may hold none of this turn, or its prompt and part of its answer; resume it, read its "
                    "history, then go on from there."
                )
                detail = {"saved_tokens": saved}
                self._send(client, p.Error(id=request_id, code=p.ErrorCode.WORKER_LOST, message=message, detail=detail))
        except Exception:  # the process ends either way; a failure to tell is logged, not raised into C
            log.exception("could not tell the clients in flight")
            return 0
        return len(in_flight)


def connect_deadline(endpoints: list[str], timeout: float) -> threading.Timer:
    """ggml-rpc waits forever for a worker's handshake, and a worker serves one master at a time: a worker busy
    with another kvpoold accepts the connection and then never answers. This timer ends the start with a
    sentence instead (cancel it once the workers are registered)."""

    def expired() -> None:
        print(
            f"kvpoold: rpc worker {', '.join(endpoints)} accepted the connection but did not answer llama.cpp's "
            f"handshake within {timeout:g} s (rpc_connect_timeout): a worker serves one master at a time, so "
            "another kvpoold (or llama.cpp) is probably using it.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_WORKER_LOST)

    timer = threading.Timer(timeout, expired)
    timer.daemon = True
    return timer
