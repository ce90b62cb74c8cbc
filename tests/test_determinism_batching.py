"""Deterministic decoding on the suite's tiny model (F32 weights: llama.cpp multiplies a lone row by `vec_dot` and
two or more by llamafile's sgemm, which sum in different orders): sessions at once, chunked differently, give each
one's tokens and log-probabilities bit for bit; the default mode, on the same workload, does not."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .daemon_process import DaemonProcess

Start = Callable[..., DaemonProcess]
WAIT_S = 120.0
PROMPTS = ["hello", "a longer prompt that takes more than one chunk of the step " * 2, "x", "the quick brown fox"]


def conversation(daemon: DaemonProcess, i: int, started: threading.Event | None = None) -> list[object]:
    out: list[object] = []
    with daemon.client(timeout=WAIT_S) as client, client.open_session() as s:
        for prompt in (PROMPTS[i], " and then"):
            for chunk in s.generate(prompt, max_tokens=24, temperature=0.0, logprobs=3):
                out += [(e.token, e.logprob, tuple((t.token, t.logprob) for t in e.top)) for e in chunk.logprobs or ()]
                if started is not None and len(out) >= 2:
                    started.set()
    return out


def together(daemon: DaemonProcess) -> list[list[object]]:
    results: list[list[object]] = [[] for _ in PROMPTS]
    started = [threading.Event() for _ in PROMPTS]
    threads = []
    for i in range(len(PROMPTS)):
        threads.append(threading.Thread(target=lambda i=i: results.__setitem__(i, conversation(daemon, i, started[i]))))
        threads[-1].start()
        assert started[i].wait(WAIT_S)
    for t in threads:
        t.join(WAIT_S)
    return results


def test_deterministic_sessions_at_once_equal_each_alone(start_daemon: Start) -> None:
    daemon = start_daemon("--deterministic", "--hot-slots", "4", "--context-size", "2048", "--threads", "2")
    alone = [conversation(daemon, i) for i in range(len(PROMPTS))]
    for _ in range(2):
        assert together(daemon) == alone


def test_the_default_mode_differs_on_the_same_workload(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "4", "--context-size", "2048", "--threads", "2")
    alone = [conversation(daemon, i) for i in range(len(PROMPTS))]
    assert any(together(daemon) != alone for _ in range(2))


def test_one_token_steps_compact_in_time_for_their_pad_row(start_daemon: Start) -> None:
    """Closed sessions leave their cells in the graveyard until a compaction; one-token steps at the end of the
    KV must compact in time for the pad row too, or the decode finds no room and the answer is cut short."""
    daemon = start_daemon("--deterministic", "--hot-slots", "1", "--context-size", "256", "--threads", "2")
    with daemon.client(timeout=WAIT_S) as client:
        for i in range(12):  # 12 x ~70 cells through a 256-cell KV: the end is crossed by one-token steps
            with client.open_session() as s:
                done = s.complete(f"session {i}", max_tokens=60, temperature=0.0, logit_bias={2: -100.0})
                assert (done.finish_reason, done.usage.completion_tokens) == ("length", 60), i
        assert client.status().moves.compactions > 0


def test_deterministic_sessions_with_guesses_equal_each_alone_without(start_daemon: Start) -> None:
    """Guessed rows (draft_tokens) ride in the same steps as the other sessions' and are verified row by row: each
    session's tokens and log-probabilities stay bit for bit those it gives alone, without guesses."""
    common = ("--deterministic", "--hot-slots", "4", "--context-size", "2048", "--threads", "2")
    plain = start_daemon(*common, "--draft-tokens", "0", name="plain")
    alone = [conversation(plain, i) for i in range(len(PROMPTS))]
    # (at least 2 guessed tokens wherever a guess has them, paying or not: some are refused, whatever the step times)
    guessing = start_daemon(*common, "--draft-tokens", "6", "--draft-min-tokens", "2", name="guessing")
    assert [conversation(guessing, i) for i in range(len(PROMPTS))] == alone
    assert together(guessing) == alone
    with guessing.client() as client:
        counters = client.status().counters
    assert counters.accepted_tokens > 0 and counters.drafted_tokens > counters.accepted_tokens
