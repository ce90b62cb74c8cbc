"""How fast guesses from a session's own tokens could make bench/speculative.py's answers, at best, on this CPU, at
1, 4 and 8 streams; and, with a llama-server beside it, where bench/speculative.py's targets lie against that.

Every step samples one token that no guess gave (the token after the last one taken), so an answer needs at least
one step for each of its tokens that the guess made from the context just before it does not start with: a
record's new value, a word the prompt does not have. This answers each prompt of bench/speculative.py greedily
without guesses, replays the guesser (engine/drafts.py) over each answer, with what the answer's grammar forces
next as a guess too (engine/jumps.py, as jump_forward = "guess" feeds it), and marks those tokens (U per answer).

Then it decodes the answers' steps as they would go if every other token were guessed, and every guess ran right
up to the next token in U: each step, every stream feeds its token and as many guessed rows as its run has, within
draft_tokens a session and --draft-step-rows a step (the daemon's defaults), and samples its run and the token
after it. Each step's time is measured on this CPU, not modelled: the model is loaded here and a step of that many
sequences and rows (each row with its logits, as guesses are fed) is decoded over the workload's prompts and half
their answers. The ceiling is bench/speculative.py's measure of that schedule: the sum over the streams of each
one's tokens after its first over its time from its first to its last. It leaves out everything else a real step
has: sampling and the grammar, the daemon's and the client's own work between steps (on the same cores), and other
streams' prompts computed while a stream decodes. So it is a ceiling: a target above it lies past what any guessing
from these tokens can give on this CPU at that step size; below it, the gap is those costs and guesses priced under
uncertainty (rows refused, and right guesses not fed because their figures did not pay).

Columns: "no guesses" is the same schedule with one row a stream a step (kvpool without speculation, at best);
"measured" is kvpool without speculation as bench/speculative.py measures it, in this run; "scaled" is the ceiling
times the share of its ideal schedule kvpool without speculation reached (an estimate: what the ceiling leaves out,
taken to cost guesses the same share). With a llama-server (scripts/build-llama-server.sh) it also runs
llama-server on the same prompts, without drafts and with each of its n-gram draft settings (bench/speculative.py's),
afresh for each cell, beside the targets: 1.5x it without drafts, 1.2x its best draft setting.

    python bench/guess_ceiling.py [--streams 1 4 8] [--prompts 8] [--tokens 128] [--rounds 2] [--no-anchors]
                                  [--draft-step-rows 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import speculative as sp
from anchors import llama_server_binary
from common import default_model, prefill, private_daemon, timed_decode

from kvpool.daemon.config import Config
from kvpool.daemon.engine.drafts import Drafter
from kvpool.daemon.engine.jumps import CONTEXT_TOKENS, JUMP_BYTES, forced_after
from kvpool.daemon.llama.constraints import parse_schema
from kvpool.daemon.llama.model import Grammar, Model, SamplingParams, json_schema_grammar

MOST = 64  # tokens per guess (its length does not matter to its first token)
REPEAT = 5  # decodes per step shape measured (the median counts)


def unguessed(model: Model, prompt: list[int], answer: list[int], schema: object | None) -> set[int]:
    """The indices of the answer's tokens that neither the n-gram guess from the context just before each nor the
    text its grammar forces there starts with."""
    tokens = list(prompt)
    drafter = Drafter(tokens, Config().draft_ngram, MOST, model.is_end_of_generation)
    grammar = Grammar(json_schema_grammar(parse_schema(json.dumps(schema)))) if schema is not None else None
    sampler = model.new_sampler(SamplingParams(temperature=0.0, grammar=grammar), tokens) if grammar else None
    out: set[int] = set()
    try:
        for i, token in enumerate(answer):
            guess = drafter.guess()
            forced: list[int] = []
            if sampler is not None and i:
                forced = forced_after(answer[max(0, i - CONTEXT_TOKENS) : i], sampler.forced(JUMP_BYTES), model)
            if not (guess and guess[0] == token) and not (forced and forced[0] == token):
                out.add(i)
            if sampler is not None:
                sampler.take(token)
            tokens.append(token)
    finally:
        if sampler is not None:
            sampler.free()
    return out


class StepTimes:
    """A decode step's time on this CPU for ``sequences`` sequences and ``guessed`` guessed rows spread evenly over
    them (each row with its logits), measured once per shape, each sequence holding its prompt and the first half of
    its answer (attention's cost grows with the cells held)."""

    def __init__(self, model: Model, prompts: list[list[int]]):
        self.model, self.prompts = model, prompts
        self._seconds: dict[tuple[int, int], float] = {}
        for seq, prompt in enumerate(prompts):
            prefill(model, seq, prompt)

    def __call__(self, sequences: int, guessed: int) -> float:
        key = (sequences, guessed)
        if key not in self._seconds:
            self._seconds[key] = statistics.median(self._decode(sequences, guessed) for _ in range(REPEAT))
        return self._seconds[key]

    def _decode(self, sequences: int, guessed: int) -> float:
        batch = []
        for seq in range(sequences):
            rows = 1 + guessed // sequences + (1 if seq < guessed % sequences else 0)
            prompt = self.prompts[seq]
            batch.append((seq, prompt[-rows:], len(prompt), rows))
        return timed_decode(self.model, batch)


def decode_rate(
    answers: list[tuple[int, set[int]]], step: Callable[[int, int], float], guessing: bool, step_rows: int
) -> float:
    """bench/speculative.py's decode rate of answers (their length, their unguessed indices) decoded together, each
    from its first token on (the prompt's step gave it), by steps of ``step(sequences, guessed rows)`` seconds: with
    ``guessing``, each stream's run of guessable tokens fed as guessed rows (within draft_tokens a stream and
    ``step_rows`` a step, shared out evenly), all of them right; else one token a stream a step."""
    config = Config()
    done = [1] * len(answers)  # tokens each stream has (the first came with its prompt)
    finished = [0.0] * len(answers)
    clock = 0.0
    while active := [i for i, (n, _) in enumerate(answers) if done[i] < n]:
        wants = {i: _run(answers[i], done[i], config.draft_tokens) if guessing else 0 for i in active}
        rows = _share(wants, step_rows)
        clock += step(len(active), sum(rows.values()))
        for i in active:
            done[i] = min(answers[i][0], done[i] + 1 + rows[i])
            finished[i] = clock
    return sum((n - 1) / finished[i] for i, (n, _) in enumerate(answers) if n > 1)


def _run(answer: tuple[int, set[int]], done: int, most: int) -> int:
    """Guessable tokens after the one this step samples (index ``done``): up to the next unguessed one."""
    n, unguessed = answer
    run = 0
    while done + 1 + run < n and done + 1 + run not in unguessed and run < most:
        run += 1
    return run


def _share(wants: dict[int, int], most: int) -> dict[int, int]:
    """Rows for each stream's want, ``most`` in all, shared out one at a time round the streams."""
    rows = dict.fromkeys(wants, 0)
    left = most
    while left and any(rows[i] < wants[i] for i in wants):
        for i in wants:
            if left and rows[i] < wants[i]:
                rows[i] += 1
                left -= 1
    return rows


def median_rate(server: sp.Server, workload: str, streams: int, tokens: int, rounds: int) -> float:
    """bench/speculative.py's decode rate of a cell, the median over ``rounds``, the server afresh for each."""
    runs = []
    for _ in range(rounds):
        with server.fresh():
            runs.append(sp.run_streams(server, workload, streams, tokens).rate)
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (bench/speculative.py's streams)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=2, help="runs of each measured cell (the median counts)")
    ap.add_argument("--workloads", nargs="+", default=list(sp.WORKLOADS), choices=list(sp.WORKLOADS))
    ap.add_argument("--llama-server", help="a llama-server binary (default: one scripts/build-llama-server.sh built)")
    ap.add_argument("--no-anchors", action="store_true", help="no llama-server")
    ap.add_argument(
        "--draft-step-rows", type=int, default=Config().draft_step_rows, help="guessed rows a step may hold, at most"
    )
    args = ap.parse_args()
    model_path = default_model(args.model)
    prompts = max([args.prompts, *args.streams])
    cells = [(w, n) for w in args.workloads for n in args.streams]
    answers: dict[str, list[list[int]]] = {}
    measured: dict[tuple[str, int], float] = {}  # kvpool without guesses, as bench/speculative.py measures it
    with private_daemon(model_path, *sp.DAEMON_FLAGS, *sp.WITHOUT_GUESSES) as daemon:
        sp.tokenize_prompts(daemon.address, args.workloads, prompts)
        kvpool = sp.Kvpool("kvpool", daemon.address)
        for w in args.workloads:
            answers[w] = [kvpool.answer(*sp.prompt_of(w, i), args.tokens)[1] for i in range(prompts)]
        for w, n in cells:
            measured[w, n] = median_rate(kvpool, w, n, args.tokens, args.rounds)
    anchor: dict[tuple[str, int], float] = {}  # llama-server without drafts
    drafting: dict[tuple[str, int], float] = {}  # llama-server with its best draft setting for the cell
    binary = None if args.no_anchors else llama_server_binary(args.llama_server)
    if binary:
        for name, flags in sp.ANCHORS.items():
            server = sp.LlamaServer(name, binary, model_path, flags)
            for w, n in cells:
                rate = median_rate(server, w, n, args.tokens, args.rounds)
                if flags:
                    drafting[w, n] = max(drafting.get((w, n), 0.0), rate)
                else:
                    anchor[w, n] = rate
    elif not args.no_anchors:
        print("(no llama-server: build one with scripts/build-llama-server.sh, or pass --llama-server)")
    model = Model(
        Path(model_path), context_size=sp.SLOTS * 2048, hot_slots=sp.SLOTS, batch_size=512, threads=sp.THREADS,
        draft_rows=args.draft_step_rows,
    )  # fmt: skip
    print("\ndecode tokens/s: the ideal schedule's (no guesses, and every guessable token guessed), kvpool without")
    print("guesses as measured, and the ceiling scaled by the share of its ideal schedule kvpool without reached")
    head = f"{'workload':<8} {'streams':>7} {'unguessed':>9} {'no guesses':>10} {'measured':>8}"
    head += f" {'ceiling':>7} {'scaled':>6}"
    if anchor:
        head += f" {'llama-server':>12} {'1.5x it':>7} {'best drafts':>11} {'1.2x it':>7}"
    print(head)
    try:
        for w in args.workloads:
            schema = sp.WORKLOADS[w][1].get("json_schema")
            texts = [sp.PROMPT_TOKENS[sp.prompt_of(w, i)[0]] for i in range(prompts)]
            marked = [(len(a), unguessed(model, p, a, schema)) for p, a in zip(texts, answers[w], strict=True)]
            held = [p + a[: len(a) // 2] for p, a in zip(texts, answers[w], strict=True)]
            steps = StepTimes(model, held[: max(args.streams)])
            for n in args.streams:
                few = [marked[i % prompts] for i in range(n)]
                plain = decode_rate(few, steps, False, 0)
                ceiling = decode_rate(few, steps, True, args.draft_step_rows)
                got = measured[w, n]
                line = (f"{w:<8} {n:>7} {statistics.mean(len(u) for _, u in few):>9.1f} {plain:>10.1f} {got:>8.1f}"
                        f" {ceiling:>7.1f} {ceiling * got / plain:>6.1f}")  # fmt: skip
                if (w, n) in anchor:
                    a, d = anchor[w, n], drafting[w, n]
                    line += f" {a:>12.1f} {1.5 * a:>7.1f} {d:>11.1f} {1.2 * d:>7.1f}"
                print(line, flush=True)
            for seq in range(len(steps.prompts)):
                model.forget_from(seq, 0)
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
