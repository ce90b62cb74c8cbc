"""Predict how long an engine step takes, so the scheduler can size prompt chunks and admission can refuse
a request whose first token cannot arrive within its budget. Pure numpy, no llama.cpp.

A step's time is modelled as linear in eight features: a fixed cost (reading the weights once), the tokens in the
batch, the output rows (each needs the vocabulary projection, large for Gemma's 262k tokens), the attention work
(each token attends to its position's context; in llama.cpp's tiles of several sequences, to all of theirs:
tiled_attention), three of the output rows' kernel: whether there are more than one, whether they are an odd
number past one, and whether they pass a multiple of four by one to three; and the decodes past one a step runs as
(a prompt chunk apart from other sessions' rows, decode_groups.py: each reads the weights once more). The output
rows' three are there because llama.cpp computes one logits row by a vector kernel and several by a matrix kernel
(llamafile's for Q8_0 and Q4_0 weights, as Gemma 3's tied output projection is) whose tiles are two rows wide in
an AVX2 build and four in an AVX-512 one; rows past the last whole tile take a pass of their own over the weights.
On an AMD EPYC (bench/guess_rows.py) an AVX2 build's logits cost 8 ms for one row, 20 for two, 43 for three, 22
for four: a step of three decoding sessions took 51 ms, of four 41 ms. An AVX-512 build of the same llama.cpp
took 32 ms for a step of three logits rows, 37 for four, 56 for five. A cost per row cannot say that; these
features let the fit say it where a build shows it, and come out near zero where it does not.

The coefficients are calibrated by a few synthetic decodes at start and then follow every measured step
(recursive least squares that slowly forgets, so they track thermal throttling). A change of speed within seconds
(a neighbour process taking a core, the thread count following it) is followed at once by a second, fast factor:
how the last few steps' times compared with the fit's predictions, which multiplies the predictions until the fit
has caught up. Admission and the voice task's deadline so use the step times as measured now, not at start.

The fast factor says how the steps under way run. Once no step has run for a while it says less and less, so it
returns towards a slower one (about the last fifty steps) with a half-life of idle time. Without that, a few slow
steps followed by nothing could refuse a voice request, and then every next one: a refused request runs no step
that could show the machine is fast again (seen beside a memory-heavy neighbour: eight turns in a row refused
after one slow turn, with nothing else running).
"""

from __future__ import annotations

import bisect
import copy
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.daemon.llama.decode_groups import decode_groups
from kvpool.protocol.status import CalibrationPoint, CostFit, CostModelStatus

FORGET = 0.995  # weight of the past per update: about the last 200 steps count
SMALL_STEP = 32  # tokens: steps up to this size use the small-step fit
RECENT_WEIGHT = 0.25  # of the latest step in the fast factor: about the last 4 steps count
RECENT_RANGE = (0.2, 10.0)  # one step's measured / predicted is clipped to this before it counts
SETTLED_WEIGHT = 0.02  # of the latest step in the slower factor the fast one returns to: about the last 50 steps
IDLE_HALF_LIFE_S = 0.5  # with no step run for this long, the fast factor is halfway back to the slower one
# A prediction is a sum of products, and whether numpy's dot fuses a multiply-add depends on the CPU: the last bit
# of a prediction differs between machines (0.010 + 140 x 0.001 is 0.15 with FMA, 0.15000000000000002 without).
# Every comparison of a prediction with a limit allows this much, so no decision follows that bit.
TOLERANCE_S = 1e-6
TILE_WIDTHS = (2, 4)  # the logits kernel's tile widths: an AVX2 build's, an AVX-512 one's
FEATURES = 5 + len(TILE_WIDTHS) + 1  # ... and the decodes past one a step runs as (decode_groups.py)
EXTRA_DECODE = FEATURES - 1
PRIOR_VARIANCE = 1e3  # the fit's covariance before any step (a weak prior: any step outweighs it), and its bound after


def within(seconds: float, limit: float) -> bool:
    """Whether a predicted time stays within ``limit``, up to TOLERANCE_S."""
    return seconds <= limit + TOLERANCE_S


def dot(features: np.ndarray, coefficients: np.ndarray) -> float:
    """The prediction's sum of products (one name, so a test can compute it with and without FMA)."""
    return float(features @ coefficients)


@dataclass(frozen=True, slots=True)
class StepShape:
    tokens: int  # tokens fed in the step
    outputs: int  # rows whose logits are needed (one per sampling generation)
    attention: int  # sum over the fed tokens of the context each attends to
    decodes: int = 1  # llama_decode calls the step runs as (decode_groups.py): each reads the weights once

    @staticmethod
    def of(chunks: Sequence[tuple[int, int, int]], tile: int = 0) -> StepShape:
        """One decode of (first position, token count, output rows) per sequence in the step (a bool: one row or
        none), in this order; ``tile``: the rows from which its attention is tiled (Model.attention_tile_rows;
        0: never)."""
        tokens = sum(n for _, n, _ in chunks)
        outputs = sum(int(out) for _, _, out in chunks)
        return StepShape(tokens, outputs, tiled_attention(chunks, tile))

    @staticmethod
    def parts(shapes: Sequence[StepShape]) -> StepShape:
        """A step decoded as these shapes, one decode each (the output rows' kernel features are then those of
        all its rows together: an estimate, as the narrow part holds nearly all of them)."""
        return StepShape(
            sum(s.tokens for s in shapes),
            sum(s.outputs for s in shapes),
            sum(s.attention for s in shapes),
            sum(s.decodes for s in shapes),
        )

    def rows_past_tiles(self, width: int) -> bool:
        """More output rows than a tile ``width`` rows wide holds, and not a whole number of tiles: the matrix
        kernel gives the rows past the last whole tile a pass of their own (width 2: an odd number past one)."""
        return self.outputs > width and self.outputs % width != 0

    def features(self) -> np.ndarray:
        wide = 1.0 if self.outputs > 1 else 0.0
        past_tiles = [float(self.rows_past_tiles(width)) for width in TILE_WIDTHS]
        extra = float(self.decodes - 1)
        return np.array([1.0, self.tokens, self.outputs, self.attention / 1e4, wide, *past_tiles, extra])


def tiled_attention(chunks: Sequence[tuple[int, int, int]], tile: int) -> int:
    """The attention feature of one decode of ``chunks`` (first position, token count, outputs), in this order: each
    fed token against its position's context, but from ``tile`` rows on (decode_groups.py), where a tile of
    consecutive rows holding several sequences puts each of its rows against all of their cells. An estimate: ggml
    cuts the rows into tiles per thread's share, not from row 0, a short tile costs a whole one, and a
    sliding-window layer sees its window only."""
    ends = list(itertools.accumulate(n for _, n, _ in chunks))  # where each chunk's rows end in the batch
    rows = ends[-1] if ends else 0
    if tile <= 0 or rows < tile or len(chunks) < 2:
        return sum(n * start + n * (n + 1) // 2 for start, n, _ in chunks)
    work = 0
    for first in range(0, rows, tile):
        last = min(first + tile, rows)
        inside = range(bisect.bisect_right(ends, first), bisect.bisect_right(ends, last - 1) + 1)
        if len(inside) == 1:  # one sequence's rows: its own context, as without tiles
            start, n, _ = chunks[inside[0]]
            begin = ends[inside[0]] - n
            a, b = first - begin, last - begin  # its rows in the tile
            work += (b - a) * start + (b * (b + 1) - a * (a + 1)) // 2
        else:  # each row against every one of these sequences' cells up to its last row in the tile (causal)
            work += (last - first) * sum(chunks[i][0] + min(ends[i], last) - (ends[i] - chunks[i][1]) for i in inside)
    return work


def bounded(covariance: np.ndarray) -> np.ndarray:
    """The fit's covariance, symmetric and with no variance past the prior's: forgetting divides it by FORGET every
    step, so in a direction the steps do not vary (hours of one-row decode steps leave the features of several rows
    at zero) it grew without bound, until it was no covariance at all and the fit diverged (about 9,000 such steps in
    a simulation)."""
    values, vectors = np.linalg.eigh((covariance + covariance.T) / 2)
    return (vectors * np.clip(values, 1e-12, PRIOR_VARIANCE)) @ vectors.T


def nonnegative(theta: np.ndarray, covariance: np.ndarray) -> np.ndarray:
    """The fit ``theta`` with every cost at zero or more: predictions must grow with the work, and no part of a step
    costs less than nothing, but noise, or features that move together in the steps seen, can put one below zero.
    Those are held at zero and the others moved to fit the same steps as well as they can so (least squares with them
    held, from the fit's own ``covariance``), until none is below. Zeroing a negative one alone leaves the others where
    it had pulled them: at one stream nearly every step has several logits rows, the fit put the cost of several at
    -8 to -11 ms and the fixed cost as much higher, and dropping the negative part priced every step of several rows
    that much too high (the fast factor settled at 0.73-0.78 to make up for it). The fixed cost is held too: nearly
    every large step beside a voice session has one logits row, so the large steps' fit could not tell the fixed cost
    from a row's, and put them at -106 and +143 ms; a prompt chunk alone (no row) was then predicted at 181 ms and took
    311, and the voice turn waiting behind it was refused."""
    usable, held = theta.copy(), np.zeros(len(theta), dtype=bool)
    # Where the covariance cannot say more (rare: bounded() keeps it positive definite), each is clamped alone.
    clamped = np.maximum(theta, 0.0)
    while (negative := usable < 0.0).any():
        held |= negative
        free = ~held
        try:
            np.linalg.cholesky(covariance[np.ix_(held, held)])  # (raises unless positive definite)
            shift = covariance[np.ix_(free, held)] @ np.linalg.solve(covariance[np.ix_(held, held)], theta[held])
        except np.linalg.LinAlgError:
            return clamped
        usable = theta.copy()
        usable[free] -= shift
        usable[held] = 0.0
        if not np.isfinite(usable).all():
            return clamped
    return usable


class _LinearFit:
    """Recursive least squares over the step features, slowly forgetting old steps."""

    def __init__(self, clock: Callable[[], float]) -> None:
        # A cautious prior (10 ms fixed, 2 ms per token) until calibration says otherwise.
        self.theta = np.zeros(FEATURES)
        self.theta[:2] = (0.010, 0.002)
        self.theta[EXTRA_DECODE] = 0.010  # a decode more: a pass over the weights, as the fixed cost
        self.usable = self.theta.copy()
        self._p = np.eye(FEATURES) * PRIOR_VARIANCE
        self.recent = 1.0  # the last steps' measured time over the fit's prediction
        self.settled = 1.0  # the same over more steps: where the fast factor returns to while no step runs
        self._clock = clock
        self._updated = clock()

    def factor(self, at: float | None = None) -> float:
        """The fast factor now (or ``at``): as the last steps measured it, fading towards the settled one for the
        time since the last step ended."""
        idle = max(0.0, (self._clock() if at is None else at) - self._updated)
        return self.settled + (self.recent - self.settled) * 0.5 ** (idle / IDLE_HALF_LIFE_S)

    def predict(self, x: np.ndarray) -> float:
        return max(1e-4, dot(x, self.usable) * self.factor())

    def update(self, x: np.ndarray, seconds: float) -> None:
        px = self._p @ x
        gain = px / (FORGET + x @ px)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        self._p = bounded((self._p - np.outer(gain, px)) / FORGET)
        self.usable = nonnegative(self.theta, self._p)
        # What the fit has not caught up with, measured after its update: a shape it knew little of moves the fit
        # itself, and counting that step's surprise twice would overshoot.
        ratio = min(max(seconds / max(1e-4, dot(x, self.usable)), RECENT_RANGE[0]), RECENT_RANGE[1])
        now = self._clock()
        before = self.factor(at=now - seconds)  # the step's own time is not idle time
        self.recent = before + RECENT_WEIGHT * (ratio - before)
        self.settled += SETTLED_WEIGHT * (ratio - self.settled)
        self._updated = now

    def reset_factors(self) -> None:
        """No drift: predictions are the fit's own."""
        self.recent = self.settled = 1.0
        self._updated = self._clock()

    def status(self) -> CostFit:
        fixed, per_token, per_output, per_attention, wide, odd, past_fours, extra = (float(x) for x in self.theta)
        return CostFit(
            fixed_ms=round(fixed * 1e3, 3),
            per_token_ms=round(per_token * 1e3, 4),
            per_output_ms=round(per_output * 1e3, 4),
            per_10k_attention_ms=round(per_attention * 1e3, 4),
            several_outputs_ms=round(wide * 1e3, 4),
            odd_outputs_ms=round(odd * 1e3, 4),
            outputs_past_fours_ms=round(past_fours * 1e3, 4),
            extra_decode_ms=round(extra * 1e3, 4),
            recent=round(self.factor(), 3),
        )


class CostModel:
    """Two linear fits, one for small steps (decode tokens, short prompts) and one for large ones (prompt
    chunks): on a CPU a small batch is bound by reading the weights and a large one by arithmetic, so one line
    fitted to a stream of large chunks would mispredict the short step a voice request needs, and the other way
    round."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, tile: int = 0, parts: str = "auto") -> None:
        self.small, self.large = _LinearFit(clock), _LinearFit(clock)
        self.tile = tile  # the rows from which attention is tiled (Model.attention_tile_rows; 0: never)
        self.parts = parts  # the step_parts setting: "auto", "always" or "off"
        self.updates = 0
        self.calibration: list[CalibrationPoint] = []

    def _fit(self, shape: StepShape) -> _LinearFit:
        return self.small if shape.tokens <= SMALL_STEP else self.large

    def plan(self, chunks: Sequence[tuple[int, int, int]]) -> tuple[list[list[int]], StepShape]:
        """How a step of these (first position, token count, output rows) chunks is decoded: the chunks' indices per
        decode (decode_groups.py), in parts only when they are predicted faster than one decode, and its shape."""
        everything = [list(range(len(chunks)))]
        one = StepShape.of(chunks, self.tile)
        groups = decode_groups([n for _, n, _ in chunks], self.tile if self.parts != "off" else 0)
        if len(groups) == 1:
            return everything, one
        split = StepShape.parts([StepShape.of([chunks[i] for i in group], self.tile) for group in groups])
        faster = self.parts == "always" or self.predict(split) < self.predict(one)
        return (groups, split) if faster else (everything, one)

    def shape(self, chunks: Sequence[tuple[int, int, int]]) -> StepShape:
        """The shape of a step of these (first position, token count, output rows) chunks, as it will be decoded."""
        return self.plan(chunks)[1]

    def predict(self, shape: StepShape) -> float:
        """Seconds; never below a small floor (a step always costs something)."""
        return self._fit(shape).predict(shape.features())

    def calibrated(self) -> CostModel:
        """A frozen copy: what steps cost when the daemon started (the thread count measures slowdowns by it)."""
        return copy.deepcopy(self)

    def update(self, shape: StepShape, seconds: float) -> None:
        self._fit(shape).update(shape.features(), seconds)
        self.updates += 1

    def status(self) -> CostModelStatus:
        return CostModelStatus(
            small_steps=self.small.status(),
            large_steps=self.large.status(),
            small_step_tokens=SMALL_STEP,
            updates=self.updates,
            calibration=list(self.calibration),
        )


# Shapes measured at start: (tokens already in the sequence, tokens fed).
WARM_UP = [(0, 8), (0, 64)]
CALIBRATION = [(0, 1), (0, 16), (128, 1), (128, 32), (0, 4), (0, 64), (0, 256), (128, 128), (256, 64)]
# ... and with guesses: a decode token and k guessed rows, each with its logits, for the k a step may hold (row
# counts of either parity, within and past a multiple of four, so that a kernel's part tiles are told from the
# rows' own cost).
GUESSES = (1, 2, 3, 4, 5, 16)


def calibrate(model: CostModel, run: Callable[..., float], repeat: int = 1, guess_rows: int = 0) -> None:
    """Fit the model to a few measured shapes. ``run(start, n)`` builds ``start`` tokens of context (untimed),
    returns the seconds a step feeding ``n`` more tokens and sampling once takes, and leaves the KV empty;
    ``run(start, n, n)`` the same with logits for every fed token (a decode token and its guess), measured for
    guesses of up to ``guess_rows`` rows (the model's room for them; 0: none)."""
    for start, n in WARM_UP:  # the first decodes pay one-time costs (buffers, threads): not the machine's speed
        run(start, n)
    shapes = [(start, n, 1) for start, n in CALIBRATION]
    shapes += [(128, 1 + k, 1 + k) for k in sorted({min(k, guess_rows) for k in GUESSES if guess_rows})]
    for _ in range(repeat):
        for start, n, outputs in shapes:
            seconds = run(start, n) if outputs == 1 else run(start, n, outputs)
            model.update(StepShape.of([(start, n, outputs)]), seconds)
            model.calibration.append(CalibrationPoint(context=start, tokens=n, ms=round(seconds * 1e3, 3)))
    model.calibration = model.calibration[-len(shapes) :]
    # No calibration step runs in parts: a decode more starts at what a one-token step costs (a pass over the
    # weights), and the steps run in parts refine it.
    one_token = max(0.0, float(StepShape.of([(0, 1, 1)]).features() @ model.small.usable))
    for fit in (model.small, model.large):
        fit.theta[EXTRA_DECODE] = fit.usable[EXTRA_DECODE] = one_token
        fit.reset_factors()  # calibration's steps vary on purpose: no drift
