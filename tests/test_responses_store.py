"""The stored responses (gateway/responses_store.py), pure logic: kept across a reopen, bounded in count and bytes
(the oldest go first), expired after their time, deleted on request."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.gateway.responses_store import ResponseStore


def response(i: int, padding: int = 0) -> dict:
    return {"id": f"resp_{i}", "object": "response", "output": [], "note": "x" * padding}


def test_responses_outlive_a_reopen_and_are_deleted_on_request(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite"
    store = ResponseStore(path, max_count=10, max_bytes=1 << 20, ttl_s=3600)
    store.put(response(1), "chain-a", [{"role": "user", "content": "hi"}], [{"id": "msg_1", "type": "message"}])
    store.close()
    again = ResponseStore(path, max_count=10, max_bytes=1 << 20, ttl_s=3600)
    found = again.get("resp_1")
    assert found is not None and found.chain == "chain-a" and found.messages == [{"role": "user", "content": "hi"}]
    assert found.input_items == [{"id": "msg_1", "type": "message"}] and found.response["id"] == "resp_1"
    assert again.delete("resp_1") and again.get("resp_1") is None and not again.delete("resp_1")
    again.close()


def test_the_oldest_go_first_beyond_the_count_and_the_bytes(tmp_path: Path) -> None:
    store = ResponseStore(None, max_count=3, max_bytes=1 << 20, ttl_s=3600)
    for i in range(5):
        store.put(response(i), "", [], [])
    assert len(store) == 3 and store.get("resp_0") is None and store.get("resp_1") is None
    assert store.get("resp_4") is not None
    small = ResponseStore(None, max_count=100, max_bytes=3_000, ttl_s=3600)
    for i in range(5):
        small.put(response(i, padding=900), "", [], [])  # ~1 KB each
    assert 1 <= len(small) <= 3 and small.get("resp_4") is not None and small.get("resp_0") is None


def test_a_response_expires_after_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpool.gateway.responses_store as module

    now = [1000.0]
    monkeypatch.setattr(module.time, "time", lambda: now[0])
    store = ResponseStore(None, max_count=10, max_bytes=1 << 20, ttl_s=60)
    store.put(response(1), "", [], [])
    now[0] += 59
    assert store.get("resp_1") is not None
    now[0] += 2
    assert store.get("resp_1") is None
    store.put(response(2), "", [], [])  # (a write also removes what expired)
    assert len(store) == 1
