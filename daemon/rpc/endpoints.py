"""RPC worker endpoints ("HOST:PORT"): parsing, whether one is on a private link, and whether it answers.

ggml-rpc has no authentication and no encryption: anyone who reaches a worker's port can read and write its
memory. kvpoold warns at start about a worker outside loopback and the private ranges (RFC 1918, RFC 4193
unique-local IPv6, RFC 6598 shared space, link-local), where such a link would usually be a WireGuard tunnel.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

# HOST:PORT with a port of 1-65535; config.py validates rpc_servers with it, so a start never meets a bad one.
ENDPOINT_PATTERN = (
    r"^(?P<host>[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):"
    r"(?P<port>6553[0-5]|655[0-2]\d|65[0-4]\d{2}|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3})$"
)
ENDPOINT = re.compile(ENDPOINT_PATTERN)
_SHARED_SPACE = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT range that Tailscale also uses


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    match = ENDPOINT.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not HOST:PORT, e.g. 127.0.0.1:50052")
    return Endpoint(match["host"].strip("[]"), int(match["port"]))


def is_private(endpoint: Endpoint) -> bool:
    """Loopback or a private range, by the addresses the host name resolves to (all of them must be)."""
    try:
        infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addresses = {ipaddress.ip_address(info[4][0]) for info in infos}
    return bool(addresses) and all(
        a.is_loopback or a.is_private or a.is_link_local or (a.version == 4 and a in _SHARED_SPACE) for a in addresses
    )


def unreachable(endpoint: Endpoint, timeout: float) -> str:
    """Why a TCP connection to the worker fails ("" when it connects): refused, timed out, unknown host."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout):
            return ""
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
