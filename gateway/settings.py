"""The gateway's settings, from its flags (and KVPOOL_GATEWAY_* variables): each field with a ``Flag`` has one
(kvpool.client.flags derives it)."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from kvpool.client.curve import CurveKeyError, CurveKeys, curve_from_files
from kvpool.client.flags import Flag


def path_or_default(text: str) -> Path | None:
    """A file flag's value: empty (a unit's unset variable) means its default, as leaving it out does."""
    return Path(text) if text else None


class GatewayConfigError(Exception):
    """A setting the gateway refuses to start with; the message says why and what to do."""


@dataclass(frozen=True)
class GatewayConfig:
    host: Annotated[str, Flag("address to listen on", env="KVPOOL_GATEWAY_HOST")] = "127.0.0.1"
    port: Annotated[int, Flag("port to listen on", env="KVPOOL_GATEWAY_PORT")] = 8080
    daemon: Annotated[str | None, Flag("kvpoold's address (default: $KVPOOL_ADDRESS, else its default)")] = None
    api_key: Annotated[str, Flag("required as Authorization: Bearer", env="KVPOOL_GATEWAY_API_KEY")] = ""
    health_path: Annotated[str, Flag("path of the health check", name="--health-check")] = "/health"
    log_file: Annotated[str, Flag("also log to this file")] = ""
    # The conversation map (None: kept in memory only; the command line's default is default_state_file()).
    state_file: Annotated[Path | None, Flag("where conversations are mapped to sessions", parse=path_or_default)] = None
    max_body_bytes: Annotated[int, Flag("the largest request body")] = 4 << 20
    # A body that has not arrived whole in this long is answered 408: a client sending slowly (or never finishing)
    # must not hold a connection and its bytes for ever.
    body_timeout: Annotated[float, Flag("seconds a request body may take to arrive whole (408 past it)")] = 30.0
    # Images and audio a message names by path or URL (a data: URL is always read, docs/gateway.md): local files
    # only under this folder, http(s) URLs only when fetching them is on. Neither by default.
    media_dir: Annotated[
        Path | None, Flag("a folder whose image and audio files messages may name by path", parse=path_or_default)
    ] = None
    fetch_media_urls: Annotated[bool, Flag("fetch the http(s) image and audio URLs messages name (off: refused)")] = (
        False
    )
    # Stored responses (the Responses API), beside the conversation map: bounded in count and bytes, expiring.
    responses_max: Annotated[int, Flag("stored responses kept at most (the oldest go first)")] = 10_000
    responses_max_bytes: Annotated[int, Flag("bytes of stored responses kept at most")] = 64 << 20
    responses_ttl: Annotated[float, Flag("seconds a stored response is kept (30 days, as OpenAI's)")] = 30 * 86400.0
    timeout: Annotated[float, Flag("seconds to wait for each answer from kvpoold")] = 300.0
    # How long an answer the daemon cut short (it restarted, or this gateway was unresponsive past its
    # client_patience) waits for the daemon to take its session back and continue it (continuation.py); 0: never.
    resume_wait: Annotated[
        float,
        Flag("seconds an answer cut short (a daemon restart) waits to be continued; 0: the caller gets the error"),
    ] = 30.0
    # False: every request on a fresh session, closed when it ends.
    reuse: Annotated[bool, Flag("keep a conversation's session between its turns (--no-reuse: nothing kept)")] = True
    prefill_tool_results: Annotated[
        bool,
        Flag(
            "compute the opening of a tool call's result while the tool runs (docs/gateway.md)",
            name="--tool-result-prefill",
        ),
    ] = True
    chat_template: Annotated[
        str,
        Flag(
            "auto (the GGUF's own; a transcript for a GGUF without one), gemma3, chatml, transcript, or a .jinja file"
        ),
    ] = "auto"
    curve_server_key: Annotated[
        str,
        Flag(
            "a tcp:// daemon's public key file (with --curve-client-key)", env="KVPOOL_CURVE_SERVER_KEY", metavar="FILE"
        ),
    ] = ""
    curve_client_key: Annotated[
        str,
        Flag(
            "this gateway's secret key file, listed in the daemon's curve_clients_dir",
            env="KVPOOL_CURVE_CLIENT_KEY",
            metavar="FILE",
        ),
    ] = ""
    max_inflight: Annotated[
        int,
        Flag(
            "generations dispatched to kvpoold at once (default: what it allows this gateway, at most half its "
            "max_sessions); more requests wait in the gateway's queue"
        ),
    ] = 0
    queue_size: Annotated[int, Flag("requests that may wait (429 with Retry-After beyond)")] = 512
    queue_per_key: Annotated[
        int, Flag("requests one client (its `user`, else its address) may have waiting (0: no limit)")
    ] = 0
    # Web pages of these origins may call the gateway from a browser (CORS): "*" for any, or a list; none by default.
    cors_origins: Annotated[
        tuple[str, ...],
        Flag("origins whose web pages may call the gateway, comma-separated, or * for any (default: none)"),
    ] = ()
    aliases: Annotated[
        tuple[str, ...],
        Flag("another name /v1/models lists for the model (repeatable)", name="--alias", metavar="NAME", repeat=True),
    ] = ()

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
        for origin in self.cors_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise GatewayConfigError(
                    f"--cors-origins {origin!r}: give an origin such as https://app.example or http://127.0.0.1:3000 "
                    "(scheme, host and port, no path), or * for any."
                )
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
