"""Running on a device: systemd notify and watchdog, health and metrics, logs, the memory plan, configuration
precedence, the example tasks."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.client.errors import Overloaded
from kvpool.daemon.config import load_config
from kvpool.daemon.main import default_pool_name
from kvpool.daemon.serve.notify import Notifier

from .daemon_process import DaemonProcess, free_port, kvpoold_command, run_until_exit, wait_until
from .system_packages import need

Start = Callable[..., DaemonProcess]
ROOT = Path(__file__).resolve().parent.parent
RECV_TIMEOUT_S = 30.0


@pytest.fixture
def notify_socket(short_tmp: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(short_tmp / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(RECV_TIMEOUT_S)
    yield path, sock
    sock.close()


def messages(sock: socket.socket) -> dict[str, str]:
    return dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())


def test_ready_comes_after_the_socket_is_bound_and_the_model_loaded(
    start_daemon: Start, notify_socket: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sock = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    daemon = start_daemon(wait=False)
    first = messages(sock)
    assert first.get("READY") == "1" and "sessions" in first["STATUS"]
    assert first["MAINPID"] == str(daemon.proc.pid)
    # At READY the daemon already answers: nothing is loaded lazily after it.
    with daemon.client(connect_timeout=2.0) as client:
        assert client.status().model.n_vocab == 259
    pings = [messages(sock) for _ in range(3)]
    assert all(p.get("WATCHDOG") == "1" for p in pings)
    daemon.proc.terminate()
    assert "STOPPING" in messages(sock)


def test_watchdog_pings_stop_when_the_engine_is_stuck(notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    beat = [time.monotonic()]
    notifier.start_watchdog(lambda: beat[0], lambda: "test")
    try:
        deadline = time.monotonic() + 1.0
        pings = 0
        while time.monotonic() < deadline:  # a stepping engine: the beat keeps moving, pings keep coming
            beat[0] = time.monotonic()
            sock.settimeout(0.5)
            pings += messages(sock).get("WATCHDOG") == "1"
        assert pings >= 3
        sock.settimeout(0.6)  # now the engine is stuck: the beat stays old, so no more pings after this one
        try:
            while True:
                messages(sock)
        except TimeoutError:
            pass
        with pytest.raises(TimeoutError):
            messages(sock)
    finally:
        notifier.close()


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=RECV_TIMEOUT_S) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_parse_and_move_with_traffic(start_daemon: Start) -> None:
    port = free_port()
    daemon = start_daemon("--http", f"127.0.0.1:{port}")
    code, body = fetch(f"http://127.0.0.1:{port}/health")
    assert code == 200 and json.loads(body)["ok"] is True

    def sample(text: str, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        raise AssertionError(f"{name} {labels} not in /metrics")

    _, before = fetch(f"http://127.0.0.1:{port}/metrics")
    system = "A system prompt long enough to be shared by the second session. " * 2
    with daemon.client() as client, client.open_session() as s:
        s.complete("metrics please", max_tokens=5, temperature=0.0)
        for _ in range(2):  # the second session shares the first one's system prompt
            client.open_session(system_prompt=system).complete("hi", max_tokens=1, temperature=0.0)
        _, after = fetch(f"http://127.0.0.1:{port}/metrics")  # while the session (and its snapshot) exists
    families = {f.name: f.type for f in text_string_to_metric_families(after)}
    assert families["kvpool_generated_tokens"] == "counter" and families["kvpool_ttft_seconds"] == "histogram"
    assert sample(after, "kvpool_generated_tokens_total") - sample(before, "kvpool_generated_tokens_total") == 7
    assert sample(after, "kvpool_prefix_hits_total") - sample(before, "kvpool_prefix_hits_total") == 1
    assert sample(after, "kvpool_prefix_tokens_saved_total") > 16 and sample(after, "kvpool_prefixes") == 1
    assert sample(after, "kvpool_prefix_bytes", kind="stored") > 0
    assert sample(after, "kvpool_requests_total", op="generate") >= 1
    assert sample(after, "kvpool_ttft_seconds_count", task="default") == 3
    assert sample(after, "kvpool_ttft_seconds_bucket", task="default", le="+Inf") == 3
    assert sample(after, "kvpool_pool_bytes", state="used") > 0
    most = sample(after, "kvpool_decode_threads_max")
    assert 1 <= sample(after, "kvpool_decode_threads") <= most == min(len(os.sched_getaffinity(0)), most)
    assert sample(after, "kvpool_step_slowdown") > 0
    assert sample(after, "kvpool_thread_count_total", event="switch") >= 0
    assert fetch(f"http://127.0.0.1:{port}/nothing")[0] == 404
    # kvpool health: exit 0 while the daemon answers, 3 once it is gone
    health = [sys.executable, "-m", "kvpool.client.cli", "--address", daemon.address, "health"]
    assert run_until_exit(health).returncode == 0
    daemon.stop()
    assert run_until_exit(health).returncode == 3


def test_the_decode_thread_count_follows_the_cores_unless_fixed(start_daemon: Start) -> None:
    adaptive = start_daemon("--threads", "2", name="adaptive")
    fixed = start_daemon("--threads", "2", "--no-adapt-threads", name="fixed")
    for daemon in (adaptive, fixed):
        with daemon.client() as client, client.open_session() as s:
            s.complete("count the threads", max_tokens=4, temperature=0.0)
            cpu = client.status().cpu
        assert cpu is not None and cpu.most_threads == 2 and 1 <= cpu.threads <= 2
        assert cpu.slowdown is not None and cpu.slowdown > 0  # the steps were measured against their start
        shown = run_until_exit([sys.executable, "-m", "kvpool.client.cli", "--address", daemon.address, "status"])
        assert re.search(r"^\s+cpu  .*threads", shown.stdout, re.M), shown.stdout
        if daemon is adaptive:
            assert cpu.adaptive and cpu.fixed_because == "" and "following the free cores" in shown.stdout
        else:
            assert not cpu.adaptive and cpu.threads == 2 and cpu.probes == 0
            assert cpu.fixed_because == "adapt_threads = false" and "fixed (adapt_threads = false)" in shown.stdout


def test_check_config_counts_the_cores_the_daemon_may_use(short_tmp: Path, tiny_model: Path) -> None:
    address = f"ipc://{short_tmp}/k.sock"
    one = run_until_exit(["taskset", "-c", "0", *kvpoold_command(tiny_model, address, "--check-config")])
    assert one.returncode == 0, one.stderr
    assert "decode threads: 1 (one per core it may use; 1 CPUs in its affinity" in one.stderr
    assert "one thread: nothing to adapt" in one.stderr
    fixed = run_until_exit(kvpoold_command(tiny_model, address, "--threads", "2", "--deterministic", "--check-config"))
    assert "decode threads: 2 (the threads setting;" in fixed.stderr
    assert "fixed (deterministic decoding)" in fixed.stderr


def test_json_logs_and_log_file(start_daemon: Start, short_tmp: Path) -> None:
    log_file = short_tmp / "kvpoold.jsonl"
    daemon = start_daemon("--log-format", "json", "--log-file", str(log_file), "--log-level", "debug")
    daemon.stop()
    records = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert any("ready" in r["msg"] for r in records)
    assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)
    # llama.cpp's own messages come through the same logger, at debug level
    assert any(r["logger"] == "kvpool.llama" and r["level"] == "debug" for r in records)
    stderr_lines = [line for line in daemon.log().splitlines() if line.startswith("{")]
    assert stderr_lines and json.loads(stderr_lines[-1])["msg"] == "kvpoold stopped"


def truncated_copy(model: Path, where: Path) -> Path:
    """A GGUF whose metadata is intact but whose tensors are cut off: llama.cpp cannot load it."""
    data = model.read_bytes()
    where.write_bytes(data[: len(data) // 3])
    return where


def test_over_budget_memory_plan_is_refused_before_the_model_loads(short_tmp: Path, tiny_model: Path) -> None:
    broken = truncated_copy(tiny_model, short_tmp / "cut.gguf")
    address = f"ipc://{short_tmp}/k.sock"
    refused = run_until_exit(kvpoold_command(broken, address, "--cache-pool-size", "64MiB", "--memory-limit", "32MiB"))
    assert refused.returncode == 2
    assert "memory plan" in refused.stderr and "memory_limit is 32 MiB" in refused.stderr
    assert "could not load" not in refused.stderr  # the plan stopped it, not a failed load
    check = run_until_exit(
        kvpoold_command(tiny_model, address, "--cache-pool-size", "16MiB", "--memory-limit", "1GiB", "--check-config")
    )
    assert check.returncode == 0 and "pool" in check.stderr and "fits its memory_limit" in check.stderr
    assert not Path("/dev/shm", default_pool_name(address).lstrip("/")).exists()  # --check-config allocates nothing


def test_configuration_precedence(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("hot_slots = 2\ncontext_size = 1024\nthreads = 1\n")
    env = {"KVPOOL_HOT_SLOTS": "6", "KVPOOL_CONTEXT_SIZE": "2048", "KVPOOL_LOG_LEVEL": "debug"}
    config = load_config(path, {"hot_slots": 8}, env)
    # defaults < file < environment < flags
    assert (config.hot_slots, config.context_size, config.threads, config.log_level, config.batch_size) == (
        8,
        2048,
        1,
        "debug",
        512,
    )


def run_example(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_example_tasks_run_end_to_end(start_daemon: Start) -> None:
    daemon = start_daemon("--config", str(ROOT / "configs" / "default.toml"))
    env = os.environ | {"KVPOOL_ADDRESS": daemon.address}
    data = ROOT / "examples" / "data"
    # The tiny model spells JSON byte by byte: room for whole answers, and no voice budget to refuse them.
    turns = ("--script", str(data / "voice_turns.txt"), "--task", "default", "--max-tokens", "400")
    voice = run_example("voice_assistant.py", *turns, env=env)
    assert voice.returncode == 0, voice.stderr
    answers = [line for line in voice.stdout.splitlines() if line.startswith(("[voice] assistant:", "[voice] device:"))]
    assert len(answers) == 5 and not any("no answer" in a for a in answers), voice.stdout  # every answer parsed
    assert re.search(r"\[voice\] 5 requests, \d+ tokens", voice.stdout)
    vision = run_example("vision_captioner.py", "--scenes", str(data / "scenes.jsonl"), "--max-tokens", "500", env=env)
    assert vision.returncode == 0, vision.stderr
    assert re.search(r"\[vision\] 4 requests", vision.stdout)
    assert vision.stdout.count('"caption": ') == 4  # a whole record per frame, validated by the example
    shared = re.search(r"(\d+) prompt tokens shared instead of computed", vision.stdout)
    assert shared and int(shared.group(1)) > 0  # frames 2-4 took the instructions' KV from frame 1


@pytest.mark.parametrize("name", ["kvpoold", "kvpool-gateway", "kvpool-rpc"])
def test_systemd_unit_verifies_and_is_hardened(tmp_path: Path, name: str) -> None:
    need("systemd-analyze")
    programs = {"kvpoold": "kvpoold", "kvpool-gateway": "kvpool-gateway", "kvpool-rpc": "kvpool-rpc-worker"}
    for other, program_name in programs.items():  # the gateway's unit requires the daemon's
        program = shutil.which(program_name) or str(Path(sys.executable).with_name(program_name))
        text = (ROOT / "systemd" / f"{other}.service").read_text()
        (tmp_path / f"{other}.service").write_text(text.replace(f"/opt/kvpool/bin/{program_name}", program))
    # The drop-in for a daemon split across rpc workers (docs/rpc.md) is verified with the daemon's unit.
    shutil.copytree(ROOT / "systemd" / "kvpoold.service.d", tmp_path / "kvpoold.service.d")
    unit = (ROOT / "systemd" / f"{name}.service").read_text()
    local = tmp_path / f"{name}.service"
    verify = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(local)], capture_output=True, text=True, timeout=60
    )
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(local)], capture_output=True, text=True, timeout=60
    )
    exposure = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", security.stdout).group(1))
    assert exposure <= 2.0, security.stdout  # "OK" or better
    settings = [line.split("=", 1)[0] for line in unit.splitlines() if line and not line.startswith("#")]
    assert "RemoveIPC" not in settings and "DynamicUser" not in settings  # they would delete the pool at stop


def test_sighup_is_refused_in_the_log_and_cuts_nothing(start_daemon: Start) -> None:
    """`kill -HUP` (what a reload sends) ended the daemon at once: the answer in flight lost without a word, no
    checkpoint, and a unit that systemd would not restart. Settings are read at start only: it is said, and ignored."""
    daemon = start_daemon()
    assert "ExecReload" not in [
        line.split("=", 1)[0] for line in (ROOT / "systemd" / "kvpoold.service").read_text().splitlines()
    ]
    with daemon.client() as client, client.open_session() as s:
        stream = s.generate("a long answer", max_tokens=200, temperature=0.0)
        first = next(iter(stream))
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "received SIGHUP: ignored" in daemon.log(), "the SIGHUP's log line", 20.0)
        rest = [chunk for chunk in stream]
        assert stream.final is not None and stream.final.usage.completion_tokens == len(first.tokens) + sum(
            len(c.tokens) for c in rest
        )
        assert s.complete(" and on", max_tokens=2, temperature=0.0).usage.completion_tokens == 2
    assert daemon.proc.poll() is None


def test_memory_high_water_refuses_new_sessions(start_daemon: Start) -> None:
    daemon = start_daemon(config="memory_high_water = '1MiB'\n[tasks.default]\n")  # any daemon is above 1 MiB
    with daemon.client() as client:
        with pytest.raises(Overloaded, match="memory_high_water"):
            client.open_session()
        assert client.status().memory.over_high_water is True


def test_top_redraws_the_live_view(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        s.complete("top", max_tokens=2)
        top = run_until_exit(
            [
                sys.executable,
                "-m",
                "kvpool.client.cli",
                "--address",
                daemon.address,
                "top",
                "--iterations",
                "2",
                "--interval",
                "0.1",
            ]
        )
    assert top.returncode == 0
    assert top.stdout.count("kvpool top - ") == 2 and s.id in top.stdout and "ttft p50/p95/p99" in top.stdout


def test_a_step_log_that_cannot_be_opened_stops_the_start_with_a_sentence(start_daemon: Start, tmp_path: Path) -> None:
    daemon = start_daemon("--step-log", str(tmp_path / "missing" / "steps.jsonl"), wait=False)
    assert daemon.proc is not None and daemon.proc.wait(60) == 2  # (refused with the settings, --check-config too)
    assert "steps.jsonl' cannot be appended to" in daemon.log() and "set another step_log" in daemon.log()
