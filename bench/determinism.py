"""Where a sequence's logits stop being its own: the experiments behind docs/determinism.md, on this CPU.

Each experiment decodes sequence A (a fixed prompt, then greedy tokens) once as the reference, then again under
one change that should not concern A (other rows in the batch, a prompt chunk of another sequence beside it, a
lone row over a long context, its cells after a hole), and reports the largest |difference| of A's logits and
whether its tokens stayed the same. Each setting (weight repacking, llama.cpp's tiled K-quant matmul) runs in a
process of its own: ggml reads GGML_CPU_TILED_MM once per process.

    python bench/determinism.py [--model PATH] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

PROMPT = "Once upon a time, in a small village by the sea, there lived"
FILLER = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill"
CHUNK = 8  # the sequence id of another sequence's prompt chunk; 1..CHUNK-1 decode beside A
SETTINGS = {  # name: (cpu repack, GGML_CPU_TILED_MM)
    "repack on, tiled on": (True, "1"),
    "repack off, tiled on": (False, "1"),
    "repack on, tiled off": (True, "0"),
    "repack off, tiled off": (False, "0"),
}


EXPERIMENTS = {
    "A beside 1 other row": {"extra_rows": 1},
    "A beside 3 other rows": {"extra_rows": 3},
    "A beside 4 other rows": {"extra_rows": 4},
    "A beside 7 other rows (8 in all)": {"extra_rows": 7},
    "A beside a 7-token prompt chunk": {"chunk_beside": 7},
    "A beside a 31-token prompt chunk": {"chunk_beside": 31},
    "A beside a 62-token prompt chunk (63 rows)": {"chunk_beside": 62},
    "A beside a 63-token prompt chunk (64 rows)": {"chunk_beside": 63},
    "A's next cells after a hole": {"hole": True},
}
LONG = "long context: A alone vs beside 1 row"


def run_setting(model_path: str, repack: bool, steps: int, lone_threads: int) -> dict[str, tuple[int, float, bool]]:
    from kvpool.daemon.llama.model import Model

    class LoneThreadsModel(Model):
        """llama.cpp runs a one-token batch on n_threads, any other on n_threads_batch: this sets the first."""

        def tune_context(self, params) -> None:  # type: ignore[no-untyped-def]
            if lone_threads:
                params.n_threads = lone_threads

    m = LoneThreadsModel(Path(model_path), context_size=4096, hot_slots=CHUNK + 1, batch_size=512, threads=2,
                         repack=repack)  # fmt: skip
    a_tokens = m.tokenize(PROMPT, add_bos=True)
    filler = m.tokenize(FILLER, add_bos=True)

    def decode_a(extra_rows: int = 0, chunk_beside: int = 0, long_context: int = 0, hole: bool = False) -> np.ndarray:
        """A's logits over ``steps`` greedy steps; other sequences as asked. Leaves the KV empty."""
        seqs = list(range(1, CHUNK))
        if hole:  # B takes cells, then leaves: its cells become a hole before A's next tokens
            m.batch.clear()
            m.batch.add(CHUNK, filler[:24], 0, False)
            assert m.decode() == 0
        m.batch.clear()
        row = m.batch.add(0, a_tokens, 0, True)
        assert m.decode() == 0
        pos_a = len(a_tokens)
        current = m.row_logits(row).copy()
        if hole:
            m.forget_sequence(CHUNK)
        if long_context:  # other sequences fill cells after A's: n_kv (the cells attended) passes 512
            for s in seqs[:2]:
                m.batch.clear()
                m.batch.add(s, (filler * 40)[: long_context // 2], 0, False)
                assert m.decode() == 0
        out = []
        filler_pos = {s: (long_context // 2 if long_context and s in seqs[:2] else 0) for s in seqs}
        for _ in range(steps):
            out.append(current)
            token = int(current.argmax())
            m.batch.clear()
            row = m.batch.add(0, [token], pos_a, True)
            for s in seqs[:extra_rows]:
                m.batch.add(s, [filler[filler_pos[s] % len(filler)]], filler_pos[s], True)
                filler_pos[s] += 1
            if chunk_beside:
                m.batch.add(CHUNK, (filler * 4)[:chunk_beside], 0, False)
            assert m.decode() == 0
            if chunk_beside:
                m.forget_sequence(CHUNK)
            pos_a += 1
            current = m.row_logits(row).copy()
        for s in range(CHUNK + 1):
            m.forget_sequence(s)
        return np.stack(out)

    def compare(other: np.ndarray, reference: np.ndarray) -> tuple[int, float, bool]:
        """(first step whose logits differ, or -1; the largest |difference| at that step; tokens all equal)."""
        differs = [i for i in range(len(reference)) if not np.array_equal(other[i], reference[i])]
        first = differs[0] if differs else -1
        delta = float(np.abs(other[first] - reference[first]).max()) if differs else 0.0
        return first, delta, bool((other.argmax(1) == reference.argmax(1)).all())

    results: dict[str, tuple[int, float, bool]] = {}
    reference = decode_a()
    for name, kwargs in EXPERIMENTS.items():
        results[name] = compare(decode_a(**kwargs), reference)
    # A lone row over a long context (n_kv >= 512: one-token flash attention splits the cells across threads)
    # against the same row beside one other.
    results[LONG] = compare(decode_a(long_context=700), decode_a(long_context=700, extra_rows=1))
    m.close()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        repack, lone = json.loads(args.child)
        print(json.dumps(run_setting(args.model, repack, args.steps, lone)))
        return 0
    if not args.model:
        from kvpool.daemon.llama.default_model import resolve_model_path

        args.model = str(resolve_model_path(""))
    table: dict[str, dict[str, tuple[int, float, bool]]] = {}
    runs = [(name, repack, tiled, 0) for name, (repack, tiled) in SETTINGS.items()]
    runs.append(("repack off, tiled off, lone rows on 1 thread", False, "0", 1))
    for name, repack, tiled, lone in runs:
        env = {**os.environ, "GGML_CPU_TILED_MM": tiled}
        done = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps), "--child",
             json.dumps([repack, lone])],
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
        table[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"Sequence A over {args.steps} greedy steps, against A alone: the first step whose logits differ (-: none),")
    print("the largest |difference| of its logits there, and * when A's tokens changed.\n")
    print(f"{'experiment':<46}" + "".join(f"{name:>34}" for name in table))
    for experiment in [*EXPERIMENTS, LONG]:
        cells = []
        for name in table:
            first, delta, same = table[name][experiment]
            cell = "-" if first < 0 else f"step {first}: {delta:.3g}{'' if same else ' *'}"
            cells.append(f"{cell:>34}")
        print(f"{experiment:<46}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
