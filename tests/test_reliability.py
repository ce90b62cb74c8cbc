"""Client faults: a client that dies mid-generation, clients that are not the owner, a restarting daemon."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .curve_keys import curve_setup
from .daemon_process import DaemonProcess, kvpoold_command, run_until_exit, wait_until

Start = Callable[..., DaemonProcess]
WAIT_S = 60.0

DYING_CLIENT = """
import json, sys
from kvpool.client import Client
client = Client(sys.argv[1], timeout=120)
session = client.open_session()
print(json.dumps({"id": session.id, "token": session.token}), flush=True)
for chunk in session.generate("tell me everything", max_tokens=1_000_000, temperature=0.0):
    print("streaming", flush=True)
    sys.stdin.readline()  # stop reading here; the test kills this process
"""


def test_a_dead_clients_generation_stops_and_its_session_stays(start_daemon: Start) -> None:
    daemon = start_daemon("--context-size", "32768", "--session-timeout", "600")
    proc = subprocess.Popen(
        [sys.executable, "-c", DYING_CLIENT, daemon.address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        ids = json.loads(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "streaming"
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
    with daemon.client() as client:
        wait_until(lambda: client.status().sessions.generating == 0, "the generation to stop")
        status = client.status()
        # it stopped because its client's connection closed, long before its 1,000,000 tokens or its 32,768-token
        # context: a cut (an error to nobody), not a finish
        assert status.counters.clients_lost == 1 and status.counters.finished == {}
        assert status.counters.errors.get("CLIENT_UNRESPONSIVE") == 1
        session = client.resume_session(ids["id"], ids["token"])  # the session survived its client
        listed = {s.session: s for s in client.sessions()}
        assert listed[session.id].context_tokens < 32768
        assert session.complete(" and then?", max_tokens=3, temperature=0.0).usage.completion_tokens == 3


def test_a_slow_reader_that_is_alive_is_not_cut_off(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        stream = s.generate("slow", max_tokens=30, temperature=0.0)
        received = 0
        for chunk in stream:
            received += len(chunk.tokens)
            if received == 1:
                time.sleep(1.5)  # the reader pauses longer than the silence limit; its heartbeats keep going
        assert stream.final is not None and stream.final.finish_reason == "length" and received == 30
        assert client.status().counters.clients_lost == 0


INTRUDER = """
import json, sys
from kvpool.client import Client, Session
from kvpool.client.errors import KvpoolError
address, session_id = sys.argv[1], sys.argv[2]
results = {}
with Client(address) as client:
    forged = Session(client, session_id, "0" * 32, "default", 0)  # the id, but not the token
    for name, attempt in [("resume", lambda: client.resume_session(session_id, "0" * 32)),
                          ("history", forged.history), ("generate", lambda: forged.complete("x", max_tokens=2)),
                          ("cancel", forged.cancel), ("close", forged.close)]:
        try:
            attempt()
            results[name] = "ALLOWED"
        except KvpoolError as exc:
            results[name] = exc.code
print(json.dumps(results))
"""


def test_another_client_process_cannot_touch_a_session(daemon: DaemonProcess) -> None:
    with daemon.client() as owner:
        mine = owner.open_session()
        first = mine.complete("mine", max_tokens=2, temperature=0.0)
        intruder = subprocess.run(
            [sys.executable, "-c", INTRUDER, daemon.address, mine.id], capture_output=True, text=True, timeout=WAIT_S
        )
        assert intruder.returncode == 0, intruder.stderr
        results = json.loads(intruder.stdout)
        assert results == dict.fromkeys(("resume", "history", "generate", "cancel", "close"), "NOT_OWNER")
        assert mine.token not in intruder.stdout + intruder.stderr
        # the owner's session is untouched: the same context as before the intruder, still answering
        assert len(mine.history()) == first.usage.context_tokens
        assert mine.complete("again", max_tokens=2).usage.context_tokens > first.usage.context_tokens


def test_a_client_that_stops_reading_stalls_nobody(start_daemon: Start) -> None:
    daemon = start_daemon("--context-size", "16384")
    import zmq

    from kvpool import protocol as p

    # A raw client with a tiny receive queue starts a long generation and never reads a reply.
    stuck = zmq.Context.instance().socket(zmq.DEALER)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.connect(daemon.address)
    try:
        with daemon.client() as client:
            s = client.open_session()
            stuck_session = client.open_session()
            stuck.send(
                p.encode(
                    p.Generate(
                        id=1,
                        session=stuck_session.id,
                        token=stuck_session.token,
                        prompt="flood",
                        max_tokens=1_000_000,
                        temperature=0.0,
                    )
                )
            )
            # Meanwhile the others are served normally, and the flood is cut off once its queue is full.
            for _ in range(3):
                assert s.complete("still here", max_tokens=8, temperature=0.0).usage.completion_tokens == 8
            wait_until(lambda: client.status().counters.clients_not_reading == 1, "the flood to be cut")
            status = client.status()
            assert status.sessions.generating == 0
            assert status.memory.rss_bytes < 1 << 30
    finally:
        stuck.close(0)


def test_client_group_opens_socket_and_pool_to_one_group(start_daemon: Start, short_tmp: Path) -> None:
    import grp
    import os
    import stat

    gid = grp.getgrnam("daemon").gr_gid
    daemon = start_daemon(config='client_group = "daemon"\n[tasks.default]\n')
    sock = daemon.workdir / "kvpoold.sock"
    for path, mode in ((sock.parent, 0o750), (sock, 0o660), (Path("/dev/shm") / daemon.pool_name.lstrip("/"), 0o640)):
        info = os.stat(path)
        assert info.st_gid == gid and stat.S_IMODE(info.st_mode) == mode, (path, oct(info.st_mode), info.st_gid)
    refused = run_until_exit(
        kvpoold_command(
            daemon.model,
            f"ipc://{short_tmp}/x.sock",
            "--config",
            str(write(short_tmp / "bad.toml", 'client_group = "no-such-group"\n')),
        )
    )
    assert refused.returncode == 2 and "no-such-group" in refused.stderr


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_limits_on_prompts_connections_and_frames(start_daemon: Start) -> None:
    from kvpool import protocol as p

    from .raw import RawConnection

    config = "max_prompt_tokens = 20\nmax_inflight_per_client = 1\nmax_message_bytes = '8KiB'\n[tasks.default]\n"
    daemon = start_daemon(config=config)
    raw = RawConnection(daemon.address)
    try:
        a, b = raw.open(), raw.open()
        reply = raw.call(p.Generate(id=2, session=a.session, token=a.token, prompt="x" * 100))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.CONTEXT_OVERFLOW
        assert "max_prompt_tokens=20" in reply.message
        raw.send(p.Generate(id=3, session=a.session, token=a.token, prompt="long", max_tokens=1500, temperature=0.0))
        reply = raw.call(p.Generate(id=4, session=b.session, token=b.token, prompt="more", max_tokens=2))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.OVERLOADED and "max_inflight" in reply.message
        raw.send_frames(b"\x81" + b"x" * 20_000)  # larger than max_message_bytes: ZeroMQ drops the connection
    finally:
        raw.close()
    with daemon.client() as client:  # everyone else is still served
        assert client.open_session().complete("ok", max_tokens=2).usage.completion_tokens == 2


def test_a_multiplexing_connection_may_have_more_in_flight(start_daemon: Start) -> None:
    from kvpool import protocol as p

    from .raw import RawConnection

    config = "max_inflight_per_client = 1\nmax_inflight_per_multiplexer = 2\n[tasks.default]\n"
    daemon = start_daemon(config=config)
    raw = RawConnection(daemon.address)
    try:
        hello = raw.call(p.Hello(id=1, version=p.PROTOCOL_VERSION, multiplexer=True))
        assert isinstance(hello, p.HelloReply) and hello.max_inflight == 2
        a, b, c = raw.open(), raw.open(), raw.open()
        for i, s in enumerate((a, b)):  # two long generations: a plain connection could have only one
            raw.send(p.Generate(id=10 + i, session=s.session, token=s.token, prompt="go", max_tokens=1500))
        reply = raw.call(p.Generate(id=12, session=c.session, token=c.token, prompt="more", max_tokens=2))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.OVERLOADED
        assert "max_inflight_per_multiplexer=2" in reply.message
    finally:
        raw.close()
    with daemon.client() as client:
        assert client.max_inflight == 1


def test_unwritable_spill_dir_is_one_clear_start_up_error(short_tmp: Path, tiny_model: Path) -> None:
    from kvpool.daemon.kv.pool.pool import Pool

    blocker = short_tmp / "a-file"
    blocker.write_text("not a directory")
    pool = "/kvpool-test-spill-refused"
    try:
        done = run_until_exit(
            kvpoold_command(
                tiny_model,
                f"ipc://{short_tmp}/k.sock",
                "--spill-dir",
                str(blocker),
                "--pool-name",
                pool,
                "--cache-pool-size",
                "8MiB",
            )
        )
        assert done.returncode == 1 and "Spill directory" in done.stderr and "not writable" in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        Pool.unlink(pool)  # the pool reserved before the spill dir was tried (the next start would reuse it)


def test_tcp_needs_curve_and_lets_in_only_listed_keys(start_daemon: Start, short_tmp: Path, tiny_model: Path) -> None:
    from kvpool.client import Client, DaemonUnavailable

    curve = curve_setup(short_tmp)
    refused = run_until_exit(kvpoold_command(tiny_model, curve.address))  # tcp:// without keys: refused at start
    assert refused.returncode == 1 and "CURVE" in refused.stderr

    daemon = start_daemon("--address", curve.address, config=curve.daemon_config, wait=False)
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            client = Client(curve.address, connect_timeout=1.0, curve=curve.keys())
            break
        except DaemonUnavailable:
            assert time.monotonic() < deadline, daemon.log()
    with client, client.open_session() as session:
        assert session.complete("over tcp", max_tokens=3).usage.completion_tokens == 3
    with pytest.raises(DaemonUnavailable):  # a key that is not listed never gets an answer
        Client(curve.address, connect_timeout=1.0, curve=curve.keys(curve.stranger_secret_file))


def test_asyncio_client_learns_of_a_restart_at_once(start_daemon: Start) -> None:
    import asyncio

    from kvpool.client import DaemonUnavailable
    from kvpool.client.aio import AsyncClient

    daemon = start_daemon("--context-size", "32768")

    async def scenario() -> tuple[str, int]:
        async with await AsyncClient.connect(daemon.address, timeout=120.0) as client:
            session = await client.open_session()
            await session.complete("before", max_tokens=2, temperature=0.0)
            context = len(await session.history())
            stream = session.generate("long", max_tokens=1_000_000, temperature=0.0)
            await stream.__anext__()  # it is generating
            daemon.stop(signal.SIGKILL)
            daemon.start()
            try:
                async for _chunk in stream:
                    pass
                outcome = "finished"
            except DaemonUnavailable:
                outcome = "unavailable"
            resumed = await client.resume_session(session.id, session.token)  # resent until the new daemon answers
            return outcome, len(await resumed.history()) - context

    outcome, grown = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    assert outcome == "unavailable" and grown == 0  # told at once, and the interrupted turn was not kept
