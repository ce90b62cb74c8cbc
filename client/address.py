"""Where the daemon listens by default; the daemon and the clients compute it the same way."""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_NAME = "kvpoold.sock"


def default_runtime_dir() -> Path:
    """$RUNTIME_DIRECTORY (systemd), else $XDG_RUNTIME_DIR/kvpool, else /tmp/kvpool-$UID."""
    if runtime := os.environ.get("RUNTIME_DIRECTORY"):
        # systemd may pass several colon-separated directories; the first is ours.
        return Path(runtime.split(":")[0])
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "kvpool"
    return Path(f"/tmp/kvpool-{os.getuid()}")


def default_address() -> str:
    """$KVPOOL_ADDRESS if set, else an ipc:// socket in the default runtime directory."""
    return os.environ.get("KVPOOL_ADDRESS") or f"ipc://{default_runtime_dir() / SOCKET_NAME}"


def ipc_path(address: str) -> Path | None:
    """The socket file of an ipc:// address, None for other transports."""
    return Path(address.removeprefix("ipc://")) if address.startswith("ipc://") else None
