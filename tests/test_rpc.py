"""One model across devices with llama.cpp's RPC backend: real `kvpool rpc-worker` processes (llama.cpp's own
server) on 127.0.0.1, real daemons. Greedy outputs equal the all-local run, snapshots cross the split exactly,
a worker down at start or lost mid-run gives a clear error, and a restart recovers every session."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool import protocol as p
from kvpool.client import Client
from kvpool.daemon.config import ConfigError, load_config
from kvpool.daemon.llama.gguf_meta import read_tensor_sizes
from kvpool.daemon.llama.memory_plan import plan_memory
from kvpool.daemon.ops.prometheus import render
from kvpool.daemon.rpc.endpoints import Endpoint, is_private, parse_endpoint
from kvpool.daemon.rpc.faults import EXIT_WORKER_LOST
from kvpool.daemon.rpc.placement import LOCAL, place_layers

from .daemon_process import DaemonProcess, free_port, kvpoold_command, run_until_exit, wait_until
from .raw import RawConnection
from .rpc_worker import RpcWorker

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0}
SLOTS = ("--hot-slots", "2", "--context-size", "2048", "--threads", "1")


@pytest.fixture
def start_worker(short_tmp: Path) -> Iterator[Callable[..., RpcWorker]]:
    started: list[RpcWorker] = []

    def start(port: int | None = None, *args: str) -> RpcWorker:
        worker = RpcWorker(short_tmp, port, *args)
        started.append(worker)
        return worker.start()

    yield start
    for worker in started:
        worker.kill()


def prompt_of(i: int, turn: int) -> str:
    return f"session {i} turn {turn}: " + "klmnopqrst"[i % 10] * (4 + i)


def run_turns(client: Client, sessions: dict[int, object], turns: range) -> dict[int, list[list[int]]]:
    """Turn t of every session, then t+1: with fewer hot slots than sessions, each turn restores a snapshot."""
    out: dict[int, list[list[int]]] = {i: [] for i in sessions}
    for turn in turns:
        for i, s in sessions.items():
            out[i].append(s.complete(prompt_of(i, turn), max_tokens=6, **GREEDY).tokens)
    return out


def all_local(start_daemon: Start, n: int, turns: range) -> dict[int, list[list[int]]]:
    daemon = start_daemon(*SLOTS, name="local")
    with daemon.client() as client:
        result = run_turns(client, {i: client.open_session() for i in range(n)}, turns)
    daemon.stop()
    return result


# ---------------------------------------------------------------------------------------------- pure logic


def test_layer_placement_follows_llama_cpp() -> None:
    # n_gpu_layers = k: the output layer and the last k-1 repeating layers go to the devices (llama-model.cpp)
    assert place_layers(4, -1, [1.0]) == [0, 0, 0, 0, 0]
    assert place_layers(4, 3, [1.0]) == [LOCAL, LOCAL, 0, 0, 0]
    assert place_layers(4, 0, [1.0]) == [LOCAL] * 5
    assert place_layers(4, -1, [1.0, 1.0]) == [0, 0, 0, 1, 1]  # split points at 0.5: layer 2 of 5 is 0.4
    assert place_layers(4, -1, [3.0, 1.0]) == [0, 0, 0, 0, 1]
    assert place_layers(4, -1, []) == [LOCAL] * 5


def test_endpoints_and_private_ranges() -> None:
    assert parse_endpoint("127.0.0.1:50052") == Endpoint("127.0.0.1", 50052)
    assert parse_endpoint("[::1]:7") == Endpoint("::1", 7)
    for bad in ("127.0.0.1", "host:0", "host:99999", "a b:1"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_endpoint(bad)
    assert all(is_private(parse_endpoint(e)) for e in ("127.0.0.1:1", "10.1.2.3:1", "192.168.0.9:1", "100.64.1.1:1"))
    assert not is_private(parse_endpoint("8.8.8.8:1"))  # classified by address only: nothing is sent


def test_rpc_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="rpc_servers"):
        load_config(None, {"rpc_servers": ["no-port"]})
    with pytest.raises(ConfigError, match="rpc_layers"):
        load_config(None, {"rpc_layers": -2})
    assert load_config(None, {}, {"KVPOOL_RPC_SERVERS": '["127.0.0.1:50052"]'}).rpc_servers == ["127.0.0.1:50052"]


def test_memory_plan_splits_weights_and_kv_between_local_and_remote(tiny_model: Path) -> None:
    sizes = read_tensor_sizes(tiny_model)
    assert sum(sizes.values()) <= tiny_model.stat().st_size
    local = plan_memory(tiny_model, load_config(None, {"context_size": 1024}))
    split = plan_memory(tiny_model, load_config(None, {"context_size": 1024, "rpc_servers": ["127.0.0.1:1"]}))
    (remote,) = split.remote
    assert remote.layers == 2 and remote.output  # rpc_layers = -1: every layer
    assert split.hot_kv == 0 and remote.hot_kv == local.hot_kv
    assert remote.weights == sum(n for name, n in sizes.items() if name != "token_embd.weight")
    assert split.weights == sizes["token_embd.weight"]  # the input embeddings always stay local
    half = plan_memory(
        tiny_model, load_config(None, {"context_size": 1024, "rpc_servers": ["127.0.0.1:1"], "rpc_layers": 2})
    )
    assert half.remote[0].layers == 1 and half.hot_kv == remote.hot_kv // 2 == half.remote[0].hot_kv
    assert "remote" in half.table() and "127.0.0.1:1 (1 layers + output" in half.table()


# ---------------------------------------------------------------------------------------------- real workers


def test_one_and_two_workers_answer_as_the_all_local_model(
    start_daemon: Start, start_worker: Callable[..., RpcWorker]
) -> None:
    expected = all_local(start_daemon, 4, range(2))
    a, b = start_worker(), start_worker()
    one = start_daemon(*SLOTS, "--rpc-servers", a.endpoint, name="one")
    with one.client() as client:
        assert run_turns(client, {i: client.open_session() for i in range(4)}, range(2)) == expected
        (worker,) = client.status().rpc_workers
        assert (worker.endpoint, worker.layers, worker.output, worker.state) == (a.endpoint, 2, True, "connected")
        assert client.status().moves.hibernations > 0  # 4 sessions on 2 slots: snapshots crossed the split
    one.stop()
    # Half the layers local, the other layer on one worker and the output on the other.
    two = start_daemon(
        *SLOTS, "--rpc-servers", f"{a.endpoint},{b.endpoint}", "--rpc-layers", "2", name="two",
        config="tensor_split = [1.0, 1.0]\n[tasks.default]\n",
    )  # fmt: skip
    with two.client() as client:
        assert run_turns(client, {i: client.open_session() for i in range(4)}, range(2)) == expected
        workers = client.status().rpc_workers
        assert [(w.layers, w.output) for w in workers] == [(1, False), (0, True)]
        assert client.status().moves.restores_pool > 0
    health = run_until_exit([sys.executable, "-m", "kvpool.client.cli", "--address", two.address, "health"])
    assert health.returncode == 0 and f"rpc worker {b.endpoint}: connected" in health.stdout
    with two.client() as client:
        metrics = render(client.status(), {})
    assert f'kvpool_rpc_worker_layers{{endpoint="{a.endpoint}"}} 1.0' in metrics


def test_shared_prefixes_across_the_split_are_exact(
    start_daemon: Start, start_worker: Callable[..., RpcWorker]
) -> None:
    """Sessions of a task with a system prompt share its cells (llama_memory_seq_cp) and snapshot only their own
    (through the scratch sequence): with the KV of the remote layers on the worker too."""
    config = "[tasks.default]\nsystem_prompt = 'You are a terse assistant. Answer in one word.'\n"

    def run(*extra: str, name: str) -> tuple[dict[int, list[list[int]]], int]:
        daemon = start_daemon(*SLOTS, *extra, config=config, name=name)
        with daemon.client() as client:
            out = run_turns(client, {i: client.open_session() for i in range(3)}, range(2))
            hits = client.status().prefixes.hits
        daemon.stop()
        return out, hits

    local, _ = run(name="local")
    split, hits = run("--rpc-servers", start_worker().endpoint, "--rpc-layers", "2", name="split")
    assert hits >= 2 and split == local


def test_sessions_survive_a_restart_across_the_split(
    start_daemon: Start, start_worker: Callable[..., RpcWorker]
) -> None:
    expected = all_local(start_daemon, 3, range(3))
    worker = start_worker()
    daemon = start_daemon(*SLOTS, "--rpc-servers", worker.endpoint, "--rpc-layers", "2", name="split")
    with daemon.client() as client:
        sessions = {i: client.open_session() for i in range(3)}
        first = run_turns(client, sessions, range(2))
        assert daemon.stop() == 0  # a clean stop checkpoints the hot sessions through the remote KV
        daemon.start()
        after = run_turns(client, sessions, range(2, 3))
    assert {i: first[i] + after[i] for i in first} == expected


def test_worker_down_at_start_is_named(tiny_model: Path, short_tmp: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    # The workers are checked before the pool is opened: a refused start leaves nothing behind.
    result = run_until_exit(kvpoold_command(tiny_model, f"ipc://{short_tmp}/d.sock", "--rpc-servers", endpoint))
    assert result.returncode == EXIT_WORKER_LOST
    assert f"rpc worker {endpoint} is down (Connection refused)" in result.stderr
    assert "kvpool rpc-worker --host 127.0.0.1" in result.stderr


def test_a_peer_that_is_no_rpc_worker_is_a_settings_error(tiny_model: Path, short_tmp: Path) -> None:
    """Something that accepts the connection and closes it (another service on that port) was reported as a worker
    lost mid-run, answers in flight and all, with the exit code systemd restarts on (75): a loop over a setting."""
    listener = socket.create_server(("127.0.0.1", 0))

    def close_each() -> None:
        while True:
            try:
                peer, _ = listener.accept()
            except OSError:
                return
            peer.close()

    threading.Thread(target=close_each, daemon=True).start()
    try:
        endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
        result = run_until_exit(kvpoold_command(tiny_model, f"ipc://{short_tmp}/d.sock", "--rpc-servers", endpoint))
    finally:
        listener.close()
    assert result.returncode == 2, result.stderr
    assert f"rpc_servers {endpoint} accepted kvpoold's connection at start but did not answer" in result.stderr
    assert "WORKER_LOST" not in result.stderr


def test_worker_serving_another_daemon_is_named(start_daemon: Start, start_worker: Callable[..., RpcWorker]) -> None:
    worker = start_worker()
    start_daemon(*SLOTS, "--rpc-servers", worker.endpoint, name="first")  # llama.cpp's server: one master at a time
    second = start_daemon(
        *SLOTS, "--rpc-servers", worker.endpoint, name="second", config="rpc_connect_timeout = 2.0\n[tasks.default]\n",
        wait=False,
    )  # fmt: skip
    assert second.proc is not None and second.proc.wait(30) == EXIT_WORKER_LOST
    assert f"rpc worker {worker.endpoint} accepted the connection but did not answer" in second.log()


def test_lost_worker_ends_generations_with_worker_lost_and_a_restart_recovers(
    start_daemon: Start, start_worker: Callable[..., RpcWorker]
) -> None:
    expected = all_local(start_daemon, 3, range(3))
    worker = start_worker()
    daemon = start_daemon(*SLOTS, "--rpc-servers", worker.endpoint, name="lost")
    with daemon.client() as client:
        sessions = {i: client.open_session() for i in range(3)}
        ids = {i: (s.id, s.token) for i, s in sessions.items()}
        run_turns(client, sessions, range(2))
        saved = len(sessions[0].history())
    raw = RawConnection(daemon.address)
    sid, token = ids[0]
    raw.send(p.Generate(id=9, session=sid, token=token, prompt="interrupted", max_tokens=4000, **GREEDY))
    assert isinstance(raw.recv(), p.Chunk)  # generating through the worker
    worker.kill()
    reply = raw.recv()
    while isinstance(reply, p.Chunk):
        reply = raw.recv()
    raw.close()
    assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.WORKER_LOST, reply
    assert f"rpc worker {worker.endpoint}" in reply.message
    # What a restart recovers, said (it said "its last completed turn", which a preempted or on_evict session is not).
    assert reply.detail == {"saved_tokens": saved} and f"{saved} tokens (detail.saved_tokens)" in reply.message
    daemon.proc.wait(30)
    assert daemon.proc.returncode == EXIT_WORKER_LOST
    assert f"rpc worker {worker.endpoint} (Connection refused) is gone" in daemon.log()

    # What systemd does (Restart=on-failure): start again; it recovers once the worker is back.
    start_worker(worker.port)
    daemon.start()
    with daemon.client() as client:
        assert client.status().sessions.open == 3
        assert len(client.resume_session(sid, token).history()) == saved
        after = run_turns(client, {i: client.resume_session(*ids[i]) for i in ids}, range(2, 3))
    assert after == {i: [turns[2]] for i, turns in expected.items()}


def test_worker_lost_while_idle_ends_the_daemon_by_itself(
    start_daemon: Start, start_worker: Callable[..., RpcWorker]
) -> None:
    worker = start_worker()
    daemon = start_daemon(*SLOTS, "--rpc-servers", worker.endpoint, name="idle")
    with daemon.client() as client, client.open_session() as s:
        s.complete("one turn", max_tokens=2)
    worker.kill()
    wait_until(lambda: daemon.proc.poll() is not None, "the daemon's periodic worker check", timeout=30)
    assert daemon.proc.returncode == EXIT_WORKER_LOST
    assert "WORKER_LOST" in daemon.log()


def test_worker_that_stops_answering_ends_the_daemon_after_rpc_timeout(
    start_daemon: Start, start_worker: Callable[..., RpcWorker]
) -> None:
    """A frozen worker (its host hung, or the link drops packets) never closes the connection, and ggml-rpc has
    no timeout: the daemon must not wait for ever."""
    worker = start_worker()
    config = "rpc_timeout = 3.0\n[tasks.default]\n"
    daemon = start_daemon(*SLOTS, "--rpc-servers", worker.endpoint, name="frozen", config=config)
    raw = RawConnection(daemon.address)
    opened = raw.open("default")
    raw.send(p.Generate(id=3, session=opened.session, token=opened.token, prompt="x", max_tokens=4000, **GREEDY))
    assert isinstance(raw.recv(), p.Chunk)
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGSTOP)  # killed by the fixture's SIGKILL, stopped or not
    reply = raw.recv()
    while isinstance(reply, p.Chunk):
        reply = raw.recv()
    raw.close()
    assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.WORKER_LOST, reply
    assert daemon.proc is not None and daemon.proc.wait(30) == EXIT_WORKER_LOST
    assert f"rpc worker {worker.endpoint} stopped answering" in daemon.log()


def test_rpc_worker_command_refuses_a_taken_port(start_worker: Callable[..., RpcWorker]) -> None:
    worker = start_worker()
    taken = subprocess.run(
        [sys.executable, "-m", "kvpool.client.cli", "rpc-worker", "--port", str(worker.port)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert taken.returncode == 1 and f"could not serve on {worker.endpoint}" in taken.stderr
    assert worker.proc is not None and worker.proc.poll() is None  # the first one still serves
