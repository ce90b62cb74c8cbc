"""Soak: 8 clients with mixed tasks against one daemon for a bounded time (default 10 minutes).

Clients: 3 voice (short multi-turn sessions, tight budget), 2 vision (long prompts, best effort, a new
session per request), 1 canceller (starts long generations and cancels them), 1 churner (opens, uses and
closes sessions, resumes old ones), 1 misbehaver (malformed frames, wrong tokens, unknown sessions). Reports
requests served, errors by code, the daemon's RSS at start and end (psutil), and leaked shared-memory
segments and sockets after the daemon stops (both must be zero).

    python bench/soak.py [--model PATH] [--seconds 600]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec
import psutil
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client, KvpoolError  # noqa: E402

SCENE = "A kitchen robot watches the stove, the kettle, two mugs and a sleeping cat near the window. " * 10


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.served: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()

    def ok(self, kind: str) -> None:
        with self.lock:
            self.served[kind] += 1

    def error(self, code: str) -> None:
        with self.lock:
            self.errors[code] += 1


def run(kind: str, address: str, end: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    with Client(address, timeout=120) as client:
        session = client.open_session("voice" if kind == "voice" else "default")
        turns = 0
        while time.monotonic() < end:
            try:
                if kind == "voice":
                    turns += 1
                    if turns % 10 == 0:
                        session.close()
                        session = client.open_session("voice")
                    session.complete(f"User: question {turns}?\nAssistant:", max_tokens=12, stop=["\n"])
                    time.sleep(rng.uniform(0.5, 1.5))  # a person's pace
                elif kind == "vision":
                    with client.open_session("vision") as s:
                        s.complete(SCENE + "\nCaption:", max_tokens=24, stop=["\n"])
                elif kind == "cancel":
                    if len(session.history()) > 1500:  # start over before the session's context is full
                        session.close()
                        session = client.open_session()
                    stream = session.generate("Tell a very long story.", max_tokens=500)
                    for i, _chunk in enumerate(stream):
                        if i == 5:
                            session.cancel()
                elif kind == "churn":
                    s = client.open_session()
                    s.complete("hello", max_tokens=4)
                    again = client.resume_session(s.id, s.token)
                    again.complete(" again", max_tokens=4)
                    s.close()
                elif kind == "misbehave":
                    misbehave(client, address, rng)
                    time.sleep(0.05)
                tally.ok(kind)
            except KvpoolError as exc:
                tally.error(exc.code)


def misbehave(client: Client, address: str, rng: random.Random) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(address)
    try:
        sock.send(rng.randbytes(rng.randrange(1, 200)))
        sock.recv()
    finally:
        sock.close(0)
    with contextlib.suppress(KvpoolError):
        client.resume_session("0123456789abcdef", "0" * 32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--seconds", type=float, default=600.0)
    args = ap.parse_args()
    model = default_model(args.model)
    kinds = ["voice", "voice", "voice", "vision", "vision", "cancel", "churn", "misbehave"]
    tally = Tally()
    shm_before = {p.name for p in Path("/dev/shm").iterdir()}
    with private_daemon(model, "--config", str(HERE.parent / "configs" / "default.toml"), "--threads", "2") as d:
        process = psutil.Process(d.proc.pid)
        with Client(d.address) as warm:  # the first request after start pays for warm caches
            warm.status()
        rss_start = process.memory_info().rss
        end = time.monotonic() + args.seconds
        threads = [threading.Thread(target=run, args=(k, d.address, end, tally, i)) for i, k in enumerate(kinds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.seconds + 600)
        rss_end = process.memory_info().rss
        with Client(d.address) as client:
            status = msgspec.to_builtins(client.status())
        socket_file = Path(d.address.removeprefix("ipc://"))
    leaked_shm = {p.name for p in Path("/dev/shm").iterdir()} - shm_before
    leaked_sockets = [str(socket_file)] if socket_file.exists() else []
    result = {
        "seconds": args.seconds,
        "served": dict(tally.served),
        "client_errors": dict(tally.errors),
        "daemon_errors": status["counters"]["errors"] | status["counters"]["frame_errors"],
        "finished": status["counters"]["finished"],
        "rss_start_mib": rss_start / 2**20,
        "rss_end_mib": rss_end / 2**20,
        "leaked_shm_segments": sorted(leaked_shm),
        "leaked_sockets": leaked_sockets,
    }
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    print(f"\nSoak: 8 clients, mixed tasks, {args.seconds:.0f} s (Gemma 3 270M, 2 threads)")
    print(f"requests served by kind: {dict(tally.served)} (total {sum(tally.served.values())})")
    print(f"errors seen by clients:  {dict(tally.errors)}")
    print(f"errors sent by daemon:   {result['daemon_errors']}")
    print(f"daemon RSS: {result['rss_start_mib']:.1f} MiB at start, {result['rss_end_mib']:.1f} MiB at end")
    print(f"leaked shm segments: {len(leaked_shm)}, leaked sockets: {len(leaked_sockets)}")
    return 0 if not leaked_shm and not leaked_sockets else 1


if __name__ == "__main__":
    sys.exit(main())
