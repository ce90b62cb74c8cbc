"""CURVE certificates for a tcp:// daemon and its clients, made with zmq.auth, and a free loopback address."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from .daemon_process import free_port


@dataclass(frozen=True)
class CurveSetup:
    address: str  # tcp://127.0.0.1:PORT
    server_public_file: Path
    client_secret_file: Path  # listed in allowed/
    stranger_secret_file: Path  # not listed
    daemon_config: str  # the daemon's curve_secret_file and curve_clients_dir

    def keys(self, secret_file: Path | None = None) -> tuple[bytes, bytes, bytes]:
        server_public, _ = zmq.auth.load_certificate(self.server_public_file)
        public, secret = zmq.auth.load_certificate(secret_file or self.client_secret_file)
        assert secret is not None
        return server_public, public, secret


def curve_setup(directory: Path) -> CurveSetup:
    keys, allowed = directory / "keys", directory / "allowed"
    keys.mkdir(parents=True)
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(keys, "server")
    client_public, client_secret = zmq.auth.create_certificates(keys, "client")
    _, stranger_secret = zmq.auth.create_certificates(keys, "stranger")
    (allowed / "client.key").write_bytes(Path(client_public).read_bytes())
    return CurveSetup(
        address=f"tcp://127.0.0.1:{free_port()}",
        server_public_file=Path(server_public),
        client_secret_file=Path(client_secret),
        stranger_secret_file=Path(stranger_secret),
        daemon_config=f'curve_secret_file = "{server_secret}"\ncurve_clients_dir = "{allowed}"\n[tasks.default]\n',
    )
