"""The `kvpool` command line and the asyncio client, against a real daemon."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.client.aio import AsyncClient
from kvpool.client.errors import BadRequest

from .daemon_process import DaemonProcess

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

        table = kvpool("status", address=daemon.address)
        assert table.returncode == 0 and "slots" in table.stdout and "1/4 used" in table.stdout

        sessions = kvpool("sessions", "--json", address=daemon.address)
        listed = json.loads(sessions.stdout)
        assert [entry["session"] for entry in listed] == [s.id]
        assert listed[0]["tier"] == "hot" and listed[0]["context_tokens"] > 12


def test_cli_exit_codes(daemon: DaemonProcess, short_tmp: Path) -> None:
    down = kvpool("status", address=f"ipc://{short_tmp}/none.sock")
    assert down.returncode == 3 and "No kvpoold" in down.stderr
    refused = kvpool("generate", "x", "--task", "nosuchtask", address=daemon.address)
    assert refused.returncode == 1 and "UNKNOWN_TASK" in refused.stderr


def test_asyncio_client_runs_sessions_concurrently(daemon: DaemonProcess) -> None:
    prompts = ["first async prompt", "second async prompt", "third one"]
    with daemon.client() as client:
        expected = []
        for prompt in prompts:
            with client.open_session() as s:
                expected.append(s.complete(prompt, max_tokens=16, temperature=0.0).tokens)

    async def one(client: AsyncClient, prompt: str) -> list[int]:
        async with await client.open_session() as s:
            tokens: list[int] = []
            async for chunk in s.generate(prompt, max_tokens=16, temperature=0.0):
                tokens.extend(chunk.tokens)
            assert s.final is not None and s.final.finish_reason == "length"
            return tokens

    async def too_large(client: AsyncClient) -> None:  # refused before sending, as in the sync client
        async with await client.open_session() as s:
            with pytest.raises(BadRequest, match="max_message_bytes"):
                async for _ in s.generate("\U0001f600" * (1 << 20), max_tokens=2):
                    pass

    async def main() -> list[list[int]]:
        async with await AsyncClient.connect(daemon.address) as client:
            assert "llama" in client.model
            await too_large(client)
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    assert asyncio.run(asyncio.wait_for(main(), 60)) == expected
