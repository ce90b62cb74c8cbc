"""kvpool-kv-profile: measure a model's precision profile for its compressed tiers and write it beside the model.

Every K layer is lowered alone from the base coding to a lower one and the cost in KL divergence measured
(kv_sensitivity.py); the layers that cost least per byte saved are lowered together while the sum of their costs
stays within the quality asked for (a multiple of the noise floor), then the chosen profile is measured as a whole:
layers are given back, the costliest first, until it holds, then the next cheapest are lowered one by one while it
still holds. The daemon uses the file with
``pool_kv_type = "profile"`` (or ``spill_kv_type``) and refuses it for any other model.

    kvpool-kv-profile [--model PATH] [--out PATH] [--base q8_0/q4_0h] [--low q5_1] [--most-kld 1.5]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvpool.daemon.kv.codec.kv_types import RowCoding, StoreType, coding_named
from kvpool.daemon.kv.codec.precision_profile import (
    FORMAT,
    Measured,
    PrecisionProfile,
    beside,
    by_price,
    choose_lowered,
    write_profile,
)
from kvpool.daemon.llama.default_model import ModelNotFound, resolve_model_path
from kvpool.daemon.llama.gguf_meta import GgufError
from kvpool.daemon.llama.kv_sensitivity import Score, SensitivityMeter
from kvpool.daemon.llama.model.loading import ModelLoadError, fingerprint
from kvpool.daemon.locations import appendable

RETRIES = 6  # profiles measured while giving layers back, and again while lowering more


def _at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}")
        return value

    return parse


def _share(text: str) -> float:
    """A finite number of at least 0 (a multiple, or points)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number of at least 0")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvpool-kv-profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="the GGUF file (default: the default model)")
    ap.add_argument("--out", type=Path, default=None, help="where to write it (default: MODEL.gguf.kvprofile.json)")
    ap.add_argument("--base", default="q8_0/q4_0h", help="K/V codings to start from (sensitive K layers keep K's)")
    ap.add_argument("--low", default="q5_1", help="the coding the other K layers are lowered to")
    ap.add_argument("--most-kld", type=_share, default=1.5, help="the KLD allowed, as a multiple of the noise floor's")
    ap.add_argument("--top1-points", type=_share, default=1.0, help="top-1 agreement allowed below the floor's")
    ap.add_argument("--context", type=_at_least(1), default=1024, help="tokens of context before each scored part")
    ap.add_argument("--score", type=_at_least(1), default=128, help="positions scored after each context")
    ap.add_argument("--windows", type=_at_least(1), default=6, help="windows of text (context + scored part)")
    ap.add_argument("--threads", type=_at_least(1), default=os.cpu_count() or 1)
    ap.add_argument("--text", type=Path, default=None, help="a text file to score (default: Python's pydoc topics)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model_path = resolve_model_path(args.model)
        base = StoreType.named(args.base)
        low = coding_named(args.low)
        text = args.text.read_text(encoding="utf-8") if args.text else None
    except (ModelNotFound, GgufError, ValueError, OSError) as exc:
        print(f"kvpool-kv-profile: {exc}", file=sys.stderr)
        return 2
    out = args.out or beside(model_path)
    if not appendable(out):  # (found before the measurement, which takes minutes, not after it)
        print(f"kvpool-kv-profile: cannot write {out}; name a writable file with --out", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        meter = SensitivityMeter(
            model_path, context=args.context, score=args.score, windows=args.windows, threads=args.threads, text=text
        )
    except (ValueError, ModelLoadError, GgufError) as exc:  # (a text too short for the windows; a file not a model)
        print(f"kvpool-kv-profile: {exc}", file=sys.stderr)
        return 2
    try:
        profile = measure_profile(meter, model_path, base, low, args.most_kld, args.top1_points / 100)
    finally:
        meter.close()
    try:
        write_profile(profile, out)
    except OSError as exc:
        print(f"kvpool-kv-profile: cannot write {out} ({exc}); name a writable file with --out", file=sys.stderr)
        return 1
    print(f"\n{out}: {profile.describe()} ({time.perf_counter() - started:.0f} s)")
    return 0


def lowered_type(base: StoreType, low_k: StoreType, keep: set[int], n_k: int) -> StoreType:
    """K at ``low_k``'s coding but the layers in ``keep``, which keep the base's."""
    return StoreType(low_k.k, base.v).with_k_layers({j: base.k for j in sorted(keep) if j < n_k})


def measure_profile(
    meter: SensitivityMeter, model_path: Path, base: StoreType, low: RowCoding, most_kld: float, top1_drop: float
) -> PrecisionProfile:
    low_k = StoreType(low, low)
    floor, scores = meter.measure([base])
    layers = meter.k_layers()
    n_k = len(layers)
    singles = [StoreType(base.k, base.v).with_k_layers({j: low_k.k}) for j in range(n_k)]
    _, single_scores = meter.measure(singles)
    base_score = scores[0]
    f16_bytes, base_bytes = meter.stored_bytes(None), meter.stored_bytes(base)
    saving = {j: base_bytes - meter.stored_bytes(t) for j, t in enumerate(singles)}
    layer_kld = {j: s.mean_kld for j, s in enumerate(single_scores)}
    report_layers(floor, base_score, layer_kld, single_scores, layers, saving)
    limit = most_kld * floor.mean_kld

    def trial(lowered: list[int]) -> tuple[StoreType, Score, bool]:
        candidate = lowered_type(base, low_k, set(range(n_k)) - set(lowered), n_k)
        _, (candidate_score,) = meter.measure([candidate])
        holds = candidate_score.mean_kld <= limit and candidate_score.top1 >= floor.top1 - top1_drop
        print(
            f"  K {low_k.k.name} on {len(lowered)} of {n_k} layers: {candidate_score.mean_kld / floor.mean_kld:.2f}x "
            f"the floor, top-1 {100 * candidate_score.top1:.1f} % ({'holds' if holds else 'too far'})",
            file=sys.stderr,
        )
        return candidate, candidate_score, holds

    lowered = choose_lowered(base_score.mean_kld, layer_kld, saving, limit)
    chosen, score, held = base, base_score, False
    # Lowering several layers costs less than the sum of their costs alone (measured: docs/kv-compression.md), so
    # the summed choice is measured whole: give back the costliest while it is too far, then, once it holds, lower
    # the next cheapest per byte while it still holds.
    for _ in range(RETRIES):
        if not lowered:
            break
        candidate, candidate_score, held = trial(lowered)
        if held:
            chosen, score = candidate, candidate_score
            break
        lowered.remove(max(lowered, key=lambda j: layer_kld[j]))
    cheapest = by_price(base_score.mean_kld, layer_kld, saving)
    for j in [j for j in cheapest if j not in lowered][: RETRIES if held else 0]:
        candidate, candidate_score, grows = trial([*lowered, j])
        if grows:
            lowered.append(j)
            chosen, score = candidate, candidate_score
    return PrecisionProfile(
        kvpool_kv_profile=FORMAT,
        model=model_path.name,
        fingerprint=fingerprint(model_path),
        k=chosen.k.name,
        v=chosen.v.name,
        k_layers={j: c.name for j, c in chosen.k_layers},
        measured=Measured(
            positions=meter.positions,
            context=meter.context,
            floor_kld=floor.mean_kld,
            floor_top1=floor.top1,
            kld=score.mean_kld,
            top1=score.top1,
            vs_f16=f16_bytes / meter.stored_bytes(chosen),
            base_kld=base_score.mean_kld,
            lowered=low_k.k.name,
            layer_kld=layer_kld,
            layer_saving=saving,
        ),
    )


def report_layers(
    floor: Score,
    base: Score,
    layer_kld: dict[int, float],
    singles: list[Score],
    layers: list[tuple[int, int]],
    saving: dict[int, int],
) -> None:
    f = floor.mean_kld
    print(f"noise floor: KLD {f:.5f}, top-1 {100 * floor.top1:.1f} %; base: {base.mean_kld / f:.2f}x the floor")
    print(f"{'K layer':>7} {'cells':>6} {'x floor lowered alone':>22} {'top-1':>7} {'saves':>9}")
    for j, ((cells, _), s) in enumerate(zip(layers, singles, strict=True)):
        print(f"{j:>7} {cells:>6} {layer_kld[j] / f:>22.2f} {100 * s.top1:>6.1f}% {saving[j] / 1024:>7.0f}KiB")


if __name__ == "__main__":
    raise SystemExit(main())
