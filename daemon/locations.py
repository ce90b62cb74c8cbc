"""Where a daemon's state lives on this machine: its pool's name in /dev/shm, its spill directory, and the group
its clients are in. Derived from the address, so two daemons never share either. And whether a file it is told to
write can be."""

from __future__ import annotations

import grp
import hashlib
import os
from pathlib import Path


def appendable(path: Path) -> bool:
    """Whether a file can be opened to write or append to: itself writable, or (not there yet) its directory."""
    if path.exists():
        return path.is_file() and os.access(path, os.W_OK)
    return path.parent.is_dir() and os.access(path.parent, os.W_OK)


def group_id(group: str) -> int | None:
    """The gid of ``group`` (a name or a number); None for no group. KeyError when there is no such group."""
    if not group:
        return None
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def default_pool_name(address: str) -> str:
    return "/kvpool-" + hashlib.sha256(address.encode()).hexdigest()[:16]


def spill_dir_for(configured: str, pool_name: str) -> Path:
    """The spill directory of one pool: the configured (or default) base plus the pool's name, so daemons
    sharing a base never touch each other's files."""
    if configured:
        base = Path(configured)
    elif state := os.environ.get("STATE_DIRECTORY"):
        base = Path(state.split(":")[0]) / "spill"
    else:
        base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "kvpool" / "spill"
    return base / pool_name.lstrip("/")
