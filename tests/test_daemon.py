"""The daemon's lifecycle and the session operations, against a real kvpoold on the tiny model."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool import protocol as p
from kvpool.client import Client, DaemonUnavailable
from kvpool.client.errors import ContextOverflow, QuotaExceeded, UnknownSession

from .daemon_process import DaemonProcess, kvpoold_command, run_until_exit
from .raw import RawConnection

Start = Callable[..., DaemonProcess]


def byte_tokens(text: str) -> list[int]:
    """The tiny model's token ids for raw bytes (ids 0-2 are <unk> <s> </s>)."""
    return [b + 3 for b in text.encode()]


def test_multi_turn_session_keeps_its_context(daemon: DaemonProcess) -> None:
    turn1, turn2 = [1, *byte_tokens("Hello")], byte_tokens(" and then")
    with daemon.client() as client, client.open_session() as s:
        first = s.complete(turn1, max_tokens=8, temperature=0.0)
        second = s.complete(turn2, max_tokens=8, temperature=0.0)
        assert second.usage.context_tokens == len(turn1) + 8 + len(turn2) + 8
        # The whole conversation sent at once to a fresh session continues the same way: the session
        # carried the first turn (its prompt and its generated tokens) into the second.
        with client.open_session() as fresh:
            replay = fresh.complete(turn1 + first.tokens + turn2, max_tokens=8, temperature=0.0)
        assert replay.tokens == second.tokens
        status = client.status()
        assert status.sessions.open == 1 and status.slots.used == 1


def test_cancel_stops_within_one_step(daemon: DaemonProcess) -> None:
    raw = RawConnection(daemon.address)
    try:
        opened = raw.open()
        raw.send(
            p.Generate(
                id=2, session=opened.session, token=opened.token, prompt="go on", max_tokens=1900, temperature=0.0
            )
        )
        first = raw.recv()
        assert isinstance(first, p.Chunk)
        cancelled = raw.call(p.Cancel(id=3, session=opened.session, token=opened.token))
        assert isinstance(cancelled, p.Cancelled) and cancelled.cancelled
        chunks, final = raw.until_final(2)
        assert final.finish_reason == p.FinishReason.CANCELLED
        # No step ran for it after the engine took the cancel: the final count is the count at the cancel.
        assert final.usage.completion_tokens == cancelled.completion_tokens < 1900
        assert 1 + sum(len(c.tokens) for c in chunks) == final.usage.completion_tokens
        again = raw.call(p.Cancel(id=4, session=opened.session, token=opened.token))
        assert isinstance(again, p.Cancelled) and not again.cancelled
    finally:
        raw.close()


def test_cancel_from_another_thread_with_the_client_library(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        stream = s.generate("count", max_tokens=1900, temperature=0.0)
        cancelled: list[bool] = []
        received = 0
        for chunk in stream:
            received += len(chunk.tokens)
            if received == 3:
                worker = threading.Thread(target=lambda: cancelled.append(s.cancel()))
                worker.start()
                worker.join(30)
        assert cancelled == [True]
        assert stream.final is not None and stream.final.finish_reason == "cancelled"
        assert stream.final.usage.completion_tokens < 1900
        # the session is free again
        assert s.complete("more", max_tokens=2, temperature=0.0).usage.completion_tokens == 2


def test_closing_a_session_frees_it_everywhere(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "2", "--context-size", "512")
    with daemon.client() as client:
        a, b, c = client.open_session(), client.open_session(), client.open_session()
        for s in (a, b, c):  # three sessions on two slots: one of them is hibernated to the pool
            assert s.complete("hi", max_tokens=2, temperature=0.0).usage.completion_tokens == 2
        status = client.status()
        assert (status.slots.total, status.slots.used) == (2, 2)
        assert status.sessions_by_tier == {"hot": 2, "pool": 1}
        a.close()
        b.close()
        assert client.status().slots.used <= 1
        with pytest.raises(UnknownSession):
            a.complete("gone", max_tokens=1)
        c.close()
        status = client.status()
        assert client.sessions() == [] and status.pool.used_bytes == 0 and status.slots.used == 0


def test_session_limits_from_task_profiles(start_daemon: Start) -> None:
    config = """
max_sessions = 3
[tasks.default]
[tasks.voice]
max_sessions = 1
max_context_tokens = 40
"""
    daemon = start_daemon(config=config)
    with daemon.client() as client:
        voice = client.open_session("voice")
        with pytest.raises(QuotaExceeded, match="voice"):
            client.open_session("voice")
        # A full context ends the generation with `length`, never a crash.
        result = voice.complete("abc", max_tokens=500, temperature=0.0)
        assert result.finish_reason == "length" and result.usage.context_tokens == 40
        with pytest.raises(ContextOverflow):
            voice.complete("more", max_tokens=5)
        client.open_session()
        client.open_session()
        with pytest.raises(QuotaExceeded, match="max_sessions=3"):
            client.open_session()


def test_stop_strings_end_the_text_before_them(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        with client.open_session() as s:
            plain = s.complete("Stop here", max_tokens=24, temperature=0.0)
        stop = plain.text[6:9]
        assert len(stop) == 3
        with client.open_session() as s:
            stopped = s.complete("Stop here", max_tokens=24, temperature=0.0, stop=[stop])
        assert stopped.finish_reason == "stop"
        assert stopped.text == plain.text[: plain.text.index(stop)]
        assert stopped.tokens == plain.tokens[: len(stopped.tokens)]


def test_sigterm_cuts_generations_with_an_error_that_says_what_was_kept(start_daemon: Start) -> None:
    daemon = start_daemon("--context-size", "4096")
    raw = RawConnection(daemon.address)
    try:
        opened = raw.open()
        raw.send(
            p.Generate(id=2, session=opened.session, token=opened.token, prompt="x", max_tokens=4000, temperature=0.0)
        )
        assert isinstance(raw.recv(), p.Chunk)
        daemon.proc.send_signal(signal.SIGTERM)
        chunks, ended = raw.until_end(2)
        # never a normal finish: an error whose detail says what the session keeps
        assert isinstance(ended, p.Error) and ended.code == p.ErrorCode.SHUTTING_DOWN
        assert p.is_cut(ended.detail) and ended.detail["completion_tokens"] == 1 + sum(len(c.tokens) for c in chunks)
        assert daemon.stop() == 0
        assert not Path(daemon.address.removeprefix("ipc://")).exists(), "the socket file should be removed"
    finally:
        raw.close()


def test_second_daemon_on_the_same_address_is_refused(start_daemon: Start, tiny_model: Path) -> None:
    first = start_daemon()
    second = run_until_exit(kvpoold_command(tiny_model, first.address))
    assert second.returncode == 1
    assert "already serving" in second.stderr and str(first.proc.pid) in second.stderr
    with first.client() as client:
        assert client.status().pid == first.proc.pid


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--model", "/tmp"], "is a directory; pass the GGUF file itself"),  # (it said "does not exist")
        (["--log-file", "/nonexistent/dir/k.log"], "log_file = '/nonexistent/dir/k.log' cannot be opened"),
        (["--step-log", "/nonexistent/dir/steps.jsonl", "--check-config"], "step_log = '/nonexistent/dir/steps"),
        (["--hot-slots", "0"], "hot_slots"),
        (["--address", "tcp://127.0.0.1:5555"], "ipc://"),
    ],
)
def test_bad_start_up_settings_give_one_clear_error(
    short_tmp: Path, tiny_model: Path, args: list[str], message: str
) -> None:
    done = run_until_exit(kvpoold_command(tiny_model, f"ipc://{short_tmp}/k.sock", *args))
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_damaged_model_file_is_refused(short_tmp: Path, tiny_model: Path) -> None:
    def start(model: Path) -> subprocess.CompletedProcess[str]:
        return run_until_exit(kvpoold_command(model, f"ipc://{short_tmp}/k.sock"))

    garbage = short_tmp / "bad.gguf"
    garbage.write_bytes(b"GGUF" + b"\0" * 64)  # its header is already wrong: the memory plan cannot read it
    done = start(garbage)
    assert done.returncode == 2 and "bad.gguf is GGUF version 0" in done.stderr
    short = short_tmp / "short.gguf"
    short.write_bytes(tiny_model.read_bytes()[:200])  # cut inside its metadata: the file is named
    done = start(short)
    assert done.returncode == 2 and "short.gguf: the file ends inside its metadata" in done.stderr
    cut = short_tmp / "cut.gguf"
    cut.write_bytes(tiny_model.read_bytes()[:50_000])  # metadata intact, tensors cut off: llama.cpp refuses it
    done = start(cut)
    assert done.returncode == 1 and "could not load" in done.stderr and "Traceback" not in done.stderr


def test_daemon_down_gives_a_clear_error(short_tmp: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="kvpoold"):
        Client(f"ipc://{short_tmp}/nobody.sock", connect_timeout=1.0)
    # A stale socket file with no daemon behind it: the hello times out instead of hanging.
    (short_tmp / "stale.sock").touch()
    with pytest.raises(DaemonUnavailable, match="within"):
        Client(f"ipc://{short_tmp}/stale.sock", connect_timeout=0.5)
