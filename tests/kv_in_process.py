"""The KV tiers in this process, on the fake model: a real shared-memory pool and a real spill directory, no
daemon. Shared by the in-process tests of the tiers and the scheduler."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvpool.daemon.config import Config, load_config
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.pool.pool import Pool
from kvpool.daemon.kv.sessions import Session, SessionTable
from kvpool.daemon.kv.spill_dir import SpillDir

from .fake_model import FakeModel


@contextmanager
def kv_on_fake_model(
    tmp: Path,
    *,
    hot_slots: int = 2,
    context_size: int = 256,
    pool_bytes: int = 1 << 20,
    spill_bytes: int = 1 << 20,
    config_text: dict[str, object] | None = None,
) -> Iterator[KvManager]:
    """A KV manager over a FakeModel; the pool segment is unlinked afterwards, whatever happens."""
    config = load_config(None, {"hot_slots": hot_slots, "prefix_slots": 0, **(config_text or {})})
    model = FakeModel(context_size=context_size, hot_slots=hot_slots)
    name = f"/kvpool-test-{secrets.token_hex(6)}"
    pool = Pool.open(name, pool_bytes, config.max_sessions, model.fingerprint, model.kv_layout)
    try:
        spill = SpillDir(tmp / "spill", spill_bytes)
        yield KvManager(model, pool, spill, SessionTable(config, model.context_size), config)  # type: ignore[arg-type]
    finally:
        pool.close()
        Pool.unlink(name)


def open_session(kv: KvManager, task: str = "default") -> Session:
    """As the open handler does: a pool entry, then the session."""
    return kv.open(secrets.token_hex(8), secrets.token_hex(16), task, tokens=[], boundary=0)


def compute(kv: KvManager, s: Session, n: int) -> None:
    """What a turn does to the KV: take a hot slot, then n more tokens computed into it."""
    assert kv.make_resident(s), "no hot slot could be had"
    model = kv.model
    assert isinstance(model, FakeModel) and s.slot is not None
    assert model.fill(s.slot, s.n_kv, n)
    kv.append(s, list(range(len(s.tokens), len(s.tokens) + n)))
    kv.fed(s, n)
    s.last_used = time.monotonic()


def config_of(kv: KvManager) -> Config:
    return kv.config
