"""The gateway under load and with many choices: its own fair queue answers every request a 4-slot daemon can
serve in turn (only a full queue is a 429, and always as an HTTP status), a client that goes away is cancelled
whether it streams or not, and n choices cost one prefill through the daemon's shared prefixes."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from .daemon_process import DaemonProcess, wait_until
from .gateway_process import WAIT_S, GatewayProcess, client_of, metric

Start = Callable[..., DaemonProcess]
NO_END = {"2": -100}  # the end-of-sequence token banned: a hot sampler's answers run their full length
PROMPT = "Describe the kitchen, the hall and the garden of this house in a few words each, please. " * 2


# ---------------------------------------------------------------------- n choices


def test_n_choices_compute_the_prompt_once(daemon: DaemonProcess, served: GatewayProcess) -> None:
    c = client_of(served)
    with daemon.client() as watcher:
        before = watcher.status()
        reply = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            n=3,
            temperature=1.5,
            seed=11,
            max_tokens=8,
            logit_bias=NO_END,
        )
        after = watcher.status()
        assert [choice.index for choice in reply.choices] == [0, 1, 2]
        assert len({choice.message.content for choice in reply.choices}) > 1
        prompt = reply.usage.prompt_tokens
        assert prompt > 100 and reply.usage.completion_tokens == 24
        # One prompt computed, plus each other choice's last token (its logits): not three prompts.
        assert after.counters.prompt_tokens - before.counters.prompt_tokens == prompt + 2
        assert after.prefixes.hits - before.prefixes.hits == 2
        assert after.prefixes.tokens_saved - before.prefixes.tokens_saved == 2 * (prompt - 1)
        assert watcher.sessions() == []  # the choices' sessions were closed with the request


def test_n_streamed_choices_carry_their_index(daemon: DaemonProcess, served: GatewayProcess) -> None:
    c = client_of(served)
    messages = [{"role": "user", "content": PROMPT}]
    whole = c.chat.completions.create(model="tiny", messages=messages, n=3, temperature=1.5, seed=5, max_tokens=8)
    state = ChatCompletionStreamState()
    seen = set()
    for chunk in c.chat.completions.create(
        model="tiny", messages=messages, n=3, temperature=1.5, seed=5, max_tokens=8, stream=True
    ):
        state.handle_chunk(chunk)
        seen.update(choice.index for choice in chunk.choices)
    streamed = state.current_completion_snapshot  # (get_final_completion refuses answers cut by max_tokens)
    assert seen == {0, 1, 2}
    assert [(ch.message.content, ch.finish_reason) for ch in streamed.choices] == [
        (ch.message.content, ch.finish_reason) for ch in whole.choices
    ]
    completions = c.completions.create(
        model="tiny", prompt=PROMPT, n=2, temperature=1.5, seed=5, max_tokens=8, logit_bias=NO_END
    )
    assert [ch.index for ch in completions.choices] == [0, 1] and completions.usage.completion_tokens == 16


def test_n_choices_without_prefix_sharing_still_work(
    start_daemon: Start, start_gateway: Callable[..., GatewayProcess]
) -> None:
    daemon = start_daemon(config="prefix_slots = 0\n")
    gateway = start_gateway(daemon.address)
    with daemon.client() as watcher:
        before = watcher.status().counters.prompt_tokens
        reply = client_of(gateway).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], n=3, temperature=1.5, seed=2, max_tokens=4
        )
        assert len(reply.choices) == 3
        computed = watcher.status().counters.prompt_tokens - before
        assert computed == 3 * reply.usage.prompt_tokens  # each choice paid its prefill


# ---------------------------------------------------------------------- the queue


def test_64_concurrent_requests_on_4_slots_are_all_answered(
    start_daemon: Start, start_gateway: Callable[..., GatewayProcess]
) -> None:
    daemon = start_daemon("--hot-slots", "4", "--threads", "2")
    gateway = start_gateway(daemon.address)

    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        messages = [{"role": "user", "content": f"request {i}: what now?"}]
        if i % 2:
            stream = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
            )
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            assert usage is not None
            return usage.completion_tokens
        reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        return reply.usage.completion_tokens

    async def all_of_them() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=120.0)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)), return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert results == [8] * 64, [r for r in results if r != 8][:3]
    assert metric(gateway, "kvpool_gateway_queued_total") > 0  # the gateway's queue took what was beyond its limit
    assert metric(gateway, "kvpool_gateway_queue_refused_total") == 0
    with daemon.client() as watcher:
        assert "OVERLOADED" not in watcher.status().counters.errors
    status = httpx.get(gateway.url + "/status", timeout=WAIT_S).json()["queue"]
    assert status["depth"] == 0 and status["in_flight"] == 0 and status["queued"] > 0


def test_a_full_queue_refuses_a_streamed_request_with_a_429_status(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    gateway = start_gateway(daemon.address, "--queue-size", "2", "--max-inflight", "1")
    c = client_of(gateway)
    blocker = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go on"}], max_tokens=1800, stream=True
    )
    next(iter(blocker))  # admitted: the one generation in flight
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = [
                pool.submit(
                    c.chat.completions.create,
                    model="tiny",
                    max_tokens=4,
                    messages=[{"role": "user", "content": f"wait {i}"}],
                )
                for i in range(2)
            ]
            wait_until(lambda: metric(gateway, "kvpool_gateway_queue_depth") == 2, "two requests to wait", WAIT_S)
            body = {"model": "tiny", "messages": [{"role": "user", "content": "one too many"}], "stream": True}
            with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=WAIT_S) as refused:
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                assert refused.headers["content-type"].startswith("application/json")
                error = json.loads(refused.read())["error"]
                assert error["code"] == "queue_full" and "queue is full" in error["message"]
            blocker.close()
            assert all(w.result(WAIT_S).usage.completion_tokens == 4 for w in waiting)
    finally:
        blocker.close()
    assert metric(gateway, "kvpool_gateway_queue_refused_total") == 1
    assert metric(gateway, "kvpool_gateway_queued_total") == 2
    assert metric(gateway, "kvpool_gateway_queue_wait_seconds_count") == 2


def raw_request(gateway: GatewayProcess, body: bytes) -> socket.socket:
    """A chat request sent on a socket of our own, so the test can close the connection before the answer."""
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=WAIT_S)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def test_a_non_streamed_request_whose_client_goes_away_is_cancelled(
    daemon: DaemonProcess, served: GatewayProcess
) -> None:
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1800}'
    with daemon.client() as watcher:
        sock = raw_request(served, body)
        wait_until(lambda: watcher.status().sessions.generating == 1, "the generation to start", WAIT_S)
        sock.close()
        wait_until(lambda: not watcher.status().sessions.generating, "the generation to stop", WAIT_S)
        status = watcher.status()
        assert status.counters.finished.get("cancelled") == 1
        assert status.counters.generated_tokens < 1800
        assert not any(s.busy for s in watcher.sessions())  # its session is free (or closed)
    # and the gateway serves on
    assert (
        client_of(served)
        .chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        .usage.completion_tokens
        == 2
    )


def test_a_waiting_request_whose_client_goes_away_leaves_the_queue(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    gateway = start_gateway(daemon.address, "--max-inflight", "1")
    c = client_of(gateway)
    blocker = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go on"}], max_tokens=1800, stream=True
    )
    next(iter(blocker))
    try:
        sock = raw_request(gateway, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}]}')
        wait_until(lambda: metric(gateway, "kvpool_gateway_queue_depth") == 1, "the request to wait", WAIT_S)
        sock.close()
        wait_until(lambda: metric(gateway, "kvpool_gateway_queue_depth") == 0, "it to leave the queue", WAIT_S)
    finally:
        blocker.close()
    reply = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "next"}], max_tokens=2)
    assert reply.usage.completion_tokens == 2
    with daemon.client() as watcher:
        assert (
            watcher.status().counters.finished.get("stop", 0) + watcher.status().counters.finished.get("length", 0) == 1
        )  # only `next` ran: the request that left the queue never reached the daemon


@pytest.mark.parametrize("flag", [("--max-inflight", "-1"), ("--queue-size", "-5")])
def test_bad_queue_flags_are_refused_at_start(flag: tuple[str, str]) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kvpool.gateway.main", *flag], capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 2 and flag[0] in done.stderr
