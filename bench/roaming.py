"""Roaming through the remote tier (Redis), against re-prefill, on two daemons standing in for two nodes.

For contexts of about 256, 1024 and 2048 tokens on the default model (2 threads each), node A builds a session,
writes its checkpoint to Redis and hands it over (`migrate`: newest checkpoint written, lease given up); then:
  (a) roam      node B resumes it from Redis (fetch + check + into its pool) and answers the next turn
  (b) prefill   node B opens a new session and is sent the whole conversation as text (no shared state)
Both are timed by the client, from the request that starts them (resume, open) to the first streamed token of
the next turn; the daemon's own TTFT of that turn is printed too. Medians of --repeat runs, the sizes taking turns.

Remote write throughput: each checkpoint node A writes after a turn is one sample, 4 per session (the daemon's
counters: bytes and seconds of that write: staging the payload straight from the pool, checking it, committing it
with its record). Each is followed by a plain redis-py SET of the same number of bytes to the same Redis from this
process, and by the writer's own path for those bytes in this process: all three interleaved, in the same run.

    python bench/roaming.py [--model PATH] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import redis  # noqa: E402
from common import default_model, private_daemon, private_redis  # noqa: E402

from kvpool import protocol as p  # noqa: E402
from kvpool.client import Client, Session  # noqa: E402
from kvpool.client.results import expect  # noqa: E402
from kvpool.daemon.remote.record import Keys, RemoteRecord, encode  # noqa: E402
from kvpool.daemon.remote.store import RemoteStore  # noqa: E402

SENTENCE = "The robot walked through the quiet house and noted every open window, lamp and sleeping pet. "
TARGETS = [256, 1024, 2048]
NEXT_TURN = " Now summarise."
WRITE_ROUNDS = 4  # remote writes sampled per session
IDLE_GAP_S = 0.3


def history_text(tokens: int) -> str:
    return SENTENCE * max(1, tokens // 19)  # the sentence is about 19 Gemma tokens


def first_token(start: float, stream: object) -> tuple[float, float]:
    """(client ms from ``start`` to the first chunk, daemon TTFT ms) of a one-token generation."""
    first = None
    for _ in stream:  # type: ignore[attr-defined]
        if first is None:
            first = time.perf_counter()
    final = stream.final  # type: ignore[attr-defined]
    assert first is not None and final is not None
    return (first - start) * 1000.0, final.timings.ttft_ms


def remote_counts(client: Client) -> tuple[int, int, float]:
    r = client.status().remote
    assert r is not None
    return r.writes, r.write_bytes, r.write_seconds


def wait_written(client: Client, writes_before: int) -> None:
    deadline = time.monotonic() + 60
    while remote_counts(client)[0] <= writes_before:
        if time.monotonic() > deadline:
            raise SystemExit("node A's checkpoint never reached Redis")
        # A bounded wait's polling interval: status requests cost the daemon's threads time (and the GIL) that
        # the writer being measured would otherwise have.
        time.sleep(0.05)


def plain_set_bandwidth(url: str, nbytes: int, repeat: int) -> tuple[float, float, float]:
    """(a plain redis-py SET of ``nbytes``, the remote writer's own path for the same bytes: the payload staged straight
    from memory, then the lease-checked commit with the record; the checksum it adds only when an extent was
    freed meanwhile is left out), both in this process, in bytes/s, medians of ``repeat``. Both overwrite one key
    each time, as the writer replaces a session's checkpoint (a SET to a new key each time also pays for Redis'
    fresh pages)."""
    r = redis.Redis.from_url(url)
    blob = os.urandom(nbytes)
    r.set("bench:plain", blob)
    times, idle_times = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        r.set("bench:plain", blob)
        times.append(time.perf_counter() - started)
    for _ in range(repeat):
        # The writer's SETs come after an idle spell (the turn): cold caches, an idle connection. A plain SET after
        # such a spell measured 0.8-2 ms slower than back to back, for 4-13 MiB here.
        time.sleep(IDLE_GAP_S)
        started = time.perf_counter()
        r.set("bench:plain", blob)
        idle_times.append(time.perf_counter() - started)
    r.delete("bench:plain")
    r.close()
    store = RemoteStore(url, Keys("bench"), "bench", 10.0)
    held = store.acquire("path", 60_000)
    record = RemoteRecord(
        session="path",
        token_sha256="",
        task="t",
        n_tokens=0,
        n_kv=0,
        state_bytes=nbytes,
        fingerprint="",
        kv_layout="",
        checksum=0,
        version=1,
        generation=held.generation,
        last_used=0.0,
        written_at=0.0,
        node="",
    )
    source = memoryview(blob)
    head = encode(record)
    path_times = []
    for i in range(repeat + 1):
        started = time.perf_counter()
        store.stage("path", held, source)
        store.commit("path", held, head, 0)
        if i:  # the first one creates the key
            path_times.append(time.perf_counter() - started)
    store.delete("path", held)
    store.close()
    med = statistics.median
    return nbytes / med(times), nbytes / med(idle_times), nbytes / med(path_times)


def sample_writes(a: Client, s: Session, url: str, rounds: int, samples: dict[str, list[float]]) -> None:
    """``rounds`` writes of the session's checkpoint by node A (each after a one-token turn, so about the same
    size), each followed by a plain SET and the writer's path of the same bytes from this process."""
    for _ in range(rounds):
        writes, nbytes, seconds = remote_counts(a)
        s.complete(" More.", max_tokens=1, temperature=0.0)
        wait_written(a, writes)
        writes2, nbytes2, seconds2 = remote_counts(a)
        if writes2 != writes + 1:
            continue  # two checkpoints were coalesced or written at once: not one write's time
        samples["write_bw"].append((nbytes2 - nbytes) / (seconds2 - seconds))
        samples["sizes"].append(nbytes2 - nbytes)
        plain, idle, path = plain_set_bandwidth(url, nbytes2 - nbytes, 3)
        samples["plain_bw"].append(plain)
        samples["idle_bw"].append(idle)
        samples["path_bw"].append(path)


def measure_once(a: Client, b: Client, url: str, target: int, samples: dict[str, list[float]]) -> int:
    """One session of about ``target`` tokens: built on A, written to Redis, migrated, resumed on B; then the
    same conversation re-prefilled on B. Appends to ``samples``; returns the session's tokens."""
    text = history_text(target)
    s = a.open_session()
    writes = remote_counts(a)[0]
    s.complete(text, max_tokens=1, temperature=0.0)
    wait_written(a, writes)
    sample_writes(a, s, url, WRITE_ROUNDS, samples)
    tokens = len(s.history())
    expect(a._call(p.Migrate(session=s.id, token=s.token)), p.Migrated)

    started = time.perf_counter()
    moved = b.resume_session(s.id, s.token)
    client_ms, daemon_ms = first_token(started, moved.generate(NEXT_TURN, max_tokens=1, temperature=0.0))
    samples["roam"].append(client_ms)
    samples["roam_daemon"].append(daemon_ms)
    moved.close()

    started = time.perf_counter()
    fresh = b.open_session()
    client_ms, daemon_ms = first_token(started, fresh.generate(text + NEXT_TURN, max_tokens=1, temperature=0.0))
    samples["prefill"].append(client_ms)
    samples["prefill_daemon"].append(daemon_ms)
    fresh.close()
    return tokens


def summary(tokens: int, samples: dict[str, list[float]]) -> dict[str, float]:
    med = statistics.median
    return {
        "tokens": tokens,
        "roam_ms": med(samples["roam"]),
        "roam_daemon_ttft_ms": med(samples["roam_daemon"]),
        "prefill_ms": med(samples["prefill"]),
        "prefill_daemon_ttft_ms": med(samples["prefill_daemon"]),
        "snapshot_bytes": med(samples["sizes"]) if samples["sizes"] else 0,
        "write_mb_s": med(samples["write_bw"]) / 1e6 if samples["write_bw"] else 0.0,
        "plain_set_mb_s": med(samples["plain_bw"]) / 1e6 if samples["plain_bw"] else 0.0,
        "idle_set_mb_s": med(samples["idle_bw"]) / 1e6 if samples["idle_bw"] else 0.0,
        "path_mb_s": med(samples["path_bw"]) / 1e6 if samples["path_bw"] else 0.0,
        "write_samples": len(samples["write_bw"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    model = default_model(args.model)
    common = ("--hot-slots", "2", "--context-size", "4096", "--threads", "2", "--cache-pool-size", "512MiB")
    with (
        private_redis() as url,
        private_daemon(model, *common, "--remote", url) as node_a,
        private_daemon(model, *common, "--remote", url) as node_b,
        Client(node_a.address, timeout=600) as a,
        Client(node_b.address, timeout=600) as b,
    ):
        for client in (a, b):  # the first turns of a daemon pay one-time costs (buffers, page faults)
            with client.open_session() as warm:
                warm.complete(history_text(256), max_tokens=2, temperature=0.0)
        # Sizes take turns, repeat after repeat: the shared machine's slow spells spread over all of them.
        kinds = ("roam", "roam_daemon", "prefill", "prefill_daemon", "sizes")
        kinds += ("write_bw", "plain_bw", "idle_bw", "path_bw")
        samples = {t: {k: [] for k in kinds} for t in TARGETS}
        tokens = dict.fromkeys(TARGETS, 0)
        for repeat in range(args.repeat):
            for target in TARGETS:
                tokens[target] = measure_once(a, b, url, target, samples[target])
            print(f"repeat {repeat + 1}/{args.repeat} done", file=sys.stderr, flush=True)
        rows = [summary(tokens[t], samples[t]) for t in TARGETS]
    print(f"\nNext turn on node B (ms, client-measured from resume/open to the first token, median of {args.repeat};")
    print("Gemma 3 270M, 2 threads per node, Redis on 127.0.0.1; the daemon's own TTFT of the turn in brackets)")
    print(f"{'context':>8} | {'(a) roam from Redis':>21} | {'(b) re-prefill':>18} | {'prefill/roam':>12}")
    for r in rows:
        print(
            f"{int(r['tokens']):>8} | {r['roam_ms']:>9.1f} ({r['roam_daemon_ttft_ms']:>7.1f}) | "
            f"{r['prefill_ms']:>8.1f} ({r['prefill_daemon_ttft_ms']:>7.1f}) | {r['prefill_ms'] / r['roam_ms']:>11.1f}x"
        )
    print("\nRemote write throughput (MB/s, medians; one sample per checkpoint node A wrote, each followed by plain")
    print(f"SETs of the same bytes back to back and after {IDLE_GAP_S} s idle, and by the writer's path (stage +")
    print("lease-checked commit) in this process)")
    print(
        f"{'context':>8} | {'snapshot':>10} | {'kvpoold write':>13} | {'plain SET':>9} | {'ratio':>5} | "
        f"{'SET after idle':>14} | {'ratio':>5} | {'path here':>9} | {'path/plain':>10} | samples"
    )
    for r in rows:
        plain = r["plain_set_mb_s"] or float("nan")
        idle = r["idle_set_mb_s"] or float("nan")
        print(
            f"{int(r['tokens']):>8} | {r['snapshot_bytes'] / 2**20:>6.1f} MiB | {r['write_mb_s']:>13.0f} | "
            f"{plain:>9.0f} | {r['write_mb_s'] / plain:>5.2f} | {idle:>14.0f} | {r['write_mb_s'] / idle:>5.2f} | "
            f"{r['path_mb_s']:>9.0f} | {r['path_mb_s'] / plain:>10.2f} | {r['write_samples']}"
        )
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "roaming.json").write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
