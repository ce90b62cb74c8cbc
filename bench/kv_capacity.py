"""What KV compression buys, on the default model: conversations per pool, restore time, decode speed.

capacity  sessions of --tokens tokens a --pool-size pool holds, for each pool type: a real kvpoold with one
          hot slot and pool_kv_policy "always", sessions opened until the first one has to leave the pool
          (a spill); counted from the daemon's status
restore   a compressed snapshot written back at the hot types and loaded (kvpool's codec + llama.cpp), vs
          computing the same tokens again (prefill), in this process; medians of --repeat alternating runs
decode    tokens/s of 4 greedy streams batched in one llama_decode, for each hot KV type vs f16; medians of
          --repeat alternating runs

  python bench/kv_capacity.py [--model PATH] [--tokens 1024] [--pool-size 256MiB] [--repeat 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, prefill, private_daemon  # noqa: E402

from kvpool.client import Client  # noqa: E402
from kvpool.daemon.config import parse_size  # noqa: E402
from kvpool.daemon.kv.codec.precision_profile import find_profile  # noqa: E402
from kvpool.daemon.kv.codec.tier_codec import TierCodec  # noqa: E402
from kvpool.daemon.llama.kv_settings import KvSettings, resolve_kv_settings  # noqa: E402
from kvpool.daemon.llama.memory_plan import model_shape  # noqa: E402
from kvpool.daemon.llama.model import Model, SamplingParams  # noqa: E402
from kvpool.daemon.llama.model.loading import fingerprint  # noqa: E402

POOL_TYPES = ["same", "q8_0", "q8_0/q4_0h", "q5_1/q4_0h", "q4_0h", "q4_0", "profile"]
HOT_TYPES = ["f16", "q8_0", "q4_0"]
STREAMS = 4
DECODE_TOKENS = 64


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def session_text(text: str, i: int, chars: int) -> str:
    start = (i * 9973) % (len(text) - chars)  # a different passage for every session: nothing to share
    return f"[{i}] " + text[start : start + chars]


def capacity(model: str, pool_type: str, pool_size: str, tokens: int, limit: int) -> dict[str, float]:
    toml = Path(f"/tmp/kvpool-capacity-{pool_type.replace('/', '-')}.toml")
    toml.write_text(f'pool_kv_type = "{pool_type}"\npool_kv_policy = "always"\ncalibrate = false\n')
    text = corpus()
    args = ["--config", str(toml), "--hot-slots", "1", "--cache-pool-size", pool_size, "--context-size", "2048"]
    with private_daemon(model, *args, "--max-sessions", str(limit + 8)) as d, Client(d.address) as client:
        held = 0
        bytes_each: list[int] = []
        for i in range(limit):
            prompt = client.tokenize(session_text(text, i, tokens * 6), add_bos=True)[:tokens]
            client.open_session().complete(prompt, max_tokens=1, temperature=0.0)
            status = client.status()
            if status.moves.spills or status.moves.evictions:
                break
            held = status.sessions_by_tier.get("pool", 0)
            if status.pool.snapshots:
                bytes_each.append(status.pool.snapshot_bytes // status.pool.snapshots)
        return {"held": held, "snapshot_bytes": statistics.median(bytes_each) if bytes_each else 0}


def kv_settings(path: Path, k: str, v: str) -> KvSettings:
    shape = model_shape(path)
    return resolve_kv_settings(k, v, "auto", shape.head_k, shape.head_v)[0]


def codec_for(kv: KvSettings, pool_type: str, path: Path) -> TierCodec:
    """A codec storing at ``pool_type`` ("profile": the model's precision profile, as the daemon finds it)."""
    profile = None
    if pool_type == "profile":
        profile = find_profile("", path, fingerprint(path), model_shape(path).n_layer).store_type()
    return TierCodec(kv, pool_type, "always", "same", profile=profile)


def timed_prefill(m: Model, tokens: list[int]) -> float:
    started = time.perf_counter()
    prefill(m, 0, tokens)
    return time.perf_counter() - started


def restore_vs_prefill(path: Path, tokens: int, repeat: int) -> dict[str, dict[str, float]]:
    kv = kv_settings(path, "f16", "f16")
    m = Model(path, context_size=tokens + 512, hot_slots=1, batch_size=512, threads=2, kv=kv)
    prompt = m.tokenize(session_text(corpus(), 1, tokens * 6), add_bos=True)[:tokens]
    timed_prefill(m, prompt)
    size = m.state_size(0)
    buffer = (ctypes.c_uint8 * size)()
    assert m.save_state(0, buffer) == size
    stored = {"same": bytes(buffer)}
    for t in POOL_TYPES[1:]:
        codec = codec_for(kv, t, path)
        assert codec.pool_type is not None
        compressed = codec.compress(stored["same"], codec.pool_type)
        assert compressed is not None
        stored[t] = compressed
    times: dict[str, list[float]] = {name: [] for name in ["prefill", *POOL_TYPES]}
    for _ in range(repeat):
        times["prefill"].append(timed_prefill(m, prompt))
        for t in POOL_TYPES:
            codec = codec_for(kv, t, path)
            m.forget_sequence(0)
            started = time.perf_counter()
            state = codec.to_hot(stored[t]) if t != "same" else stored[t]
            assert m.load_state(0, (ctypes.c_uint8 * len(state)).from_buffer_copy(state))
            times[t].append(time.perf_counter() - started)
    m.close()
    medians = {name: statistics.median(v) for name, v in times.items()}
    return {
        t: {"seconds": medians[t], "bytes": len(stored[t]), "vs_prefill": medians["prefill"] / medians[t]}
        for t in POOL_TYPES
    } | {"prefill": {"seconds": medians["prefill"], "bytes": 0, "vs_prefill": 1.0}}


def decode_speed(path: Path, hot: str, prompts: list[str]) -> float:
    m = Model(path, context_size=2048, hot_slots=STREAMS, batch_size=512, threads=2, kv=kv_settings(path, hot, hot))
    samplers = [m.new_sampler(SamplingParams(temperature=0.0), []) for _ in range(STREAMS)]
    pending = [m.tokenize(p, add_bos=True) for p in prompts]
    pos = [0] * STREAMS
    m.batch.clear()
    rows = [m.batch.add(i, pending[i], 0, True) for i in range(STREAMS)]
    assert m.decode() == 0
    pending = [[samplers[i].sample(rows[i]).token] for i in range(STREAMS)]
    pos = [len(m.tokenize(p, add_bos=True)) for p in prompts]
    started = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        m.batch.clear()
        rows = [m.batch.add(i, pending[i], pos[i], True) for i in range(STREAMS)]
        assert m.decode() == 0
        for i in range(STREAMS):
            pos[i] += 1
            pending[i] = [samplers[i].sample(rows[i]).token]
    elapsed = time.perf_counter() - started
    m.close()
    return STREAMS * DECODE_TOKENS / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--pool-size", default="256MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-sessions", type=int, default=120, help="stop counting there")
    ap.add_argument("--skip-capacity", action="store_true")
    ap.add_argument("--pool-types", nargs="+", default=POOL_TYPES, choices=POOL_TYPES)
    ap.add_argument("--skip-speed", action="store_true", help="only the capacity table")
    ap.add_argument("--skip-decode", action="store_true", help="no decode-speed table")
    ap.add_argument("--json", type=Path, default=HERE / "out" / "kv_capacity.json")
    args = ap.parse_args()
    model = default_model(args.model)
    path = Path(model)
    results: dict[str, object] = {}

    if not args.skip_capacity:
        held = {t: capacity(model, t, args.pool_size, args.tokens, args.max_sessions) for t in args.pool_types}
        results["capacity"] = held
        print(
            f"\nSessions of {args.tokens} tokens held in a {args.pool_size} pool ({parse_size(args.pool_size)} bytes)"
        )
        print(f"{'pool type':<10} {'sessions':>9} {'vs f16':>7} {'snapshot':>10}")
        for t, row in held.items():
            print(
                f"{t if t != 'same' else 'f16':<10} {row['held']:>9} "
                f"{row['held'] / held.get('same', row)['held']:>6.2f}x "
                f"{row['snapshot_bytes'] / 1e6:>8.2f}MB"
            )

    if args.skip_speed:
        write(args.json, results)
        return
    restore = restore_vs_prefill(path, args.tokens, args.repeat)
    results["restore"] = restore
    print(f"\nRestoring {args.tokens} tokens vs computing them again (median of {args.repeat}, alternating)")
    print(f"{'stored as':<10} {'snapshot':>10} {'restore ms':>11} {'prefill / restore':>18}")
    for t in [*POOL_TYPES, "prefill"]:
        row = restore[t]
        label = t if t != "same" else "f16"
        print(f"{label:<10} {row['bytes'] / 1e6:>8.2f}MB {1e3 * row['seconds']:>11.1f} {row['vs_prefill']:>17.1f}x")

    if args.skip_decode:
        write(args.json, results)
        return
    text = corpus()
    prompts = [session_text(text, 100 + i, 300) for i in range(STREAMS)]
    speeds: dict[str, list[float]] = {t: [] for t in HOT_TYPES}
    for _ in range(args.repeat):
        for t in HOT_TYPES:
            speeds[t].append(decode_speed(path, t, prompts))
    decode = {t: statistics.median(v) for t, v in speeds.items()}
    results["decode"] = decode
    print(
        f"\nDecode tokens/s, {STREAMS} streams, {DECODE_TOKENS} greedy tokens each "
        f"(median of {args.repeat}, alternating)"
    )
    print(f"{'hot K+V':<8} {'tok/s':>7} {'vs f16':>7}")
    for t, v in decode.items():
        print(f"{t:<8} {v:>7.1f} {v / decode['f16']:>6.2f}x")
    write(args.json, results)


def write(path: Path, results: dict[str, object]) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
