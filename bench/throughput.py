"""Aggregate generation throughput: kvpoold with N concurrent client processes vs. three baselines.

For N in 1, 2, 4, 8 task processes, each generating 64 greedy tokens from its own prompt (2 threads):
  daemon      N client processes, all released at once, through one kvpoold (client-side tokens/s)
  daemon-side the same run seen by the daemon: generated tokens / engine busy time (status counters)
  (a) serial  the same N requests sent one at a time through the same daemon
  (b) bare    one process batching the same N sequences with llama_decode directly (no daemon, no IPC):
              the ceiling for this binding
  (c) Llama   N separate processes, each running llama-cpp-python's own `Llama` (the status quo); measured
              once per N and capped at 180 s (oversubscribed cores make it very slow; "<" marks a cap)
Each other cell is the median of --repeat runs measured side by side. Results also go to bench/out/throughput.json.
The table's title says which cpu_repack mode the daemon and (b) ran with (--cpu-repack, default: what auto picks).

--repack-compare measures only (b), with llama.cpp's weight repacking on and off, alternating, so the cost of
`cpu_repack = "off"` is known on a machine where both work. --deterministic-compare measures the daemon's
client-side tokens/s with deterministic decoding off (the default) and on, two daemons side by side, alternating
within each round (docs/determinism.md):

    python bench/throughput.py [--model PATH] [--clients 1 2 4 8] [--repeat 3] [--cpu-repack auto|on|off]
    python bench/throughput.py --repack-compare [--clients 1 4] [--repeat 5]
    python bench/throughput.py --deterministic-compare [--clients 1 4 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, private_daemon  # noqa: E402

MAX_TOKENS = 64
THREADS = 2
TIMEOUT_S = 900
LLAMA_CAP_S = 180.0
TOPICS = [
    "a lighthouse keeper",
    "a robot that learns to cook",
    "the first day of school",
    "a storm at sea",
    "a lost cat finding its way home",
    "a city built under the ocean",
    "an old clock maker",
    "a dragon",
]


def prompt(i: int) -> str:
    return f"Once upon a time, there was {TOPICS[i % len(TOPICS)]}. Every morning,"


# ---------------------------------------------------------------- worker roles (run in their own processes)


def role_client(address: str, i: int) -> None:
    from kvpool.client import Client

    with Client(address, timeout=TIMEOUT_S) as client, client.open_session() as session:
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.monotonic()
        result = session.complete(prompt(i), max_tokens=MAX_TOKENS, temperature=0.0)
        end = time.monotonic()
    print(json.dumps({"start": start, "end": end, "tokens": result.usage.completion_tokens}), flush=True)


def role_llama(model: str, i: int) -> None:
    import llama_cpp  # the status-quo baseline is llama-cpp-python's own high-level API

    llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    out = llm.create_completion(prompt(i), max_tokens=MAX_TOKENS, temperature=0.0)
    end = time.monotonic()
    print(json.dumps({"start": start, "end": end, "tokens": out["usage"]["completion_tokens"]}), flush=True)


def role_bare(model: str, n: int, repack: bool) -> None:
    """The ceiling: the same sequences batched with llama_decode in one process, through kvpool's model layer."""
    from kvpool.daemon.llama.model import Model, SamplingParams

    m = Model(Path(model), context_size=4096, hot_slots=max(n, 1), batch_size=512, threads=THREADS, repack=repack)
    samplers = [m.new_sampler(SamplingParams(temperature=0.0), []) for _ in range(n)]
    pending = [m.tokenize(prompt(i), add_bos=True) for i in range(n)]
    pos = [0] * n
    tokens = 0
    alive = list(range(n))
    start = time.monotonic()
    for _ in range(MAX_TOKENS):
        m.batch.clear()
        rows = {i: m.batch.add(i, pending[i], pos[i], True) for i in alive}
        assert m.decode() == 0
        for i in list(alive):
            pos[i] += len(pending[i])
            token = samplers[i].sample(rows[i]).token
            tokens += 1
            pending[i] = [token]
            if m.is_end_of_generation(token):
                alive.remove(i)
        if not alive:
            break
    end = time.monotonic()
    print(json.dumps({"start": start, "end": end, "tokens": tokens}), flush=True)


# ---------------------------------------------------------------- orchestration


def run_released(cmds: list[list[str]], timeout: float = TIMEOUT_S) -> dict[str, float]:
    """Start the processes, wait until each says ready, release them together; aggregate their results.

    If they are not all done within ``timeout`` after the release, they are killed and the result is an upper
    bound: every token they could have produced, over the timeout (``bounded`` is then True)."""
    # Workers keep stderr for their errors, except that llama.cpp logs to it at every model load.
    procs = [
        subprocess.Popen(
            c,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            stderr=subprocess.DEVNULL if "llama" in c else None,
        )
        for c in cmds
    ]
    try:
        for proc in procs:
            line = proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"worker did not start: {line!r}")
        released = time.monotonic()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            left = max(1.0, timeout - (time.monotonic() - released))
            results.append(json.loads(proc.communicate(timeout=left)[0].strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        return {
            "tokens": MAX_TOKENS * len(cmds),
            "seconds": timeout,
            "tps": MAX_TOKENS * len(cmds) / timeout,
            "bounded": True,
        }
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tokens = sum(r["tokens"] for r in results)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"tokens": tokens, "seconds": wall, "tps": tokens / wall, "bounded": False}


def me(role: str, *args: object) -> list[str]:
    return [sys.executable, str(Path(__file__)), "--role", role, *map(str, args)]


def daemon_counters(address: str) -> dict[str, float]:
    from kvpool.client import Client

    with Client(address) as client:
        return msgspec.to_builtins(client.status().counters)


def measure(address: str, model: str, n: int, with_llama: bool, repack: bool) -> dict[str, float]:
    before = daemon_counters(address)
    together = run_released([me("client", address, i) for i in range(n)])
    after = daemon_counters(address)
    daemon_tps = (after["generated_tokens"] - before["generated_tokens"]) / (
        after["busy_seconds"] - before["busy_seconds"]
    )
    serial_tokens, serial_s = 0, 0.0
    for i in range(n):
        one = run_released([me("client", address, i)])
        serial_tokens += one["tokens"]
        serial_s += one["seconds"]
    bare = run_released([me("bare-go", model, n, int(repack))])
    result = {
        "daemon": together["tps"],
        "daemon_side": daemon_tps,
        "serial": serial_tokens / serial_s,
        "bare": bare["tps"],
        "tokens": together["tokens"],
    }
    if with_llama:
        # Separate processes oversubscribe the cores (N x 2 threads on 2 cores) and get very slow, so this
        # baseline runs once per N and is capped at LLAMA_CAP_S (then reported as an upper bound, "<").
        llama = run_released([me("llama", model, i) for i in range(n)], timeout=LLAMA_CAP_S)
        result |= {"llama": llama["tps"], "llama_bounded": float(llama["bounded"])}
    return result


def role_bare_go(model: str, n: int, repack: int) -> None:
    print("ready", flush=True)  # loading happens after the release, but is not timed
    sys.stdin.readline()
    role_bare(model, n, bool(repack))


def repack_compare(model: str, clients: list[int], repeat: int) -> None:
    """(b) with repacking on and off, alternating within each round, so both see the same machine noise."""
    print(
        f"\nDecode tokens/s of (b) bare, {MAX_TOKENS} greedy tokens per sequence, {THREADS} threads, "
        f"median of {repeat} alternating runs"
    )
    print(f"{'N':>2} | {'repack on':>9} | {'repack off':>10} | {'off/on':>6}")
    for n in clients:
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeat):
            for repack in (True, False):
                runs[repack].append(run_released([me("bare-go", model, n, int(repack))])["tps"])
        on, off = statistics.median(runs[True]), statistics.median(runs[False])
        print(f"{n:>2} | {on:>9.1f} | {off:>10.1f} | {off / on:>5.2f}x", flush=True)


def deterministic_compare(model: str, clients: list[int], repeat: int) -> None:
    """The daemon's decode tokens/s with deterministic decoding off and on, alternating within each round."""
    slots = ("--hot-slots", str(max(clients)), "--context-size", "4096", "--threads", str(THREADS))
    with private_daemon(model, *slots) as default, private_daemon(model, *slots, "--deterministic") as fixed:
        print(
            f"\nClient-side decode tokens/s, {MAX_TOKENS} greedy tokens per client, {THREADS} threads, median of "
            f"{repeat} alternating runs (default: cpu_repack auto)"
        )
        print(f"{'N':>2} | {'default':>8} | {'deterministic':>13} | {'det/default':>11}")
        for n in clients:
            runs: dict[str, list[float]] = {"default": [], "deterministic": []}
            for _ in range(repeat):
                for name, daemon in (("default", default), ("deterministic", fixed)):
                    runs[name].append(run_released([me("client", daemon.address, i) for i in range(n)])["tps"])
            a, b = statistics.median(runs["default"]), statistics.median(runs["deterministic"])
            print(f"{n:>2} | {a:>8.1f} | {b:>13.1f} | {b / a:>10.2f}x", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpu-repack", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--repack-compare", action="store_true", help="only (b), with repacking on and off")
    ap.add_argument(
        "--deterministic-compare", action="store_true", help="only the daemon, deterministic decoding off and on"
    )
    args = ap.parse_args()
    if args.role:
        roles = {"client": role_client, "llama": role_llama, "bare-go": role_bare_go}
        roles[args.role](args.args[0], *map(int, args.args[1:]))
        return 0

    from kvpool.daemon.llama.cpu_probe import choose_repack

    model = default_model(args.model)
    if args.deterministic_compare:
        deterministic_compare(model, args.clients, args.repeat)
        return 0
    choice = choose_repack(args.cpu_repack, Path(model))
    print(f"{choice.describe()}", file=sys.stderr, flush=True)
    if args.repack_compare:
        repack_compare(model, args.clients, args.repeat)
        return 0
    repack = "on" if choice.enabled else "off"
    rows = []
    with private_daemon(
        model,
        "--hot-slots",
        str(max(args.clients)),
        "--context-size",
        "4096",
        "--threads",
        str(THREADS),
        "--cpu-repack",
        repack,
    ) as daemon:
        for n in args.clients:
            runs = [measure(daemon.address, model, n, (r == 0), choice.enabled) for r in range(args.repeat)]
            row = {k: statistics.median(r[k] for r in runs if k in r) for k in runs[0]}
            row["n"] = n
            rows.append(row)
            print(f"measured N={n}: {row}", file=sys.stderr, flush=True)
    print_table(rows, args.repeat, repack)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(rows, indent=2))
    return 0


def print_table(rows: list[dict[str, float]], repeat: int, repack: str) -> None:
    print(
        f"\nAggregate generated tokens/s, {MAX_TOKENS} greedy tokens per client, {THREADS} threads, "
        f"median of {repeat} runs (cpu: {os.cpu_count()} cores, cpu_repack {repack})"
    )
    head = (
        f"{'N':>2} | {'daemon':>7} | {'d-side':>7} | {'(a) serial':>10} | {'(b) bare':>8} | {'(c) Llama':>9} |"
        f" {'vs (a)':>6} | {'vs (b)':>6} | {'vs (c)':>6} | {'IPC gap':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        gap = abs(r["daemon_side"] - r["daemon"]) / r["daemon_side"] * 100
        cap = "<" if r["llama_bounded"] else " "
        over = ">" if r["llama_bounded"] else " "
        print(
            f"{int(r['n']):>2} | {r['daemon']:>7.1f} | {r['daemon_side']:>7.1f} | {r['serial']:>10.1f} | "
            f"{r['bare']:>8.1f} | {cap}{r['llama']:>8.1f} | {r['daemon'] / r['serial']:>5.2f}x | "
            f"{r['daemon'] / r['bare']:>5.2f}x | {over}{r['daemon'] / r['llama']:>5.2f}x | {gap:>6.1f}%"
        )


if __name__ == "__main__":
    sys.exit(main())
