"""CURVE keys for a client of a tcp:// daemon, read from the certificate files ``zmq.auth.create_certificates``
writes: the daemon's public key file and this client's secret key file (which holds its public key too)."""

from __future__ import annotations

import os
from pathlib import Path

import zmq.auth

from .errors import KvpoolError

CurveKeys = tuple[bytes, bytes, bytes]  # (daemon public, client public, client secret): Client(curve=...)


class CurveKeyError(KvpoolError):
    """A key file is missing or is not a CURVE certificate; the message names it."""

    code = "BAD_KEY"


PathLike = str | os.PathLike[str]


def load_curve_keys(daemon_public_file: PathLike, client_secret_file: PathLike) -> CurveKeys:
    daemon_public = _load(daemon_public_file)[0]
    client_public, client_secret = _load(client_secret_file)
    if client_secret is None:
        raise CurveKeyError(
            f"{client_secret_file} holds only a public key; give this client's secret key file (*.key_secret)."
        )
    return daemon_public, client_public, client_secret


def curve_from_files(daemon_public_file: str, client_secret_file: str) -> CurveKeys | None:
    """The keys when both files are given, None when neither is; one without the other is an error."""
    if not daemon_public_file and not client_secret_file:
        return None
    if not (daemon_public_file and client_secret_file):
        raise CurveKeyError("Give both the daemon's public key file and this client's secret key file, or neither.")
    return load_curve_keys(daemon_public_file, client_secret_file)


def _load(path: PathLike) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise CurveKeyError(f"CURVE key file {path} does not exist.")
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{path} is not a CURVE certificate from zmq.auth.create_certificates ({exc}).") from None
