"""The cross-node tier against real parts: two (or three) kvpoold processes with their own pools and addresses
stand in for nodes, and a real redis-server on a loopback port is the remote tier."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.client import Client
from kvpool.client.errors import BadRequest, Conflict, RemoteTierUnavailable, SessionCorrupt, UnknownSession
from kvpool.daemon.remote import record as rec

from .daemon_process import DaemonProcess, free_port, poll, wait_until
from .redis_server import RedisServer, resume_when_free

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0}
TURNS = ["The robot checked the kitchen. ", "Then it went upstairs and", " finally it came back to the dock"]
NODE_ARGS = ("--hot-slots", "2", "--context-size", "2048", "--threads", "1")


def node(start_daemon: Start, redis_server: RedisServer, name: str, extra: str = "", *args: str) -> DaemonProcess:
    config = f'remote = "{redis_server.url}"\nremote_lease_ms = 1000\nremote_timeout_ms = 500\n{extra}'
    return start_daemon(*NODE_ARGS, *args, config=config, name=name)


def reference(start_daemon: Start, turns: list[str], max_tokens: int = 8) -> list[list[int]]:
    """The same turns on a daemon without a remote tier, in a session that never moves."""
    ref = start_daemon(*NODE_ARGS, name="ref")
    with ref.client() as client:
        s = client.open_session()
        out = [s.complete(t, max_tokens=max_tokens, **GREEDY).tokens for t in turns]
    ref.stop()
    return out


def remote_copy(client: Client, session: str) -> str:
    return next(i.remote for i in client.sessions() if i.session == session)


def wait_synced(client: Client, session: str) -> None:
    wait_until(lambda: remote_copy(client, session) == "current", "the remote tier to hold the newest checkpoint")


def test_a_session_roams_to_node_b_after_node_a_is_killed(start_daemon: Start, redis_server: RedisServer) -> None:
    a = node(start_daemon, redis_server, "a")
    b = node(start_daemon, redis_server, "b")
    with a.client() as client:
        s = client.open_session()
        first = [s.complete(t, max_tokens=8, **GREEDY).tokens for t in TURNS[:2]]
        wait_synced(client, s.id)
        assert client.status().remote.writes >= 2
        sid, token = s.id, s.token
    a.stop(signal.SIGKILL)
    with b.client() as client:
        with pytest.raises(UnknownSession):
            client.resume_session("0123456789abcdef", token)  # not in Redis either: no lease is taken for it
        moved = resume_when_free(client, sid, token)
        last = moved.complete(TURNS[2], max_tokens=8, **GREEDY).tokens
        status = client.status()
        assert status.remote.fetches == 1 and status.sessions_by_tier.get("hot") == 1
        wait_synced(client, sid)  # node B now writes it, under its own lease
    assert [*first, last] == reference(start_daemon, TURNS)
    record = stored_record(redis_server, sid)
    assert b.address in record.node and record.n_tokens == len(moved_history(b, sid, token))


def session_key(redis_server: RedisServer, kind: str, session: str) -> bytes:
    (key,) = redis_server.client().keys(f"kvpool:*:{kind}:{session}")
    return key


def snap_key(redis_server: RedisServer, session: str) -> bytes:
    return session_key(redis_server, "snap", session)


def stored_record(redis_server: RedisServer, session: str) -> rec.RemoteRecord:
    """A session's remote record, read as it is stored (header, then msgpack)."""
    blob = redis_server.client().get(session_key(redis_server, "rec", session))
    _, length = rec.HEADER.unpack_from(blob)
    return msgspec.msgpack.decode(blob[rec.HEADER.size : rec.HEADER.size + length], type=rec.RemoteRecord)


def moved_history(daemon: DaemonProcess, session: str, token: str) -> list[int]:
    with daemon.client() as client:
        return client.resume_session(session, token).history()


def test_a_live_owner_keeps_its_session_and_the_lease_race_has_one_winner(
    start_daemon: Start, redis_server: RedisServer
) -> None:
    a = node(start_daemon, redis_server, "a")
    b = node(start_daemon, redis_server, "b")
    c = node(start_daemon, redis_server, "c")
    with a.client() as client:
        s = client.open_session()
        s.complete(TURNS[0], max_tokens=8, **GREEDY)
        wait_synced(client, s.id)
        with b.client() as other, pytest.raises(Conflict, match=a.address):
            other.resume_session(s.id, s.token)  # A is alive and renews its lease: B may not fork the session
        assert s.complete(TURNS[1], max_tokens=4, **GREEDY).usage.completion_tokens == 4
        wait_synced(client, s.id)
    a.stop(signal.SIGKILL)
    raw = redis_server.client()
    wait_until(lambda: not raw.keys(f"kvpool:*:lease:{s.id}"), "the dead node's lease to expire", timeout=30)

    outcomes: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def resume(daemon: DaemonProcess) -> None:
        with daemon.client() as client:
            barrier.wait(10)
            try:
                moved = client.resume_session(s.id, s.token)
                outcomes[daemon.address] = moved.complete(TURNS[2], max_tokens=6, **GREEDY).tokens
                wait_synced(client, s.id)  # the winner's checkpoint of that turn reached Redis
            except Conflict as exc:
                outcomes[daemon.address] = exc

    threads = [threading.Thread(target=resume, args=(d,)) for d in (b, c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [addr for addr, out in outcomes.items() if isinstance(out, list)]
    losers = [out for out in outcomes.values() if isinstance(out, Conflict)]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert winners[0] in losers[0].message  # the loser is told who owns the session
    loser = c if winners[0] == b.address else b
    with loser.client() as client, pytest.raises(Conflict):
        client.resume_session(s.id, s.token)
    record = stored_record(redis_server, s.id)
    assert winners[0] in record.node  # nothing forked: only the winner wrote after the race


def test_migrate_hands_a_session_over(start_daemon: Start, redis_server: RedisServer) -> None:
    a = node(start_daemon, redis_server, "a")
    b = node(start_daemon, redis_server, "b")
    with a.client() as client:
        s = client.open_session()
        first = [s.complete(t, max_tokens=8, **GREEDY).tokens for t in TURNS[:2]]
        moved = s.migrate(b.address)
        try:
            assert client.status().remote.migrations == 1 and client.sessions() == []
            assert moved.client.status().sessions_by_tier == {"hot": 1}  # prefetched into a free slot
            last = moved.complete(TURNS[2], max_tokens=8, **GREEDY).tokens
            with pytest.raises(Conflict, match=b.address):
                client.resume_session(s.id, s.token)  # A let it go; B owns it now
        finally:
            moved.client.close()
        empty = client.open_session()
        with pytest.raises(BadRequest, match="nothing to hand over"):
            empty.migrate(b.address)
    assert [*first, last] == reference(start_daemon, TURNS)


def two_nodes_and_a_synced_session(start_daemon: Start, redis_server: RedisServer) -> tuple:
    """Nodes a and b, and a session of one turn on a whose checkpoint Redis holds (its id and token)."""
    a = node(start_daemon, redis_server, "a")
    b = node(start_daemon, redis_server, "b")
    with a.client() as client:
        s = client.open_session()
        s.complete(TURNS[0], max_tokens=4, **GREEDY)
        wait_synced(client, s.id)
    return a, b, SimpleNamespace(id=s.id, token=s.token)


def test_kvpool_migrate_and_sessions_show_where_it_lives(start_daemon: Start, redis_server: RedisServer) -> None:

    a, b, s = two_nodes_and_a_synced_session(start_daemon, redis_server)
    cli = [sys.executable, "-m", "kvpool.client.cli", "--address"]
    listed = subprocess.run([*cli, a.address, "sessions"], capture_output=True, text=True, timeout=60)
    assert s.id in listed.stdout and "+ remote" in listed.stdout
    status = subprocess.run([*cli, a.address, "status"], capture_output=True, text=True, timeout=60)
    assert re.search(r"remote  redis://127\.0\.0\.1:\d+/0 as .*: connected, [1-9]\d* writes", status.stdout)
    assert "preload  hints: 0 preloads" in status.stdout
    moved = subprocess.run(
        [*cli, a.address, "migrate", f"{s.id}:{s.token}", "--to", b.address], capture_output=True, text=True, timeout=60
    )
    assert moved.returncode == 0, moved.stderr
    assert b.address in moved.stdout
    listed = subprocess.run([*cli, b.address, "sessions"], capture_output=True, text=True, timeout=60)
    assert s.id in listed.stdout and "here (hot" in listed.stdout


def metric(port: int, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_redis_killed_and_restarted_mid_run(start_daemon: Start, redis_server: RedisServer) -> None:
    port = free_port()
    a = node(start_daemon, redis_server, "a", "", "--http", f"127.0.0.1:{port}")
    b = node(start_daemon, redis_server, "b")
    with a.client() as client:
        sessions = [client.open_session() for _ in range(3)]
        for s in sessions:
            s.complete(TURNS[0], max_tokens=4, **GREEDY)
        for s in sessions:
            wait_synced(client, s.id)
        redis_server.kill()
        # Local tiers go on serving: every turn succeeds, hot or restored from the pool (3 sessions, 2 slots).
        for turn in TURNS[1:]:
            for s in sessions:
                assert s.complete(turn, max_tokens=4, **GREEDY).usage.completion_tokens == 4
        wait_until(lambda: not client.status().remote.connected, "the daemon to notice that Redis is gone")
        status = client.status()
        assert status.remote.write_failures > 0 and status.remote.disconnects == 1
        assert {remote_copy(client, s.id) for s in sessions} == {"behind"}
        assert metric(port, "kvpool_remote_connected") == 0
        assert metric(port, "kvpool_remote_events_total", kind="write_failures") > 0
        assert "remote tier unreachable" in a.log()
        with b.client() as other, pytest.raises(RemoteTierUnavailable, match="did not answer"):
            other.resume_session(sessions[0].id, sessions[0].token)
        assert b.log().count("Traceback") == 0

        redis_server.start()  # the same port, empty (no persistence): the daemon reconnects by itself
        for s in sessions:
            wait_synced(client, s.id)  # the pending writes went through, under leases taken again
        assert client.status().remote.connected
        final = [s.history() for s in sessions]
    a.stop(signal.SIGKILL)
    with b.client() as other:
        moved = resume_when_free(other, sessions[0].id, sessions[0].token)
        assert moved.history() == final[0]


def test_a_redis_restarted_empty_gets_every_copy_written_again(start_daemon: Start, redis_server: RedisServer) -> None:
    """With nothing pending, a Redis that comes back empty lost the copies while the node took their leases again and
    said "current": a node that then died had nothing to roam from."""
    a, b, s = two_nodes_and_a_synced_session(start_daemon, redis_server)
    with a.client() as client:
        history = client.resume_session(s.id, s.token).history()
        redis_server.kill()
        redis_server.start()  # the same port, empty
        raw = redis_server.client()
        wait_until(lambda: raw.keys(f"kvpool:*:rec:{s.id}"), "the copy to be written again", 30.0)
        wait_synced(client, s.id)
    a.stop(signal.SIGKILL)
    with b.client() as other:
        assert resume_when_free(other, s.id, s.token).history() == history


def test_a_migrate_refused_before_the_session_leaves(start_daemon: Start, redis_server: RedisServer) -> None:
    """A migrate while Redis is down is refused at once and the session stays (it hung until the client's timeout,
    was refused CONFLICT meanwhile, and moved once Redis came back); one to a daemon without a remote tier is
    refused before the session leaves (it left, and the sentence said the session was gone)."""
    a, b, s = two_nodes_and_a_synced_session(start_daemon, redis_server)
    lone = start_daemon(*NODE_ARGS, name="lone")
    with a.client() as client:
        session = client.resume_session(s.id, s.token)
        with pytest.raises(BadRequest, match="has no remote tier"):
            session.migrate(lone.address)
        assert [i.session for i in client.sessions()] == [s.id]
        other = client.open_session()
        redis_server.kill()
        other.complete(TURNS[0], max_tokens=4, **GREEDY)  # its write waits at the head of the queue for Redis
        with pytest.raises(RemoteTierUnavailable, match="it stays here"):  # (not RequestTimeout)
            session.migrate(b.address)
        assert session.complete(TURNS[1], max_tokens=4, **GREEDY).usage.completion_tokens == 4
        redis_server.start()
        wait_synced(client, s.id)  # written again under its lease, and kept here
        assert s.id in {i.session for i in client.sessions()} and client.status().remote.migrations == 0
        moved = session.migrate(b.address)
        moved.client.close()


def corrupt_copy(redis_server: RedisServer, source: str, target: str, damage: Callable[[bytes], bytes]) -> None:
    """Copy a session's record and payload to another session id, damaged: ``damage`` gets both as one string
    (so it can fall on either), which is split again where the good record ends."""
    raw = redis_server.client()
    keys = {kind: session_key(redis_server, kind, source) for kind in ("rec", "snap")}
    good = raw.get(keys["rec"])
    value = damage(good + raw.get(keys["snap"]))
    split = len(refoot(good, session=target))
    raw.set(keys["rec"].replace(source.encode(), target.encode()), value[:split])
    raw.set(keys["snap"].replace(source.encode(), target.encode()), value[split:])


def refoot(blob: bytes, **changes: object) -> bytes:
    """The same value with record fields changed (its payload, if any, and its checksum untouched)."""
    _, length = rec.HEADER.unpack_from(blob)
    record = msgspec.msgpack.decode(blob[rec.HEADER.size : rec.HEADER.size + length], type=rec.RemoteRecord)
    return rec.encode(msgspec.structs.replace(record, **changes)) + blob[rec.HEADER.size + length :]


def test_bad_remote_values_cost_only_their_session(start_daemon: Start, redis_server: RedisServer) -> None:
    _, b, s = two_nodes_and_a_synced_session(start_daemon, redis_server)
    # Each damage applies to a copy of the good value, renamed to a session of its own.
    bad: dict[str, tuple[Callable[[bytes], bytes], str]] = {
        "flipped": (lambda blob: blob[:-50] + bytes([blob[-50] ^ 0xFF]) + blob[-49:], "checksum"),
        "truncat": (lambda blob: blob[: len(blob) // 2], "truncated"),
        "headcut": (lambda blob: blob[:10], "truncated"),
        "garbage": (lambda blob: b"not a checkpoint at all", "not a kvpool checkpoint"),
        "foreign": (lambda blob: refoot(blob, fingerprint="f" * 32), "another model"),
    }
    with b.client() as client:
        for i, (name, (damage, why)) in enumerate(bad.items()):
            target = f"{name}{i:09d}"
            corrupt_copy(redis_server, s.id, target, lambda blob, d=damage, t=target: d(refoot(blob, session=t)))
            with pytest.raises(SessionCorrupt, match=why):
                client.resume_session(target, s.token)
            with pytest.raises(UnknownSession):  # the damaged value was removed with its session
                client.resume_session(target, s.token)
        assert client.status().remote.corrupt == len(bad)
        fine = client.open_session()
        assert fine.complete("still serving", max_tokens=3, **GREEDY).usage.completion_tokens == 3
    assert "Traceback" not in b.log()


def test_remote_copies_expire_after_remote_ttl(start_daemon: Start, redis_server: RedisServer) -> None:
    a = node(start_daemon, redis_server, "a", "remote_ttl = 0.5\n")
    b = node(start_daemon, redis_server, "b")
    with a.client() as client:
        s = client.open_session()
        s.complete(TURNS[0], max_tokens=4, **GREEDY)
        wait_synced(client, s.id)
        raw = redis_server.client()
        assert 0 < raw.pttl(snap_key(redis_server, s.id)) <= 500
        wait_until(lambda: not raw.keys(f"kvpool:*:snap:{s.id}"), "the remote copy to expire")
        with b.client() as other, pytest.raises(UnknownSession, match="remote tier"):
            other.resume_session(s.id, s.token)
        assert s.complete(TURNS[1], max_tokens=4, **GREEDY).usage.completion_tokens == 4  # still local on A
        wait_synced(client, s.id)  # and written again


def test_closing_a_session_removes_its_remote_copy(start_daemon: Start, redis_server: RedisServer) -> None:
    a = node(start_daemon, redis_server, "a")
    raw = redis_server.client()
    with a.client() as client:
        s = client.open_session()
        s.complete(TURNS[0], max_tokens=4, **GREEDY)
        wait_synced(client, s.id)
        kinds = {key.decode().split(":")[-2] for key in raw.keys(f"kvpool:*:{s.id}")}
        assert {"rec", "snap", "lease"} <= kinds  # the checkpoint and this node's lease are there
        s.close()
        left = poll(lambda: raw.keys(f"kvpool:*{s.id}*"), until=lambda keys: not keys, timeout=30)
        assert left == [], f"the closed session's keys are still in Redis: {left}"
        with pytest.raises(UnknownSession, match="remote tier"):  # gone from every tier: nothing to fetch back
            client.resume_session(s.id, s.token)


def test_daemons_of_different_models_never_share_keys(
    start_daemon: Start, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from .tinymodel import build_tiny_model

    other_model = build_tiny_model(tmp_path_factory.mktemp("other") / "other.gguf", seed=7)
    a = node(start_daemon, redis_server, "a")
    config = f'remote = "{redis_server.url}"\nremote_lease_ms = 1000\n'
    other = start_daemon(*NODE_ARGS, model=other_model, config=config, name="o")
    with a.client() as client:
        s = client.open_session()
        s.complete(TURNS[0], max_tokens=4, **GREEDY)
        wait_synced(client, s.id)
    with other.client() as client, pytest.raises(UnknownSession):
        client.resume_session(s.id, s.token)  # another namespace: it never sees (nor reads) A's snapshot


def test_a_hung_redis_never_holds_a_turn_up(start_daemon: Start, redis_server: RedisServer) -> None:
    a = node(start_daemon, redis_server, "a")
    with a.client() as client:
        s = client.open_session()
        s.complete(TURNS[0], max_tokens=4, **GREEDY)
        wait_synced(client, s.id)
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing: "slow"
        try:
            for turn in TURNS[1:]:
                assert s.complete(turn, max_tokens=4, **GREEDY).usage.completion_tokens == 4
            wait_until(lambda: client.status().remote.write_failures > 0, "a write to time out")
            assert not client.status().remote.connected
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        wait_synced(client, s.id)
        assert client.status().remote.connected


def test_a_compressed_checkpoint_roams_and_is_restored_at_the_hot_types(
    start_daemon: Start, redis_server: RedisServer
) -> None:
    """Node A keeps its pool at q8_0 (KV compression, docs/kv-compression.md): the remote copy is that compressed
    state, and node B writes it back at its own hot types to continue."""
    compressed = 'pool_kv_type = "q8_0"\npool_kv_policy = "always"\n'
    a = node(start_daemon, redis_server, "a", compressed)
    b = node(start_daemon, redis_server, "b")
    with a.client() as client:
        s = client.open_session()
        first = [s.complete(t, max_tokens=8, **GREEDY).tokens for t in TURNS[:2]]
        wait_synced(client, s.id)
        sid, token = s.id, s.token
    a.stop(signal.SIGKILL)
    record = stored_record(redis_server, sid)
    assert record.kv_type == 8 and record.raw_bytes > record.state_bytes  # q8_0, smaller than at f16
    with b.client() as client:
        moved = resume_when_free(client, sid, token)
        last = moved.complete(TURNS[2], max_tokens=8, **GREEDY).tokens
        assert client.status().moves.restores_decompressed == 1
    # The tiny model's logits are far apart (tests/tinymodel.py): q8_0 changes no greedy token.
    assert [*first, last] == reference(start_daemon, TURNS)
