"""The `kvpool` command line, against a real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import protocol as p
from kvpool.client.errors import BadRequest

from .daemon_process import DaemonProcess
from .raw import RawConnection

CLI_TIMEOUT_S = 60


def kvpool(*args: str, address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.client.cli", "--address", address, *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def test_cli_generate_status_sessions(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        expected = s.complete("Hi there", max_tokens=12, temperature=0.0).text
        out = kvpool(
            "generate", "Hi there", "--max-tokens", "12", "--temperature", "0", "--stats", address=daemon.address
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected + "\n"
        assert "finish=length" in out.stderr and "completion=12" in out.stderr

        status = kvpool("status", "--json", address=daemon.address)
        assert status.returncode == 0
        data = json.loads(status.stdout)
        assert data["counters"]["generated_tokens"] >= 24 and data["slots"]["total"] == 4

        # Refusals counted by the engine and by the I/O thread (a frame it could not read) add up in the table
        # (the second count replaced the first).
        for _ in range(2):
            with pytest.raises(BadRequest):
                client.detokenize([10**9])
        raw = RawConnection(daemon.address)
        try:
            raw.send_frames(b"\xc1 not msgpack")
            assert isinstance(raw.recv(), p.Error)
        finally:
            raw.close()
        counters = client.status().counters
        assert counters.errors["BAD_REQUEST"] >= 2 and counters.frame_errors["BAD_REQUEST"] >= 1
        both = counters.errors["BAD_REQUEST"] + counters.frame_errors["BAD_REQUEST"]

        table = kvpool("status", address=daemon.address)
        assert table.returncode == 0 and "slots" in table.stdout and "1/4 used" in table.stdout
        assert f"BAD_REQUEST {both}" in table.stdout

        sessions = kvpool("sessions", "--json", address=daemon.address)
        listed = json.loads(sessions.stdout)
        assert [entry["session"] for entry in listed] == [s.id]
        assert listed[0]["tier"] == "hot" and listed[0]["context_tokens"] > 12


def test_cli_exit_codes(daemon: DaemonProcess, short_tmp: Path) -> None:
    down = kvpool("status", address=f"ipc://{short_tmp}/none.sock")
    assert down.returncode == 3 and "No kvpoold" in down.stderr
    refused = kvpool("generate", "x", "--task", "nosuchtask", address=daemon.address)
    assert refused.returncode == 1 and "UNKNOWN_TASK" in refused.stderr


def test_cli_usage_errors_exit_2_with_a_sentence(daemon: DaemonProcess) -> None:
    """Bad usage is exit 2 and a line that says what to give, never a traceback, exit 1 ("the daemon refused"),
    exit 3 ("no daemon") or a wait without end (a NaN timeout)."""
    for args, says in (
        (("--timeout", "nan", "status"), "--timeout"),
        (("--timeout", "0", "status"), "--timeout"),
        (("top", "--interval", "-1"), "--interval"),
        (("top", "--iterations", "-1"), "--iterations"),
        (("health", "--max-engine-silence", "-1"), "--max-engine-silence"),
        (("generate", "x", "--max-tokens", "-5"), "--max-tokens"),
        (("generate", "x", "--temperature", "nan"), "--temperature"),
        (("generate", "x", "--stop", ""), "--stop"),
        (("generate", "x", "--logprobs", "50"), "at most 20"),
        (("generate", "x", "--top-p", "1.5"), "--top-p"),
        (("chat", "--chat-template", "nosuch"), "nosuch"),
        (("chat", "--resume", "nocolon"), "ID:TOKEN"),
        (("migrate", "nocolon", "--to", "ipc:///nowhere"), "ID:TOKEN"),
    ):
        run = kvpool(*args, address=daemon.address)
        assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, (args, run.stderr)
    wrong = subprocess.run(
        [sys.executable, "-m", "kvpool.client.cli", "--address", "foo", "status"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert wrong.returncode == 2 and "ipc://" in wrong.stderr and "Traceback" not in wrong.stderr, wrong.stderr
