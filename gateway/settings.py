"""The gateway's settings, from its flags (and KVPOOL_GATEWAY_* variables)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from kvpool.client.curve import CurveKeyError, CurveKeys, curve_from_files


class GatewayConfigError(Exception):
    """A setting the gateway refuses to start with; the message says why and what to do."""


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    daemon: str | None = None  # kvpoold's address (None: $KVPOOL_ADDRESS, else its default)
    api_key: str = ""
    health_path: str = "/health"
    log_file: str = ""
    state_file: Path | None = None  # the conversation map (None: kept in memory only)
    max_body_bytes: int = 4 << 20
    timeout: float = 300.0  # per answer from the daemon
    # How long an answer the daemon cut short (it restarted, or this gateway was unresponsive past its
    # client_patience) waits for the daemon to take its session back and continue it (continuation.py); 0: never.
    resume_wait: float = 30.0
    reuse: bool = True  # False (--no-reuse): every request on a fresh session, closed when it ends
    # After a tool call, prefill the opening of its result into the conversation's session (next_turn.py).
    prefill_tool_results: bool = True
    chat_template: str = "auto"  # auto (the GGUF's, else a transcript), a shipped name, or a Jinja file
    curve_server_key: str = ""  # a tcp:// daemon's public key file
    curve_client_key: str = ""  # the gateway's secret key file, listed in the daemon's curve_clients_dir
    max_inflight: int = 0  # generations dispatched to the daemon at once (0: what the daemon allows, see app.py)
    queue_size: int = 512  # requests that may wait in the gateway's queue beyond those (429 beyond)
    queue_per_key: int = 0  # of those, how many one client (user, else address) may have (0: no limit)
    aliases: tuple[str, ...] = ()  # more names /v1/models lists for the one model (any name is served)

    def check(self) -> None:
        if not self.health_path.startswith("/") or self.health_path.startswith("/v1/"):
            raise GatewayConfigError(f"--health-check {self.health_path!r}: give a path such as /health, outside /v1/.")
        shipped = ("auto", "chatml", "gemma3", "transcript")
        if self.chat_template not in shipped and not Path(self.chat_template).is_file():
            raise GatewayConfigError(
                f"--chat-template {self.chat_template!r}: give one of {', '.join(shipped)} or a Jinja file that exists."
            )
        try:
            curve = self.curve()
        except CurveKeyError as exc:
            raise GatewayConfigError(f"--curve-server-key/--curve-client-key: {exc.message}") from None
        if self.daemon and self.daemon.startswith("tcp://") and curve is None:
            raise GatewayConfigError(
                f"--daemon {self.daemon}: a tcp:// daemon only lets in CURVE clients; pass --curve-server-key (its "
                "public key file) and --curve-client-key (this gateway's secret key file)."
            )
        for flag, value, least in (
            ("--max-inflight", self.max_inflight, 0),
            ("--queue-size", self.queue_size, 0),
            ("--queue-per-key", self.queue_per_key, 0),
            ("--resume-wait", self.resume_wait, 0),
        ):
            if value < least:
                raise GatewayConfigError(f"{flag} {value}: give a number >= {least}.")
        if not is_loopback(self.host) and not self.api_key:
            raise GatewayConfigError(
                f"--host {self.host} would expose the gateway beyond this machine without a key: pass --api-key "
                "(or set KVPOOL_GATEWAY_API_KEY), or bind to 127.0.0.1."
            )

    def curve(self) -> CurveKeys | None:
        return curve_from_files(self.curve_server_key, self.curve_client_key)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_state_file() -> Path:
    """$STATE_DIRECTORY (systemd), else $XDG_STATE_HOME/kvpool, else ~/.local/state/kvpool; then gateway.json."""
    if state := os.environ.get("STATE_DIRECTORY"):
        return Path(state.split(":")[0]) / "gateway-conversations.json"
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "kvpool" / "gateway-conversations.json"
