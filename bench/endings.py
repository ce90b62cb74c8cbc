"""How answers end when the caller pauses or the daemon goes: figures for docs/gateway.md and docs/decisions.md.

1. The gateway stopped (SIGSTOP) for P seconds in the middle of an answer, on a daemon with the default
   client_patience (10 s): how the answer ends (whole, and equal to the unpaused one; or an error), and how much
   longer it took than unpaused.
2. kvpoold down: how long a chat request (whole and streamed) and /health take to answer, and with what status.

    .venv/bin/python bench/endings.py [--model PATH] [--pauses 1 2 5 8 12] [--repeat 5]

The tiny random-weights model of the tests by default (answers of --tokens tokens, the end token banned), on a
deterministic daemon so that equal answers are comparable. Prints two tables.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests.daemon_process import DaemonProcess  # noqa: E402
from tests.gateway_process import GatewayProcess  # noqa: E402
from tests.tinymodel import build_tiny_model  # noqa: E402

MESSAGES = [{"role": "user", "content": "Tell me a long story about a robot."}]


def chat(url: str, tokens: int, stream: bool = False, timeout: float = 120.0) -> tuple[int, str]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": tokens,
        "temperature": 0.0,
        "logit_bias": {"2": -100},
        "stream": stream,
    }
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    return reply.status_code, reply.text


def paused(daemon: DaemonProcess, gateway: GatewayProcess, tokens: int, seconds: float) -> tuple[int, str, float]:
    """One answer with the gateway stopped for ``seconds`` once the daemon has generated 20 of its tokens."""
    assert gateway.proc is not None
    result: dict[str, Any] = {}

    def ask() -> None:
        started = time.monotonic()
        result["status"], result["text"] = chat(gateway.url, tokens)
        result["seconds"] = time.monotonic() - started

    with daemon.client() as watcher:
        before = watcher.status().counters.generated_tokens
        thread = threading.Thread(target=ask)
        thread.start()
        deadline = time.monotonic() + 60
        while watcher.status().counters.generated_tokens - before < 20 and time.monotonic() < deadline:
            time.sleep(0.005)  # polling interval of a bounded wait
    os.kill(gateway.proc.pid, signal.SIGSTOP)
    time.sleep(seconds)  # the pause being measured
    os.kill(gateway.proc.pid, signal.SIGCONT)
    thread.join(180)
    return result["status"], result["text"], result["seconds"]


def content(text: str) -> str:
    return json.loads(text)["choices"][0]["message"]["content"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a GGUF (default: the tests' tiny model)")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--pauses", type=float, nargs="+", default=[1, 2, 5, 8, 12])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvb-"))
    model = args.model or build_tiny_model(work / "tiny.gguf")
    daemon = DaemonProcess(work / "d", model, "--context-size", "4096", "--hot-slots", "2", "--deterministic")
    daemon.start()
    gateway = GatewayProcess(work / "g", daemon.address).start()
    try:
        started = time.monotonic()
        status, unpaused = chat(gateway.url, args.tokens)
        alone = time.monotonic() - started
        assert status == 200, unpaused
        print(f"1. the gateway stopped mid-answer ({args.tokens} tokens, unpaused {alone:.2f} s; patience 10 s)\n")
        print("| pause s | status | answer | took s | beyond unpaused + pause s |")
        print("| --- | --- | --- | --- | --- |")
        for seconds in args.pauses:
            status, text, took = paused(daemon, gateway, args.tokens, seconds)
            if status == 200:
                outcome = "whole, equal" if content(text) == content(unpaused) else "whole, DIFFERENT"
            else:
                outcome = json.loads(text)["error"]["code"]
            print(f"| {seconds:g} | {status} | {outcome} | {took:.2f} | {took - alone - seconds:+.2f} |")
        daemon.stop(signal.SIGKILL)
        print("\n2. kvpoold down (SIGKILL): time to the answer, median of", args.repeat, "\n")
        print("| request | status | Retry-After | median s | max s |")
        print("| --- | --- | --- | --- | --- |")
        for name in ("chat", "chat, streamed", "/health"):
            times, statuses, retry = [], set(), set()
            for _ in range(args.repeat):
                started = time.monotonic()
                if name == "/health":
                    reply = httpx.get(gateway.url + "/health", timeout=60)
                else:
                    body = {"model": "m", "messages": MESSAGES, "max_tokens": 4, "stream": name != "chat"}
                    reply = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
                times.append(time.monotonic() - started)
                statuses.add(reply.status_code)
                retry.add(reply.headers.get("retry-after"))
            shown, retry_after = ",".join(map(str, sorted(statuses))), ",".join(map(str, retry))
            print(f"| {name} | {shown} | {retry_after} | {statistics.median(times):.2f} | {max(times):.2f} |")
    finally:
        gateway.stop()
        daemon.cleanup()


if __name__ == "__main__":
    main()
