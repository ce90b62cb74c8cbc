"""The ceiling of pool bandwidth: llama.cpp's own state copy and the checksum pass, without the daemon.

For sessions of about 256, 1024 and 2048 tokens on the default model, in this process (no daemon, no client):
  save      llama_state_seq_get_data into a shared mapping, as a checkpoint does
  checksum  the pool checksum over the bytes just saved (a checkpoint's integrity pass)
  verify    the same checksum over a snapshot not touched since (a restore's integrity pass)
  load      llama_state_seq_set_data from the mapping right after the verify, as a restore does
  memcpy    numpy copies of the same number of bytes, anonymous memory to the mapping and back, each timed
            right next to the move it is compared with (the machine's speed drifts)
Prints medians of --repeat rounds, each move's speed as a fraction of its neighbouring memcpy, and the round
trip (checkpoint + restore) against memcpy with and without the two integrity passes: what bench/resume.py's
daemon figures can at best reach.

    python bench/state_copy.py [--model PATH] [--repeat 15]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import mmap
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model  # noqa: E402

from kvpool.daemon.kv.pool.checksum import checksum  # noqa: E402
from kvpool.daemon.llama.model import Model  # noqa: E402

SENTENCE = "The robot walked through the quiet house and noted every open window, lamp and sleeping pet. "
TARGETS = [256, 1024, 2048]
AREA = 512 << 20  # larger than any CPU cache: each round uses fresh extents, as the pool's allocator does


def prefill(model: Model, tokens: list[int]) -> None:
    model.forget_sequence(0)
    for start in range(0, len(tokens), 512):
        chunk = tokens[start : start + 512]
        model.batch.clear()
        model.batch.add(0, chunk, start, outputs=True)
        if model.decode() != 0:
            raise RuntimeError("llama_decode failed")


def measure(model: Model, tokens: list[int], repeat: int, pool: mmap.mmap, anon: mmap.mmap) -> dict[str, float]:
    prefill(model, tokens)
    n = model.state_size(0)
    pool_bytes, anon_bytes = np.frombuffer(pool, dtype=np.uint8), np.frombuffer(anon, dtype=np.uint8)
    slots = AREA // n - 1

    def region(array: np.ndarray, k: int) -> np.ndarray:
        k %= slots
        return array[k * n : (k + 1) * n]

    t: dict[str, list[float]] = {k: [] for k in ("save", "checksum", "verify", "load", "memcpy_out", "memcpy_in")}
    for r in range(repeat):
        mine, other = 4 * r, 4 * r + 2  # extents of this round and one for the memcpy, never the same
        state = (ctypes.c_uint8 * n).from_buffer(pool, (mine % slots) * n)
        clock = [time.perf_counter()]
        model.save_state(0, state)
        clock.append(time.perf_counter())
        checksum(region(pool_bytes, mine))
        clock.append(time.perf_counter())
        np.copyto(region(pool_bytes, other), region(anon_bytes, mine))
        clock.append(time.perf_counter())
        anon_bytes[: 64 << 20] = r  # evict the snapshot from the CPU caches, as time does between turns
        clock.append(time.perf_counter())
        checksum(region(pool_bytes, mine))
        clock.append(time.perf_counter())
        model.load_state(1, state)
        clock.append(time.perf_counter())
        np.copyto(region(anon_bytes, other + 1), region(pool_bytes, other))
        clock.append(time.perf_counter())
        del state
        steps = ("save", "checksum", "memcpy_out", None, "verify", "load", "memcpy_in")  # None: cache eviction
        for key, (a, b) in zip(steps, itertools.pairwise(clock), strict=True):
            if key:
                t[key].append(b - a)
    med = {k: statistics.median(v) for k, v in t.items()}
    med["bytes"] = n
    med["tokens"] = len(tokens)
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    model = Model(Path(default_model(args.model)), context_size=4096, hot_slots=2, batch_size=512, threads=2)
    text_tokens = model.tokenize(SENTENCE * 120, add_bos=True)
    pool = mmap.mmap(-1, AREA, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    anon = mmap.mmap(-1, AREA, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    rows = [measure(model, text_tokens[:target], args.repeat, pool, anon) for target in TARGETS]
    model.close()

    def gbs(row: dict[str, float], *keys: str) -> float:
        return row["bytes"] / sum(row[k] for k in keys) / 1e9

    print(f"\nllama.cpp's state copy and the checksum pass, GB/s (median of {args.repeat}; Gemma 3 270M, 4096 cells)")
    print(
        f"{'tokens':>6} | {'MiB':>5} | {'save':>5} | {'checksum':>8} | {'verify':>6} | {'load':>5} | {'memcpy':>6} | "
        f"{'save/memcpy':>11} | {'load/memcpy':>11} | {'round trip/memcpy: copies only':>30} | {'with checksums':>14}"
    )
    for r in rows:
        memcpy = 2 * r["bytes"] / (r["memcpy_out"] + r["memcpy_in"])
        copies = 2 * r["bytes"] / (r["save"] + r["load"])
        checked = 2 * r["bytes"] / (r["save"] + r["checksum"] + r["verify"] + r["load"])
        print(
            f"{r['tokens']:>6} | {r['bytes'] / 2**20:>5.1f} | {gbs(r, 'save'):>5.2f} | {gbs(r, 'checksum'):>8.1f} | "
            f"{gbs(r, 'verify'):>6.1f} | {gbs(r, 'load'):>5.2f} | {memcpy / 1e9:>6.2f} | "
            f"{r['memcpy_out'] / r['save']:>11.2f} | {r['memcpy_in'] / r['load']:>11.2f} | "
            f"{copies / memcpy:>30.2f} | {checked / memcpy:>14.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
