"""A cut answer is never reported as finished, and a busy client is not a dead one.

The gateway, or a process using the client library, is paused (SIGSTOP) in the middle of an answer: up to the
daemon's client_patience every answer comes whole and equal to the unpaused one; beyond it the caller gets an error,
never a normal finish. kvpoold stopped (SIGTERM) or killed (SIGKILL) mid-answer: an error, never a normal finish.
A request while it is down: 503 with Retry-After, as soon as the gateway's wait for a connection (1.5 s) ends.

Each answer is long (the end token banned) so that it is still running when the pause begins and, when the caller
stops reading, fills the queues between them: the daemon then pauses it (its counter client_pauses says so), which
is what shows the pause fell in the middle of the answer. Paused and unpaused answers are compared on daemons with
`deterministic = true`: without it an answer may depend on which KV cells its session was given
(docs/determinism.md), which has nothing to do with pauses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from kvpool.client import Client
from kvpool.client.aio import AsyncClient
from kvpool.client.errors import DaemonUnavailable, KvpoolError, NotConnected, ShuttingDown

from .daemon_process import DaemonProcess, wait_until
from .gateway_process import WAIT_S, GatewayProcess, client_of

Start = Callable[..., DaemonProcess]
StartGateway = Callable[..., GatewayProcess]
LONG = 2000  # tokens: well over the ~1,000 the queues between daemon and caller hold (a stopped caller pauses it)
NO_END = {"2": -100}  # the tiny model's end token banned: every answer runs to LONG tokens
MESSAGES = [{"role": "user", "content": "Tell me a long story about a robot."}]
SAY = {
    "type": "function",
    "function": {
        "name": "say",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}
KINDS: dict[str, dict[str, Any]] = {
    "plain": {"logit_bias": NO_END},
    "streamed": {"logit_bias": NO_END, "stream": True},
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "story",
                "schema": {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]},
            },
        }
    },
    "tool_call": {"tools": [SAY], "tool_choice": "required"},
}


def ask(gateway: GatewayProcess, kind: str) -> dict[str, Any]:
    """One answer through the real openai client: its text, tool calls and finish reason (streamed ones folded)."""
    c = client_of(gateway)
    extra = KINDS[kind]
    reply = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=LONG, temperature=0.0, **extra)
    if not extra.get("stream"):
        message = reply.choices[0].message
        calls = [(t.function.name, t.function.arguments) for t in message.tool_calls or ()]
        return {"text": message.content, "calls": calls, "finish": reply.choices[0].finish_reason}
    text, finish = [], None
    for chunk in reply:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return {"text": "".join(text), "calls": [], "finish": finish}


class Asked:
    """An answer asked for on a thread, so that the test can pause the gateway meanwhile."""

    def __init__(self, gateway: GatewayProcess, kind: str):
        self.answer: dict[str, Any] | None = None
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, args=(gateway, kind), daemon=True)
        self._thread.start()

    def _run(self, gateway: GatewayProcess, kind: str) -> None:
        try:
            self.answer = ask(gateway, kind)
        except Exception as exc:  # the test asserts on it
            self.error = exc

    def wait(self) -> None:
        self._thread.join(WAIT_S * 2)
        assert not self._thread.is_alive(), "the answer did not come within its bound"


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """A process stopped by SIGSTOP (alive, not scheduled); always continued again."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def generating(watcher: Client, before: int) -> Callable[[], bool]:
    """True once the daemon has generated some tokens beyond ``before``: the answer is under way."""
    return lambda: watcher.status().counters.generated_tokens - before >= 20


def paused_answer(daemon: DaemonProcess, gateway: GatewayProcess, kind: str, seconds: float) -> Asked:
    """Ask, stop the gateway for ``seconds`` once the answer is under way, continue it, and wait for the answer."""
    assert gateway.proc is not None
    with daemon.client() as watcher:
        before = watcher.status()
        asked = Asked(gateway, kind)
        wait_until(generating(watcher, before.counters.generated_tokens), "the answer to start", WAIT_S)
        with stopped(gateway.proc.pid):
            time.sleep(seconds)  # the pause under test, not synchronisation
        asked.wait()
        after = watcher.status()
    # the gateway stopped reading in the middle of the answer: the daemon paused it for its reader
    assert after.counters.client_pauses > before.counters.client_pauses
    return asked


@pytest.mark.parametrize("kind", KINDS)
def test_a_gateway_paused_within_the_patience_loses_nothing(
    start_daemon: Start, start_gateway: StartGateway, kind: str
) -> None:
    # patience: 10 s; deterministic, so an answer does not depend on which cells its session got
    daemon = start_daemon("--context-size", "4096", "--hot-slots", "2", "--threads", "2", "--deterministic")
    gateway = start_gateway(daemon.address)
    unpaused = ask(gateway, kind)
    assert unpaused["finish"] in ("length", "stop", "tool_calls")
    for seconds in (2.0, 5.0):
        asked = paused_answer(daemon, gateway, kind, seconds)
        assert asked.error is None, f"paused {seconds} s: {asked.error!r}"
        assert asked.answer == unpaused, f"paused {seconds} s: the answer differs from the unpaused one"
    with daemon.client() as watcher:
        counters = watcher.status().counters
    assert counters.clients_lost == 0 and counters.clients_not_reading == 0 and not counters.errors


@pytest.mark.parametrize("kind", KINDS)
def test_a_gateway_paused_beyond_the_patience_gets_an_error_never_a_finish(
    start_daemon: Start, start_gateway: StartGateway, kind: str
) -> None:
    daemon = start_daemon("--context-size", "4096", "--hot-slots", "2", "--threads", "2", "--client-patience", "2")
    gateway = start_gateway(daemon.address, "--resume-wait", "0")  # a cut is not continued
    asked = paused_answer(daemon, gateway, kind, 4.0)
    assert asked.answer is None, f"a cut answer was reported as finished: {asked.answer}"
    if KINDS[kind].get("stream"):  # cut after the 200 went out: an error event, which the client raises
        assert isinstance(asked.error, openai.APIError) and "client_patience" in str(asked.error)
    else:
        assert isinstance(asked.error, openai.InternalServerError) and asked.error.status_code == 503
        assert asked.error.response.headers.get("retry-after") == "1"
        assert asked.error.body["code"] == "client_unresponsive"
    with daemon.client() as watcher:
        counters = watcher.status().counters
    assert counters.clients_lost == 1 and counters.errors == {"CLIENT_UNRESPONSIVE": 1}
    assert "CLIENT_UNRESPONSIVE" not in str(counters.finished)
    assert ask(gateway, "plain")["finish"] == "length"  # and the gateway serves on


@pytest.mark.parametrize("kind", KINDS)
def test_an_answer_cut_beyond_the_patience_is_continued_whole(
    start_daemon: Start, start_gateway: StartGateway, kind: str
) -> None:
    """The gateway takes the session back after the cut and generates the rest (a grammar replayed over the answer
    so far): the caller sees a delay, and the answer is the unpaused one."""
    daemon = start_daemon(
        *("--context-size", "4096", "--hot-slots", "2", "--threads", "2", "--client-patience", "2", "--deterministic")
    )
    gateway = start_gateway(daemon.address)
    unpaused = ask(gateway, kind)
    asked = paused_answer(daemon, gateway, kind, 4.0)
    assert asked.error is None, repr(asked.error)
    assert asked.answer == unpaused
    with daemon.client() as watcher:
        counters = watcher.status().counters
    assert counters.clients_lost == 1 and counters.errors == {"CLIENT_UNRESPONSIVE": 1}  # it was cut, then continued
    assert metric_of(gateway, 'kvpool_gateway_continued_total{code="CLIENT_UNRESPONSIVE"}') == 1


def metric_of(gateway: GatewayProcess, series: str) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=WAIT_S).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")]
    assert len(values) == 1, f"{series} is not in /metrics"
    return values[0]


def raw_stream(gateway: GatewayProcess) -> tuple[int, list[str]]:
    """A streamed chat answer read as the raw server-sent events: its status and every `data:` line."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": LONG, "logit_bias": NO_END, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=WAIT_S) as reply:
        return reply.status_code, [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_daemon_stopped_mid_answer_is_an_error_never_a_finish(
    start_daemon: Start, start_gateway: StartGateway, sig: int
) -> None:
    daemon = start_daemon("--context-size", "4096", "--hot-slots", "2", "--threads", "2")
    gateway = start_gateway(daemon.address, "--resume-wait", "0")  # a cut is not continued
    assert daemon.proc is not None
    # streamed: the daemon goes when the first events are out; the stream ends with an error event, no [DONE]
    with daemon.client() as watcher:
        before = watcher.status().counters.generated_tokens
        events: list[str] = []

        def read() -> None:
            events.extend(raw_stream(gateway)[1])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_until(generating(watcher, before), "the answer to start", WAIT_S)
    daemon.proc.send_signal(sig)
    reader.join(WAIT_S)
    assert not reader.is_alive() and events
    assert events[-1] != "[DONE]" and "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["code"] in ("shutting_down", "daemon_unavailable")
    # (what an HTTP client can do: it holds no session to resume, which the client library's sentence said)
    assert "send the request again once it is back" in last["error"]["message"]
    assert "Session" not in last["error"]["message"]
    finishes = [c.get("finish_reason") for e in events[:-1] for c in json.loads(e).get("choices", [])]
    assert not any(finishes), "a cut stream announced a finish"
    daemon.stop()
    # whole: the daemon comes back and goes again mid-answer; the answer is a 503, never a 200
    daemon.cleanup()
    daemon.start()
    with daemon.client() as watcher:
        before = watcher.status().counters.generated_tokens
        asked = Asked(gateway, "plain")
        wait_until(generating(watcher, before), "the answer to start", WAIT_S)
    daemon.proc.send_signal(sig)
    asked.wait()
    assert asked.answer is None and isinstance(asked.error, openai.InternalServerError)
    assert asked.error.status_code == 503 and asked.error.response.headers.get("retry-after") == "1"


def test_a_request_while_the_daemon_is_down_is_a_prompt_503(start_daemon: Start, start_gateway: StartGateway) -> None:
    daemon = start_daemon("--threads", "2")
    gateway = start_gateway(daemon.address)
    assert ask(gateway, "plain")["finish"] == "length"  # connected, then the daemon goes
    daemon.stop(signal.SIGKILL)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    # A bound well under the 12.8 s the client library's resends used to take: the gateway waits 1.5 s for a
    # connection, then answers.
    for stream in (False, True):
        reply = httpx.post(gateway.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=5.0)
        assert reply.status_code == 503 and reply.headers.get("retry-after") == "1"
        assert reply.json()["error"]["code"] == "daemon_unavailable"
    health = httpx.get(gateway.url + "/health", timeout=5.0)
    assert health.status_code == 503 and health.headers.get("retry-after") == "1"
    daemon.cleanup()
    daemon.start()
    wait_until(lambda: httpx.get(gateway.url + "/health", timeout=5.0).status_code == 200, "the gateway to recover")
    assert ask(gateway, "plain")["finish"] == "length"


@pytest.mark.parametrize("kind", ["plain", "streamed"])
def test_an_answer_cut_by_a_daemon_restart_is_continued_whole(
    start_daemon: Start, start_gateway: StartGateway, kind: str
) -> None:
    """SIGTERM mid-answer checkpoints the session with the answer so far; the daemon comes back (as systemd
    restarts it) and the gateway continues the answer: a delay for the caller, and the unpaused answer."""
    daemon = start_daemon("--context-size", "4096", "--hot-slots", "2", "--threads", "2", "--deterministic")
    gateway = start_gateway(daemon.address)
    unpaused = ask(gateway, kind)
    with daemon.client() as watcher:
        before = watcher.status().counters.generated_tokens
        asked = Asked(gateway, kind)
        wait_until(generating(watcher, before), "the answer to start", WAIT_S)
    assert daemon.stop() == 0  # SIGTERM: the answer is cut, its session checkpointed into the pool
    daemon.start()  # the same pool: the session is there
    asked.wait()
    assert asked.error is None, repr(asked.error)
    assert asked.answer == unpaused
    assert metric_of(gateway, 'kvpool_gateway_continued_total{code="SHUTTING_DOWN"}') == 1


# ---------------------------------------------------------------------- a process using the client library

LIBRARY_CLIENT = """
import json, sys
from kvpool.client import Client, KvpoolError
with Client(sys.argv[1], timeout=60) as client:
    session = client.open_session()  # left open: the test reads what it kept
    tokens = []
    try:
        for chunk in session.generate("Tell me a long story", max_tokens=int(sys.argv[2]), temperature=0.0,
                                      logit_bias={2: -100}):
            tokens += chunk.tokens
            if len(tokens) == 1:
                print("streaming", flush=True)
                sys.stdin.readline()  # the test pauses this process after it reads this line's answer
        print(json.dumps({"tokens": tokens, "finish": session.final.finish_reason}), flush=True)
    except KvpoolError as exc:
        print(json.dumps({"tokens": tokens, "error": exc.code, "cut": exc.cut, "detail": exc.detail}), flush=True)
"""


def library_answer(daemon: DaemonProcess, pause: float) -> dict[str, Any]:
    """A generation streamed by a process using the client library, stopped for ``pause`` seconds after its first
    chunk (0: not stopped)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LIBRARY_CLIENT, daemon.address, str(LONG)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "streaming"
        proc.stdin.write("\n")
        proc.stdin.flush()
        if pause:
            with stopped(proc.pid):
                time.sleep(pause)  # the pause under test, not synchronisation
        out, _ = proc.communicate(timeout=WAIT_S)
        return json.loads(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)


def test_a_client_process_paused_within_the_patience_loses_nothing(start_daemon: Start) -> None:
    daemon = start_daemon("--context-size", "4096", "--threads", "2", "--deterministic")
    unpaused = library_answer(daemon, 0)
    assert unpaused["finish"] == "length" and len(unpaused["tokens"]) == LONG
    with daemon.client() as watcher:
        pauses = watcher.status().counters.client_pauses
        for seconds in (2.0, 5.0):
            assert library_answer(daemon, seconds) == unpaused, f"paused {seconds} s"
        counters = watcher.status().counters
    assert counters.client_pauses >= pauses + 2 and counters.clients_lost == 0 and not counters.errors


def test_a_client_process_paused_beyond_the_patience_gets_a_cut_error(start_daemon: Start) -> None:
    daemon = start_daemon("--context-size", "4096", "--threads", "2", "--client-patience", "2")
    answer = library_answer(daemon, 4.0)
    assert answer.get("error") == "CLIENT_UNRESPONSIVE" and answer["cut"] and "finish" not in answer
    # what it received is what the session kept of the answer, and the detail says so
    assert answer["detail"]["completion_tokens"] == len(answer["tokens"]) < LONG
    with daemon.client() as watcher:
        (listed,) = watcher.sessions()
    assert listed.context_tokens == answer["detail"]["context_tokens"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_session_left_on_a_cut_raises_the_cut_not_its_close(start_daemon: Start, sig: int) -> None:
    """The documented idiom, ``with client.open_session() as s``, left on the error a stopped (or killed) daemon
    gave: the caller gets that error (stopped: a cut, with what the session kept), not the close's on the way
    out, which found no daemon and waited for one."""
    daemon = start_daemon("--context-size", "4096", "--threads", "2")
    assert daemon.proc is not None
    tokens, signalled = 0, False
    with pytest.raises(KvpoolError) as raised, Client(daemon.address) as client, client.open_session() as session:
        for chunk in session.generate("Tell me a long story.", max_tokens=LONG, logit_bias={2: -100.0}):
            tokens += len(chunk.tokens)
            if tokens >= 8 and not signalled:
                daemon.proc.send_signal(sig)
                signalled = True
    error = raised.value
    assert not isinstance(error, NotConnected), error  # (the close's: "the request was not sent")
    if sig == signal.SIGTERM:
        assert isinstance(error, ShuttingDown) and error.cut, error
        assert error.detail["completion_tokens"] >= tokens
    else:
        assert type(error) is DaemonUnavailable, error


def test_an_asyncio_session_left_on_a_cut_raises_the_cut_not_its_close(start_daemon: Start) -> None:
    """The same with the asyncio client's ``async with await client.open_session() as s``, the daemon stopped."""
    daemon = start_daemon("--context-size", "4096", "--threads", "2")
    assert daemon.proc is not None

    async def answer() -> None:
        tokens, signalled = 0, False
        client = await AsyncClient.connect(daemon.address)
        try:
            async with await client.open_session() as session:
                async for chunk in session.generate("Tell me a long story.", max_tokens=LONG, logit_bias={2: -100.0}):
                    tokens += len(chunk.tokens)
                    if tokens >= 8 and not signalled and daemon.proc is not None:
                        daemon.proc.send_signal(signal.SIGTERM)
                        signalled = True
        finally:
            await client.close()

    with pytest.raises(KvpoolError) as raised:
        asyncio.run(answer())
    error = raised.value
    assert isinstance(error, ShuttingDown) and error.cut and not isinstance(error, NotConnected), error
