"""The optional localhost HTTP listener (`--http 127.0.0.1:PORT`): `/health` and `/metrics` (Prometheus).

It asks the daemon over its own ZeroMQ socket, like any client: a hung engine cannot answer, so /health
then fails, which is what a health check is for.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import psutil

from kvpool.client import Client, KvpoolError
from kvpool.daemon.ops.prometheus import render

log = logging.getLogger("kvpool.http")

HEALTH_TIMEOUT_S = 5.0


def process_memory() -> dict[str, int]:
    info = psutil.Process(os.getpid()).memory_full_info()
    return {"rss": info.rss, "pss": getattr(info, "pss", info.rss), "uss": info.uss}


def health(address: str) -> tuple[bool, dict[str, object]]:
    """Whether the daemon answers and its engine is stepping, with the figures that decided it."""
    try:
        with Client(address, timeout=HEALTH_TIMEOUT_S, connect_timeout=HEALTH_TIMEOUT_S, name="health") as client:
            status = client.status()
    except KvpoolError as exc:
        return False, {"ok": False, "error": str(exc)}
    ok = status.stepping()
    return ok, {
        "ok": ok,
        "engine_idle_s": status.engine_idle_s,
        "sessions": msgspec.to_builtins(status.sessions),
        "pid": status.pid,
    }


class HttpListener:
    def __init__(self, bind: str, daemon_address: str):
        host, _, port = bind.rpartition(":")
        if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
            raise ValueError(f"--http {bind}: kvpoold serves HTTP on the loopback only (127.0.0.1:PORT)")
        address = daemon_address

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    ok, body = health(address)
                    self._reply(200 if ok else 503, "application/json", json.dumps(body))
                elif self.path == "/metrics":
                    try:
                        with Client(address, timeout=HEALTH_TIMEOUT_S, name="metrics") as client:
                            text = render(client.status(), process_memory())
                    except KvpoolError as exc:
                        self._reply(503, "text/plain", f"kvpoold did not answer: {exc}\n")
                        return
                    self._reply(200, "text/plain; version=0.0.4; charset=utf-8", text)
                else:
                    self._reply(404, "text/plain", "kvpoold serves /health and /metrics\n")

            def _reply(self, code: int, kind: str, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http: %s", format % args)

        self.server = ThreadingHTTPServer((host.strip("[]"), int(port)), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
