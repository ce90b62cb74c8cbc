"""What KV compression costs in quality, on the default model, against its all-f16 run.

A fixed English text shipped with Python (pydoc_data.topics) is fed in turns of --turn tokens; after every turn
each configuration hibernates and restores its sequence through the path a daemon uses (llama.cpp's sequence
state, compressed to the pool's type and written back at the hot types by kvpool's codec), so a compressed
snapshot is what the next turn really reads. Every position after the first turn is scored: the next-token
distribution of each configuration against the reference (f16 K and V, flash attention on, the default):
mean KL divergence, top-1 agreement, and the perplexity of the text. The noise floor is measured in the same
run: llama.cpp's other f16 attention path (flash attention off) against the reference.

    python bench/kv_quality.py [--model PATH] [--positions 2048] [--turn 256]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model  # noqa: E402

from kvpool.daemon.kv.codec.kv_types import StoreType, coding_named  # noqa: E402
from kvpool.daemon.kv.codec.state_format import parse  # noqa: E402
from kvpool.daemon.kv.codec.tier_codec import TierCodec  # noqa: E402
from kvpool.daemon.llama.kv_sensitivity import ScoringModel, log_softmax, text_tokens  # noqa: E402
from kvpool.daemon.llama.kv_settings import resolve_kv_settings  # noqa: E402
from kvpool.daemon.llama.memory_plan import model_shape  # noqa: E402
from kvpool.daemon.llama.model import Model  # noqa: E402


@dataclass
class Setup:
    name: str
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"
    pool: str = "same"  # the type each turn's snapshot is stored at between turns
    k_layers: dict[int, str] = field(default_factory=dict)  # the j-th K layer of the state at its own coding
    # A recent window, emulated: the last `cells` rows of these K layers as they come back from `coding` instead
    # (the codec stores a layer at one coding; this measures what a split layer would give, its bytes counted)
    recent: tuple[int, str, frozenset[int]] | None = None
    model: Model | None = None
    codec: TierCodec | None = None
    kld: list[np.ndarray] = field(default_factory=list)
    agree: list[np.ndarray] = field(default_factory=list)
    nll: list[np.ndarray] = field(default_factory=list)
    snapshot_bytes: int = 0


SETUPS = [
    Setup("reference: f16, flash attention"),
    Setup("noise floor: f16, flash attention off", flash_attn="off"),
    Setup("hot q8_0 K + V", "q8_0", "q8_0"),
    Setup("hot q8_0 K, f16 V", "q8_0", "f16"),
    Setup("hot q4_0 K + V", "q4_0", "q4_0"),
    Setup("pool q8_0 (hot f16)", pool="q8_0"),
    Setup("pool q4_0 (hot f16)", pool="q4_0"),
    Setup("hot q8_0, pool q4_0", "q8_0", "q8_0", pool="q4_0"),
    # The snapshot codec's other types and its rotation (h: codec/rotation.py), K/V apart (docs/kv-compression.md)
    *(Setup(f"pool {t} (hot f16)", pool=t) for t in ("q8_0h", "q5_1", "q5_1h", "q5_0", "q5_0h", "q4_1", "q4_1h")),
    *(Setup(f"pool {t} (hot f16)", pool=t) for t in ("q4_0h", "mxfp4", "mxfp4h")),
    *(Setup(f"pool {t} (hot f16)", pool=t) for t in ("q8_0h/q4_0h", "q4_0h/q8_0h", "q5_0h/q4_0h", "q5_1h/q4_0h")),
    *(Setup(f"pool {t} (hot f16)", pool=t) for t in ("q4_0h/mxfp4h", "q4_1h/q4_0h")),
    # K holds the precision (above): V lower still, K at 8 or 5 bits
    *(Setup(f"pool {t} (hot f16)", pool=t) for t in ("q8_0/q4_0", "q8_0/q4_0h", "q8_0h/tq2_0h", "q8_0/tq2_0")),
    *(Setup(f"pool {t} (hot f16)", pool=t) for t in ("q8_0h/tq1_0h", "q5_1/q4_0h", "q5_1/tq2_0h", "q8_0/mxfp4")),
]


def hibernate_and_restore(s: Setup) -> None:
    m, codec = s.model, s.codec
    assert m is not None and codec is not None
    size = m.state_size(0)
    buffer = (ctypes.c_uint8 * size)()
    assert m.save_state(0, buffer) == size
    state = bytes(buffer)
    if codec.pool_type is not None:
        to = codec.pool_type
        if s.k_layers:
            to = to.with_k_layers({j: coding_named(t) for j, t in s.k_layers.items()})
        stored = codec.compress(state, to)
        assert stored is not None
        s.snapshot_bytes = len(stored)
        restored = codec.to_hot(stored)
        if s.recent is not None:
            restored = with_recent_window(codec, state, to, stored, restored, s)
        state = restored
    else:
        s.snapshot_bytes = size
    m.forget_sequence(0)
    assert m.load_state(0, (ctypes.c_uint8 * len(state)).from_buffer_copy(state))


def with_recent_window(
    codec: TierCodec, state: bytes, to: StoreType, stored: bytearray, restored: bytearray, s: Setup
) -> bytearray:
    """``restored`` (``stored`` written back) with the rows of the window's K layers whose cells hold the newest
    positions as they come back from the window's coding, and ``s.snapshot_bytes`` grown by what storing those rows
    so costs over ``to``'s codings."""
    assert s.recent is not None
    cells, name, layers = s.recent
    hi = coding_named(name)
    stored_hi = codec.compress(state, to.with_k_layers({**dict(to.k_layers), **dict.fromkeys(layers, hi)}))
    assert stored_hi is not None
    back = codec.to_hot(stored_hi)
    from_hi = [x for x in parse(back).layers if x.kind == "k"]
    lo = [x for x in parse(stored).layers if x.kind == "k"]
    out = [x for x in parse(restored).layers if x.kind == "k"]
    for j in sorted(layers):
        a, b = out[j], from_hi[j]
        assert a.positions is not None and a.row_bytes == b.row_bytes
        newest = np.argsort(a.positions, kind="stable")[-cells:]  # (a window layer reuses its cells)
        rows = np.frombuffer(restored, np.uint8, a.n_rows * a.row_bytes, a.data_offset).reshape(a.n_rows, -1)
        better = np.frombuffer(back, np.uint8, b.n_rows * b.row_bytes, b.data_offset).reshape(b.n_rows, -1)
        rows[newest] = better[newest]
        s.snapshot_bytes += len(newest) * (hi.kv_type.row_bytes(a.n_cols) - lo[j].row_bytes)
    return restored


def plot(results: Path) -> None:
    """The frontier: each setup's snapshot bytes per token against its KLD (x the noise floor) and its top-1, the
    floor marked (needs the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install 'kvpool[bench]')", file=sys.stderr)
        return
    data = json.loads(results.read_text())
    rows = data["rows"][1:]  # the reference against itself is 0
    floor = rows[0]
    fig, (kld, top1) = plt.subplots(1, 2, figsize=(13, 5.5))
    for r in rows:
        per_token = r["snapshot_bytes"] / data["tokens"] / 1024
        hot = r["setup"].startswith("hot")
        for ax, y in ((kld, r["kld"] / floor["kld"]), (top1, 100 * r["top1"])):
            ax.scatter(per_token, y, color="tab:orange" if hot else "tab:blue", s=18)
            ax.annotate(r["setup"].split(" (")[0].removeprefix("pool "), (per_token, y), fontsize=6)
    kld.axhline(1.0, color="gray", linestyle="--", label="noise floor")
    kld.axhline(1.5, color="tab:green", linestyle=":", label="1.5x floor")
    kld.set_yscale("log")
    kld.set_ylabel("mean KLD vs f16, x the noise floor (log)")
    top1.axhline(100 * floor["top1"], color="gray", linestyle="--")
    top1.axhline(100 * floor["top1"] - 1, color="tab:green", linestyle=":", label="floor - 1 point")
    top1.set_ylabel("top-1 agreement with f16 (%)")
    for ax in (kld, top1):
        ax.set_xlabel("snapshot KiB per token (pool setups blue, hot orange)")
        ax.legend(fontsize=7)
    fig.suptitle("KV snapshot types on the default model: bytes against quality (bench/kv_quality.py)")
    fig.tight_layout()
    fig.savefig(results.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--positions", type=int, default=2048, help="scored positions (after the first turn)")
    ap.add_argument("--turn", type=int, default=256, help="tokens per turn (a snapshot round trip after each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=HERE / "out" / "kv_quality.json")
    ap.add_argument("--only", nargs="*", default=None, help="setups whose name holds one of these (and the floor)")
    ap.add_argument(
        "--k-layers",
        metavar="TYPE",
        help="instead: each K layer alone at TYPE over --base (how much each layer's K matters)",
    )
    ap.add_argument(
        "--profiles",
        nargs="*",
        metavar="LOW:J,J,..[+CELLS:CODING:J,J,..]",
        help="instead: --base with every K layer at LOW but those listed (their K at --base's); after a +, a recent "
        "window, emulated: the last CELLS rows of the K layers listed as CODING gives them back",
    )
    ap.add_argument("--base", default="q8_0/q4_0h", help="the store type --k-layers and --profiles start from")
    args = ap.parse_args()
    if args.only:
        SETUPS[2:] = [s for s in SETUPS[2:] if any(word in s.name for word in args.only)]
    n_layer = model_shape(Path(default_model(args.model))).n_layer
    if args.k_layers:
        SETUPS[2:] = [Setup(f"pool {args.base}", pool=args.base)] + [
            Setup(f"{args.base}, K#{j} {args.k_layers}", pool=args.base, k_layers={j: args.k_layers})
            for j in range(n_layer)
        ]
    if args.profiles is not None:
        SETUPS[2:] = [Setup(f"pool {args.base}", pool=args.base)]
        for spec in args.profiles:
            profile, _, window = spec.partition("+")
            low, _, kept = profile.partition(":")
            keep = {int(j) for j in kept.split(",") if j}
            lowered = {j: low for j in range(n_layer) if j not in keep}
            recent = None
            if window:
                cells, coding, layers = window.split(":")
                recent = (int(cells), coding, frozenset(int(j) for j in layers.split(",")))
            name = f"K {low} but #{kept or '-'}" + (f", last {cells} of #{layers} {coding}" if window else "")
            SETUPS.append(Setup(name, pool=args.base, k_layers=lowered, recent=recent))
    path = Path(default_model(args.model))
    shape = model_shape(path)
    total = args.turn + args.positions + 1
    for s in SETUPS:
        kv, _ = resolve_kv_settings(s.type_k, s.type_v, s.flash_attn, shape.head_k, shape.head_v)
        s.model = ScoringModel(
            path, context_size=total + 256, hot_slots=1, batch_size=args.turn, threads=args.threads, kv=kv
        )
        s.codec = TierCodec(kv, s.pool, "always", "same")
    ref = SETUPS[0]
    assert ref.model is not None
    tokens = text_tokens(ref.model, total)
    started = time.perf_counter()
    for first in range(0, total - 1, args.turn):
        chunk = tokens[first : min(first + args.turn, total - 1)]
        targets = np.asarray(tokens[first + 1 : first + 1 + len(chunk)])
        ref_logp: np.ndarray | None = None
        for s in SETUPS:
            m = s.model
            assert m is not None
            m.batch.clear()
            m.batch.add(0, chunk, first, outputs=True)
            m.batch.logits[: len(chunk)] = 1  # every position scored (ScoringModel sized its outputs for it)
            assert m.decode() == 0, f"{s.name}: decode failed"
            logp = log_softmax(m.output_logits(len(chunk)).astype(np.float32))
            if s is ref:
                ref_logp = logp
            if first >= args.turn:  # the first turn only builds the context
                assert ref_logp is not None
                p = np.exp(ref_logp)
                s.kld.append((p * (ref_logp - logp)).sum(axis=1))
                s.agree.append(logp.argmax(axis=1) == ref_logp.argmax(axis=1))
                s.nll.append(-logp[np.arange(len(chunk)), targets])
            hibernate_and_restore(s)
        print(f"  {first + len(chunk)}/{total - 1} tokens ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    floor = SETUPS[1]
    floor_kld = float(np.concatenate(floor.kld).mean())
    floor_top1 = float(np.concatenate(floor.agree).mean())
    scored = sum(len(x) for x in ref.kld)
    print(
        f"\nKV quality on {path.name}: {scored} scored positions of pydoc_data.topics, a snapshot round trip every "
        f"{args.turn} tokens; against f16 with flash attention (noise floor = flash attention off)"
    )
    print(f"{'setup':<56} {'snapshot':>10} {'vs f16':>7} {'mean KLD':>9} {'x floor':>8} {'top-1':>7} {'ppl':>8}")
    rows = []
    for s in SETUPS:
        kld = float(np.concatenate(s.kld).mean())
        top1 = float(np.concatenate(s.agree).mean())
        ppl = float(np.exp(np.concatenate(s.nll).mean()))
        ratio = ref.snapshot_bytes / s.snapshot_bytes
        x_floor = kld / floor_kld if floor_kld else float("nan")
        print(
            f"{s.name:<56} {s.snapshot_bytes / 1e6:>8.2f}MB {ratio:>6.2f}x {kld:>9.4f} {x_floor:>8.2f} "
            f"{100 * top1:>6.1f}% {ppl:>8.3f}"
        )
        rows.append({"setup": s.name, "snapshot_bytes": s.snapshot_bytes, "kld": kld, "top1": top1, "ppl": ppl})
    print(
        "\nTargets: q8_0 (hot or pool) within 1.5x the floor's KLD and its top-1 within 1 point of the floor's "
        f"({100 * floor_top1:.1f}%); >= 3x f16's bytes at <= 1.5x the floor's KLD with top-1 within 1 point; "
        ">= 4x at <= 3x the floor's KLD."
    )
    for label, least, most_kld, top1_points in (("3x", 3.0, 1.5, 1.0), ("4x", 4.0, 3.0, 100.0)):
        met = [
            r["setup"]
            for r in rows
            if ref.snapshot_bytes / r["snapshot_bytes"] >= least
            and r["kld"] <= most_kld * floor_kld
            and 100 * (floor_top1 - r["top1"]) <= top1_points
        ]
        print(f"  {label}: {', '.join(met) if met else 'no setup'}")
    args.json.parent.mkdir(exist_ok=True)
    summary = {"scored": scored, "turn": args.turn, "tokens": total - 1, "rows": rows}
    args.json.write_text(json.dumps(summary, indent=2))
    plot(args.json)
    for s in SETUPS:
        if s.model is not None:
            s.model.close()


if __name__ == "__main__":
    main()
