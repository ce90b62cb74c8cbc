"""The remote tier's value format and lease values: pure logic, no Redis."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.remote import record as rec
from kvpool.daemon.remote.lease import Lease
from kvpool.daemon.remote.store import redacted


def checkpoint(session: str = "s1") -> tuple[rec.RemoteRecord, bytes]:
    state = bytes(range(256)) * 40
    tokens = np.arange(10, dtype="<i4").tobytes()
    payload = state + tokens
    record = rec.RemoteRecord(
        session=session,
        token_sha256=rec.token_hash("secret"),
        task="voice",
        n_tokens=10,
        n_kv=9,
        state_bytes=len(state),
        fingerprint="f" * 32,
        kv_layout="type_k=1,type_v=1,swa_full=0",
        checksum=checksum(payload),
        version=3,
        generation=7,
        last_used=1.0,
        written_at=2.0,
        node="dock",
    )
    return record, payload


def joined(record: rec.RemoteRecord, payload: bytes) -> bytes:
    """The record's value and the payload as one string, so that one damage can fall on either."""
    return rec.encode(record) + payload


def decode_joined(value: bytes, record: rec.RemoteRecord, session: str, fingerprint: str, layout: str) -> object:
    """Split a (damaged) joined value where the undamaged record's value ends, and decode the two parts."""
    split = len(rec.encode(record))
    return rec.decode(value[:split], value[split:], session, fingerprint, layout)


def test_a_value_decodes_to_its_record_and_payload() -> None:
    record, payload = checkpoint()
    got, got_payload = rec.decode(rec.encode(record), payload, "s1", record.fingerprint, record.kv_layout)
    assert got == record and bytes(got_payload) == payload
    assert rec.token_matches(got, "secret") and not rec.token_matches(got, "guess")


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda v: v[:5], "truncated"),
        (lambda v: v[:-1], "truncated"),
        (lambda v: b"XXXXXXXX" + v[8:], "not a kvpool checkpoint"),
        (lambda v: v[:12] + b"\xc1" + v[13:], "cannot be read"),
        (lambda v: v[:-3] + bytes([v[-3] ^ 1]) + v[-2:], "checksum"),
    ],
)
def test_damaged_values_say_what_is_wrong(damage: object, why: str) -> None:
    record, payload = checkpoint()
    with pytest.raises(rec.RecordCorrupt, match=why):
        decode_joined(damage(joined(record, payload)), record, "s1", record.fingerprint, record.kv_layout)  # type: ignore[operator]


def test_a_record_with_bytes_past_its_end_is_refused() -> None:
    record, payload = checkpoint()
    with pytest.raises(rec.RecordCorrupt, match="past its end"):
        rec.decode(rec.encode(record) + b"x", payload, "s1", record.fingerprint, record.kv_layout)


def test_another_models_or_sessions_value_is_refused() -> None:
    record, payload = checkpoint()
    value = rec.encode(record)
    with pytest.raises(rec.RecordCorrupt, match="another model"):
        rec.decode(value, payload, "s1", "e" * 32, record.kv_layout)
    with pytest.raises(rec.RecordCorrupt, match="another model"):
        rec.decode(value, payload, "s1", record.fingerprint, "type_k=8,type_v=8,swa_full=0")
    with pytest.raises(rec.RecordCorrupt, match="another session"):
        rec.decode(value, payload, "s2", record.fingerprint, record.kv_layout)


def test_keys_are_namespaced_by_model_and_kv_layout() -> None:
    a = rec.Keys.of("kvpool", "f" * 32, "type_k=1")
    assert a.snap("s") != rec.Keys.of("kvpool", "e" * 32, "type_k=1").snap("s")
    assert a.snap("s") != rec.Keys.of("kvpool", "f" * 32, "type_k=8").snap("s")
    assert a.snap("s").startswith("kvpool:" + "f" * 32) and a.lease("s") != a.snap("s") != a.gen("s")
    assert len({a.rec("s"), a.snap("s"), a.stage("s", 1), a.stage("s", 2)}) == 4


def test_lease_values_and_redacted_urls() -> None:
    lease = Lease(12, "dock ipc:///run/kvpool/kvpoold.sock")
    assert Lease.parse(lease.value.encode()) == lease
    assert redacted("redis://:hunter2@10.0.0.2:6379/0") == "redis://***@10.0.0.2:6379/0"
    assert redacted("rediss://user:pw@host/1") == "rediss://***@host/1"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
