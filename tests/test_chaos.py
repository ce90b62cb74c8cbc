"""Chaos: clients hold multi-turn conversations while the daemon is SIGKILLed and restarted five times. At the
end every conversation equals an undisturbed run: each turn either completed (and was kept) or failed visibly
and was sent again, and a turn whose answer was lost in the crash is recovered from the session's history."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable

import pytest

from kvpool.client import Client, KvpoolError

from .daemon_process import DaemonProcess

Start = Callable[..., DaemonProcess]
CLIENTS, TURNS, KILLS = 3, 30, 5
MAX_TOKENS = 48
ATTEMPTS = 40
BOS = 1


def prompt_tokens(client: int, turn: int) -> list[int]:
    text = f"client {client} turn {turn}: " + "abcdefgh"[(client + turn) % 8] * (4 + turn)
    return [b + 3 for b in text.encode()]  # the tiny model's byte tokens


INTERRUPTED: list[str] = []  # turns that met a dead daemon, and how they were settled


def converse(
    address: str, client_no: int, log: list[list[int]], stop_on_error: list[BaseException], system: list[int]
) -> None:
    """Run TURNS turns; survive daemon deaths by resuming the session and checking its history."""
    try:
        with Client(address, timeout=20.0, connect_timeout=20.0) as client:
            session = _open(client, system)
            ident = (session.id, session.token)
            context = len(system)
            for turn in range(TURNS):
                prompt = ([BOS] if turn == 0 and not system else []) + prompt_tokens(client_no, turn)
                for _attempt in range(ATTEMPTS):
                    try:
                        # `after`: a resent turn must not apply twice (a copy queued before a crash may be
                        # delivered to the restarted daemon)
                        result = session.complete(prompt, max_tokens=MAX_TOKENS, temperature=0.0, after=context)
                        log.append(result.tokens)
                        context = result.usage.context_tokens
                        break
                    except KvpoolError as exc:
                        # The daemon died mid-turn. Was the turn kept (its final message lost) or not?
                        session = _resume(client, ident)
                        kept = session.history(context)
                        INTERRUPTED.append(f"{'kept' if kept else 'resent'} ({exc.code}) c{client_no} t{turn}")
                        if kept:
                            assert kept[: len(prompt)] == prompt
                            log.append(kept[len(prompt) :])
                            context += len(kept)
                            break
                else:
                    raise AssertionError(f"client {client_no} turn {turn} failed {ATTEMPTS} times")
    except BaseException as exc:  # surfaced by the test thread
        stop_on_error.append(exc)


def _open(client: Client, system: list[int]):
    deadline = time.monotonic() + 60.0
    while True:
        try:
            return client.open_session(system_prompt=system or "")
        except KvpoolError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the daemon is restarting: poll again (a bounded wait)


def _resume(client: Client, ident: tuple[str, str]):
    deadline = time.monotonic() + 60.0
    while True:
        try:
            return client.resume_session(*ident)
        except KvpoolError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the daemon is still restarting: poll again (a bounded wait)


def run_all(
    daemon: DaemonProcess, chaos: Callable[[], None] | None, system: list[int] | None = None
) -> list[list[list[int]]]:
    logs: list[list[list[int]]] = [[] for _ in range(CLIENTS)]
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=converse, args=(daemon.address, i, logs[i], errors, system or []))
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    if chaos is not None:
        chaos()
    for t in threads:
        t.join(300)
        assert not t.is_alive(), "a client hung"
    if errors:
        raise errors[0]
    return logs


# Every client's session starts with this system prompt in the second run: its KV is shared, its sessions
# hibernate only their own cells, and the kills land in the middle of making, saving and restoring prefixes.
SYSTEM = [BOS] + [b + 3 for b in ("You are a careful assistant on a robot that never forgets a turn. " * 3).encode()]


@pytest.mark.parametrize("system", [[], SYSTEM], ids=["no-system-prompt", "shared-system-prompt"])
def test_sigkill_restarts_under_load_lose_nothing_acknowledged(start_daemon: Start, system: list[int]) -> None:
    # Deterministic decoding: the disturbed run's sessions hibernate and restore into other cells than the
    # undisturbed run's, and llama.cpp's CPU kernels would otherwise round those differently (a random tiny model
    # turns that into greedy flips now and then). One hot slot, so the first session makes the shared prefix that
    # the calm run's other two then take.
    args = ("--hot-slots", "1", "--context-size", "8192", "--session-timeout", "600", "--deterministic")
    daemon = start_daemon(*args)
    rng = random.Random(7)
    kills = []

    def chaos() -> None:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.15, 0.5))  # let some turns run (pacing of the chaos, not synchronisation)
            daemon.stop(signal.SIGKILL)
            kills.append(daemon.proc.returncode)
            daemon.start()

    INTERRUPTED.clear()
    disturbed = run_all(daemon, chaos, system)
    assert kills == [-signal.SIGKILL] * KILLS
    assert INTERRUPTED, "no turn met a dead daemon: the chaos missed the clients"
    calm_daemon = start_daemon(*args, name="calm")
    calm = run_all(calm_daemon, None, system)
    if system:
        with daemon.client() as client:  # the restarted daemon shared the recovered prefix too
            assert client.status().prefixes.count >= 1
        with calm_daemon.client() as client:
            assert client.status().prefixes.hits == CLIENTS - 1
    assert [len(log) for log in disturbed] == [TURNS] * CLIENTS
    diffs = [(c, t) for c in range(CLIENTS) for t in range(TURNS) if disturbed[c][t] != calm[c][t]]
    assert not diffs, f"turns differ (client, turn): {diffs[:5]}; interrupted turns: {INTERRUPTED}"
