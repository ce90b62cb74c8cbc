"""The scheduler and the cost model: step work with a fake clock and a fixed cost model, and the Scheduler's
admission with a scheduler alone, and the moves on the fake model's tiers. No llama.cpp, no daemon."""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool import protocol as p
from kvpool.daemon.config import load_config
from kvpool.daemon.engine import cost_model
from kvpool.daemon.engine.cost_model import CostModel, StepShape, calibrate
from kvpool.daemon.engine.generation import Generation
from kvpool.daemon.engine.moves import next_work
from kvpool.daemon.engine.scheduler import HEADROOM, Budget, Scheduler
from kvpool.daemon.engine.step_work import MIN_CHUNK, budgeted_work, fcfs_work, steps_for
from kvpool.daemon.engine.stream_text import StreamText
from kvpool.daemon.kv.manager import KvManager
from kvpool.daemon.kv.sessions import Session, SessionTable
from kvpool.daemon.llama.decode_groups import ATTENTION_TILE_ROWS
from kvpool.daemon.refusals import RequestRefused
from kvpool.protocol import ErrorCode

from .fake_model import FakeModel, FakeSampler
from .kv_in_process import compute, kv_on_fake_model, open_session


@dataclass(eq=False)
class Item:
    pending_tokens: int
    arrival: float
    deadline: float = math.inf
    best_effort: bool = False
    priority: int = 0
    position: int = 0
    feedable: int | None = None  # None: every pending token
    feeds_medium: bool = False
    medium_seconds: float = 0.0
    medium_ready: bool = True

    @property
    def feedable_tokens(self) -> int:
        return self.pending_tokens if self.feedable is None else self.feedable


def fixed_cost(fixed_ms: float = 10.0, per_token_ms: float = 1.0) -> CostModel:
    """A cost model that knows exactly: fixed + per token (no output or attention cost)."""
    model = CostModel()
    for fit in (model.small, model.large):
        fit.theta[:] = 0.0
        fit.theta[:2] = [fixed_ms / 1e3, per_token_ms / 1e3]
        fit.usable = fit.theta.copy()
    return model


def summary(work: list) -> list[tuple[Item, int, bool]]:
    return [(w.item, w.n_tokens, w.completes) for w in work]


# ---------------------------------------------------------------- fcfs


def test_fcfs_feeds_decodes_then_prompts_oldest_first() -> None:
    late_prompt, early_prompt = Item(300, 2.0), Item(400, 1.0)
    decoding = [Item(1, 5.0), Item(1, 6.0)]
    work = fcfs_work([late_prompt, *decoding, early_prompt], token_budget=256)
    assert summary(work) == [(decoding[0], 1, True), (decoding[1], 1, True), (early_prompt, 254, False)]


# ---------------------------------------------------------------- earliest deadline first


def test_prompts_go_by_earliest_deadline_not_arrival() -> None:
    vision = Item(1500, arrival=1.0, deadline=11.0)
    voice = Item(30, arrival=2.0, deadline=2.3)
    work = budgeted_work([vision, voice], 512, fixed_cost(), time_cap=None)
    assert summary(work)[0] == (voice, 30, True)  # the later arrival with the earlier deadline goes first
    assert summary(work)[1] == (vision, 482, False)


def test_ties_go_to_priority_then_age_and_best_effort_goes_last() -> None:
    a, b = Item(10, 1.0, deadline=5.0, priority=0), Item(10, 2.0, deadline=5.0, priority=3)
    background = Item(10, 0.0, best_effort=True)
    work = budgeted_work([background, a, b], 512, fixed_cost(), time_cap=None)
    assert [w.item for w in work] == [b, a]  # the best-effort prompt waits for a step of its own
    decoding_background = Item(1, 0.0, best_effort=True)
    work = budgeted_work([decoding_background, a, b], 512, fixed_cost(), time_cap=None)
    assert [w.item for w in work] == [decoding_background, b, a]  # decode tokens are cheap: they ride


def test_chunks_are_sized_to_the_time_cap() -> None:
    # 10 ms fixed + 1 ms per token, cap 50.5 ms: two decode tokens leave room for a 38-token chunk.
    decoders = [Item(1, 1.0, deadline=1.1), Item(1, 1.0, deadline=1.2)]
    prompt = Item(1000, 0.5, deadline=9.0)
    work = budgeted_work([prompt, *decoders], 512, fixed_cost(), time_cap=0.0505)
    assert summary(work) == [(decoders[0], 1, True), (decoders[1], 1, True), (prompt, 38, False)]
    without_cap = budgeted_work([prompt, *decoders], 512, fixed_cost(), time_cap=None)
    assert summary(without_cap)[2] == (prompt, 510, False)


def test_deadline_bound_decodes_always_ride_but_best_effort_yields() -> None:
    # cap 12.5 ms: room for two tokens beyond the fixed cost. Three deadline-bound decodes exceed it and still
    # all ride; the best-effort decode and the best-effort prompt wait.
    bound = [Item(1, 1.0, deadline=1.0 + i) for i in range(3)]
    background = Item(1, 0.0, best_effort=True)
    prompt = Item(100, 0.0, best_effort=True)
    work = budgeted_work([background, prompt, *bound], 512, fixed_cost(), time_cap=0.0125)
    assert [w.item for w in work] == bound


def test_best_effort_prompts_stay_out_of_a_step_that_starts_a_deadline_bound_answer() -> None:
    voice = Item(20, 2.0, deadline=2.3)
    vision = Item(1000, 1.0, best_effort=True)
    work = budgeted_work([vision, voice], 512, fixed_cost(), time_cap=0.1505)
    assert summary(work) == [(voice, 20, True)]
    assert summary(budgeted_work([vision], 512, fixed_cost(), time_cap=0.1505)) == [(vision, 140, False)]


def test_best_effort_work_alone_still_moves_when_nothing_fits_the_cap() -> None:
    background = Item(1, 0.0, best_effort=True)  # a decode token predicted above the cap
    work = budgeted_work([background], 512, fixed_cost(fixed_ms=50.0), time_cap=0.010)
    assert summary(work) == [(background, 1, True)]


def test_the_most_urgent_prompt_always_moves() -> None:
    prompt = Item(100, 0.0, deadline=3.0)
    work = budgeted_work([prompt], 512, fixed_cost(fixed_ms=50.0), time_cap=0.010)  # nothing fits the cap
    assert summary(work) == [(prompt, MIN_CHUNK, False)]


@given(
    st.lists(st.tuples(st.integers(1, 600), st.floats(0, 100), st.floats(0, 200), st.booleans()), max_size=16),
    st.integers(8, 512),
    st.one_of(st.none(), st.floats(0.011, 0.5)),
)
def test_step_work_respects_budget_and_pending(items: list, budget: int, cap: float | None) -> None:
    running = [Item(n, t, deadline=d, best_effort=be) for n, t, d, be in items]
    work = budgeted_work(running, budget, fixed_cost(), cap)
    assert sum(w.n_tokens for w in work) <= budget
    assert len({id(w.item) for w in work}) == len(work)
    for w in work:
        assert 1 <= w.n_tokens <= w.item.pending_tokens
        assert w.completes == (w.n_tokens == w.item.pending_tokens)
    prompts = [w for w in work if w.item.pending_tokens > 1]
    if cap is not None and len(prompts) > 1:  # beyond the guaranteed minimal chunk, the cap holds
        assert fixed_cost().predict(StepShape(sum(w.n_tokens for w in work), 0, 0)) <= cap + 1e-9


def dot_without_fma(features: np.ndarray, coefficients: np.ndarray) -> float:
    total = 0.0
    for x, c in zip(features.tolist(), coefficients.tolist(), strict=True):
        total = total + x * c  # each product rounded, then each sum: no fused multiply-add
    return total


def dot_with_fma(features: np.ndarray, coefficients: np.ndarray) -> float:
    total = 0.0
    for x, c in zip(features.tolist(), coefficients.tolist(), strict=True):
        total = float(Fraction(x) * Fraction(c) + Fraction(total))  # fma: one rounding of the exact x * c + total
    return total


def test_the_step_work_on_a_cap_does_not_depend_on_a_fused_multiply_add(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 ms + 140 x 1 ms sits exactly on a 150 ms cap: the two ways a CPU may sum it differ in the last bit.
    features = StepShape(140, 0, 0).features()
    coefficients = fixed_cost().small.usable
    assert dot_with_fma(features, coefficients) == 0.15
    assert dot_without_fma(features, coefficients) == 0.15000000000000002
    works, estimates = [], []
    for way in (dot_with_fma, dot_without_fma):
        monkeypatch.setattr(cost_model, "dot", way)
        work = budgeted_work([Item(1000, 1.0, best_effort=True)], 512, fixed_cost(), time_cap=0.150)
        works.append([(w.n_tokens, w.completes) for w in work])
        estimates.append(steps_for(280, decoders=[], position=0, token_budget=512, cost=fixed_cost(), time_cap=0.150))
    assert works[0] == works[1] == [(140, False)]
    assert estimates[0][0] == estimates[1][0] == 2  # two chunks of 140


# ---------------------------------------------------------------- admission estimate and cost model


def test_admission_estimate_counts_chunks_under_the_cap() -> None:
    cost = fixed_cost()
    steps, seconds = steps_for(100, decoders=[0, 0], position=0, token_budget=512, cost=cost, time_cap=0.0505)
    assert steps == 3  # 38 tokens per step next to 2 decodes, then 24
    assert math.isclose(seconds, 2 * 0.050 + (0.010 + 0.026), rel_tol=1e-6)
    steps, seconds = steps_for(100, decoders=[], position=0, token_budget=512, cost=cost, time_cap=None)
    assert (steps, round(seconds, 6)) == (1, 0.110)  # one 100-token chunk: 10 ms + 100 x 1 ms


def test_cost_model_learns_a_linear_machine() -> None:
    true = {"fixed": 0.02, "token": 0.0015, "output": 0.004, "attention": 0.0003}

    def run(start: int, n: int) -> float:
        shape = StepShape.of([(start, n, True)])
        return (
            true["fixed"]
            + true["token"] * shape.tokens
            + true["output"] * shape.outputs
            + true["attention"] * shape.attention / 1e4
        )

    model = CostModel()
    calibrate(model, run, repeat=20)
    for start, n, outputs in [(0, 1, 1), (0, 300, 1), (500, 1, 1), (100, 64, 2), (0, 20, 1)]:
        shape = StepShape.of([(start, n, True)] + [(0, 1, True)] * (outputs - 1))
        expected = run(start, n) + (outputs - 1) * (true["token"] + true["output"] + true["attention"] / 1e4)
        assert math.isclose(model.predict(shape), expected, rel_tol=0.05), (start, n)


def test_a_marginal_cost_the_fit_puts_below_zero_is_held_at_zero_and_the_others_refitted() -> None:
    """One stream with guesses: nearly every step has several logits rows, and here a step of several costs less
    than the fixed cost and the rows' own would say (20 ms + 5 ms a row, where one row alone takes 30). The fit puts
    the cost of several rows below zero; predictions must not fall as rows are added, so it is held at zero, and the
    fixed cost moves with it: the steps seen stay predicted as measured (zeroing it alone left every step of several
    rows 5 ms too dear, and the fast factor, which scales every prediction, made up for it)."""

    def seconds(rows: int) -> float:
        return 0.030 if rows == 1 else 0.020 + 0.005 * rows

    clock = FakeClock()
    model = CostModel(clock=clock)
    calibrate(model, lambda start, n, outputs=1: seconds(outputs) + 0.0001 * n, repeat=3, guess_rows=16)
    for i in range(400):  # one step alone in ten, the rest with a guess of an odd number of tokens
        rows = 1 if i % 10 == 0 else 2 + 2 * (i % 4)
        clock.now += seconds(rows)
        model.update(StepShape.of([(128 + i, rows, rows)]), seconds(rows))
    model.small.reset_factors()  # (the fit's own predictions)
    fitted = model.status().small_steps
    assert fitted.several_outputs_ms < -2.0  # what the fit says unconstrained
    shapes = {rows: StepShape.of([(528, rows, rows)]) for rows in (1, 2, 4, 6, 8, 16)}
    predicted = {rows: model.predict(shape) for rows, shape in shapes.items()}
    for rows in (2, 4, 6, 8):
        assert math.isclose(predicted[rows], seconds(rows), rel_tol=0.05), rows
    assert all(predicted[a] <= predicted[b] for a, b in [(1, 2), (2, 4), (4, 6), (6, 8), (8, 16)])
    assert (model.small.usable[1:] >= 0).all()


def test_hours_of_one_kind_of_step_leave_the_fit_as_it_was() -> None:
    """A daemon that only decodes one session for hours: every step has one logits row, so the features of several
    rows stay at zero. Forgetting grew the fit's covariance in their direction by 1/FORGET a step, without bound,
    until the fit diverged; bounded, the fit still predicts both kinds of step when several rows come again."""

    def seconds(rows: int) -> float:
        return 0.020 + 0.004 * rows + (0.006 if rows > 1 else 0.0)

    clock = FakeClock()
    model = CostModel(clock=clock)
    calibrate(model, lambda start, n, outputs=1: seconds(outputs) + 0.0001 * n, repeat=3, guess_rows=16)
    noise = np.random.default_rng(0).normal(1.0, 0.02, 20_000)
    for i, factor in enumerate(noise):  # (about ten minutes of 30 ms steps)
        clock.now += seconds(1)
        model.update(StepShape.of([(128 + i % 512, 1, 1)]), seconds(1) * factor)
    model.small.reset_factors()
    assert np.isfinite(model.small.theta).all() and np.abs(model.small._p).max() <= 1.001 * cost_model.PRIOR_VARIANCE
    assert math.isclose(model.predict(StepShape.of([(300, 1, 1)])), seconds(1), rel_tol=0.05)
    four = model.predict(StepShape.of([(300, 4, 4)]))
    assert seconds(1) < four < 3 * seconds(4)  # (what calibration told of several rows, not forgotten into noise)


def test_nonnegative_moves_the_free_coefficients_as_the_covariance_ties_them() -> None:
    theta = np.array([0.03, 0.002, -0.001])
    covariance = np.array([[1.0, 0.0, -0.5], [0.0, 1.0, 0.0], [-0.5, 0.0, 1.0]])
    held = cost_model.nonnegative(theta, covariance)
    assert held[2] == 0.0 and held[1] == 0.002  # the uncorrelated one stays
    assert math.isclose(held[0], 0.03 - 0.5 * 0.001)  # the fixed cost gives back what the negative one took
    # A fixed cost below zero is held at zero too (the large steps' fit put it at -106 ms and a row's at +143): the
    # others take what it took, as the covariance ties them.
    tied = np.array([[1.0, 0.0, 0.5], [0.0, 1.0, 0.0], [0.5, 0.0, 1.0]])
    fixed = cost_model.nonnegative(np.array([-0.01, 0.001, 0.002]), tied)
    assert fixed[0] == 0.0 and fixed[1] == 0.001 and math.isclose(fixed[2], 0.002 + 0.5 * 0.01)
    # Holding one pushes another below zero: it is held too, and the fixed cost takes what both took.
    chained = np.array([[1.0, -0.3, 0.0], [-0.3, 1.0, -0.9], [0.0, -0.9, 1.0]])
    both = cost_model.nonnegative(np.array([0.03, 0.0005, -0.001]), chained)
    assert both[1] == 0.0 and both[2] == 0.0 and 0.0 <= both[0] < 0.03
    # A covariance that is no longer one (not positive definite): the plain clamp.
    broken = np.array([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0], [2.0, 0.0, -1.0]])
    assert (cost_model.nonnegative(theta, broken) == [0.03, 0.002, 0.0]).all()


def test_a_prompt_chunk_alone_is_not_priced_under_what_the_steps_beside_a_voice_session_taught() -> None:
    """Replays a measured trace (tests/data: the calibration and first steps of bench/latency.py with guesses on an
    AMD EPYC). Beside the voice session every large step had one logits row; the large steps' fit put the fixed
    cost at -106 ms and a row at +143, so the first prompt chunk alone after them (311 ms) was predicted at 181 ms,
    the chunk sized to the 180 ms cap by that, and the voice turn waiting behind it refused in 3 of 3 runs."""
    trace = json.loads((Path(__file__).parent / "data" / "cost_trace_amd_voice_vision.json").read_text())
    measured = {(start, n, outputs): ms / 1000.0 for start, n, outputs, ms in trace["calibration"]}

    def run(start: int, n: int, outputs: int = 1) -> float:  # (the warm-up's steps are not fitted)
        return 0.01 if (start, n) in cost_model.WARM_UP else measured[start, n, outputs]

    clock = FakeClock()
    model = CostModel(clock=clock, tile=ATTENTION_TILE_ROWS)
    calibrate(model, run, guess_rows=16)
    *before, last = trace["steps"]
    lowest_fixed = 0.0
    for step in before:
        clock.now += step["ms"] / 1000.0
        model.update(model.shape([tuple(c) for c in step["chunks"]]), step["ms"] / 1000.0)
        lowest_fixed = min(lowest_fixed, float(model.large.theta[0]))
        assert (model.large.usable >= 0.0).all()
    assert lowest_fixed < -0.05  # the fit itself went where it went on the machine
    predicted = model.predict(model.shape([tuple(c) for c in last["chunks"]]))
    assert predicted >= 0.75 * last["ms"] / 1000.0, predicted


@pytest.mark.parametrize("rows", [1, 4])  # a shape calibration measured, and one it did not
def test_predictions_follow_a_step_that_slows_down_within_a_few_steps_and_come_back(rows: int) -> None:
    # A neighbour process takes a core: every step takes three times as long as calibrated, at once.
    def run(start: int, n: int) -> float:
        return 0.02 + 0.0015 * n

    model = CostModel()
    calibrate(model, run, repeat=20)
    frozen = model.calibrated()
    decode = StepShape.of([(100, 1, True)] * rows)
    before = model.predict(decode)
    for _ in range(8):
        model.update(decode, 3 * before)
    assert 2.5 * before < model.predict(decode) < 3.3 * before  # budgets see the slow steps after 8 of them
    assert frozen.predict(decode) == before  # what the thread count measures slowdowns against stays
    for _ in range(30):  # the neighbour left
        model.update(decode, before)
    assert math.isclose(model.predict(decode), before, rel_tol=0.15)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steps_on(model: CostModel, clock: FakeClock, shape: StepShape, seconds: float, n: int) -> None:
    """``n`` steps of ``shape``, each taking ``seconds``, one right after the other."""
    for _ in range(n):
        clock.now += seconds
        model.update(shape, seconds)


def calibrated_on(clock: FakeClock, fixed_s: float) -> tuple[CostModel, StepShape, float]:
    """A cost model on ``clock``, calibrated on steps of ``fixed_s`` plus 1.5 ms a token; a decode step's shape and
    its predicted seconds."""
    model = CostModel(clock=clock)
    calibrate(model, lambda start, n, outputs=1: fixed_s + 0.0015 * n, repeat=20)
    decode = StepShape.of([(100, 1, True)])
    return model, decode, model.predict(decode)


def test_a_slow_moment_fades_once_no_step_runs_but_a_lasting_slowdown_stays() -> None:
    # A few slow steps and then nothing (a voice turn beside a neighbour that was briefly greedy): the fast factor
    # must not stay up, or admission refuses the next voice request, and every one after it, since a refused
    # request runs no step that could show the machine is fast again.
    clock = FakeClock()
    model, decode, normal = calibrated_on(clock, 0.02)
    steps_on(model, clock, decode, normal, 30)
    steps_on(model, clock, decode, 4 * normal, 4)
    assert model.predict(decode) > 2.5 * normal  # right after them, the slow steps count
    clock.now += 0.1
    assert model.predict(decode) > 2.0 * normal  # a pause between turns does not undo them
    clock.now += 2.0
    assert model.predict(decode) < 1.6 * normal  # two seconds with no step: back near the settled speed
    steps_on(model, clock, decode, normal, 8)
    assert math.isclose(model.predict(decode), normal, rel_tol=0.15)
    # A neighbour that stays: forty steps at three times the time are the settled speed, kept over a pause.
    steps_on(model, clock, decode, 3 * normal, 40)
    clock.now += 5.0
    assert model.predict(decode) > 2.4 * normal


def test_the_fast_factor_does_not_fade_during_the_steps_themselves() -> None:
    # Long steps one right after another are not idle time: a slowdown they show is kept at full weight.
    clock = FakeClock()
    model, decode, normal = calibrated_on(clock, 0.2)
    steps_on(model, clock, decode, 3 * normal, 8)  # each over 0.6 s, longer than the idle half-life
    assert model.predict(decode) > 2.5 * normal


# ---------------------------------------------------------------- the Scheduler, on the fake model's tiers


def generation(s: Session, budget: Budget, prompt: int = 4) -> Generation:
    """A generate request of ``prompt`` new tokens, admitted with ``budget``."""
    request = p.Generate(id=1, session=s.id, token=s.token, prompt="x")
    return Generation(
        client=b"c",
        request=request,
        session=s,
        sampler=FakeSampler(),  # type: ignore[arg-type]
        prompt_tokens=prompt,
        text=StreamText([]),
        new_tokens=list(range(1000, 1000 + prompt)),
        arrival=time.monotonic(),
        ttft_s=budget.ttft_s,
        tpot_s=budget.tpot_s,
        best_effort=budget.best_effort,
        priority=budget.priority,
    )


TASKS = {
    "default": {},
    "voice": {"ttft_ms": 300.0, "max_queue": 2},
    "background": {"best_effort": True},
}


def scheduler_on(kv: KvManager) -> tuple[Scheduler, list[tuple[Generation, RequestRefused]]]:
    return Scheduler(kv.config, kv.sessions, 64), []


def next_step(scheduler: Scheduler, kv: KvManager, refused: list[tuple[Generation, RequestRefused]]) -> list:
    """What the engine does before a step: the scheduler's moves applied, and the step's work."""

    def refuse(g: Generation, why: RequestRefused) -> None:
        scheduler.remove(g)
        refused.append((g, why))

    return next_work(scheduler, kv, refuse)


def scheduler_alone(tasks: dict[str, dict[str, object]] = TASKS) -> tuple[Scheduler, SessionTable]:
    """A scheduler and its session table, nothing else: admission needs no model, pool or KV."""
    config = load_config(None, {"tasks": tasks})
    sessions = SessionTable(config, 4096)
    return Scheduler(config, sessions, 64), sessions


def session_of(sessions: SessionTable, task: str) -> Session:
    return sessions.create(secrets.token_hex(8), "t", task, entry=len(sessions.by_id))


def test_admission_refuses_a_first_token_that_cannot_make_its_budget() -> None:
    scheduler, sessions = scheduler_alone()  # the uncalibrated prior: 10 ms a step and 2 ms a token
    voice, background = session_of(sessions, "voice"), session_of(sessions, "background")
    now = time.monotonic()
    budget = scheduler.admit(voice, None, prompt_tokens=20, received_at=now)
    assert budget.ttft_s == pytest.approx(0.3) and not budget.best_effort
    with pytest.raises(RequestRefused) as refused:
        scheduler.admit(voice, None, prompt_tokens=2000, received_at=now)
    assert refused.value.code == ErrorCode.BUDGET_UNMEETABLE and refused.value.detail["estimate_ms"] > 300
    assert scheduler.admit(voice, 100.0, prompt_tokens=20, received_at=now).ttft_s == pytest.approx(0.1)
    assert scheduler.admit(background, None, prompt_tokens=2000, received_at=now).best_effort  # queued, not refused
    assert scheduler.task_stats["voice"].refusals == {"BUDGET_UNMEETABLE": 1}


def test_admission_counts_the_wait_for_a_slot_held_by_an_answer_that_cannot_be_swapped_out() -> None:
    """Every hot slot held by an answer that is not best-effort: a first token with a budget waits for that answer to
    end. It was admitted as if a slot were free, and missed its budget by seconds."""
    scheduler, sessions = scheduler_alone()  # the uncalibrated prior: 10 ms a step and 2 ms a token
    chat, voice = session_of(sessions, "default"), session_of(sessions, "voice")
    long = generation(chat, scheduler.admit(chat, None, 4, time.monotonic()))
    scheduler.add(long)
    scheduler.start(long)  # 128 tokens to go (its max_tokens): over a second
    with pytest.raises(RequestRefused) as refused:
        scheduler.admit(voice, None, prompt_tokens=20, received_at=time.monotonic(), slot_at_hand=False)
    assert refused.value.code == ErrorCode.BUDGET_UNMEETABLE and refused.value.detail["estimate_ms"] > 1000
    assert "every hot slot held by an answer that cannot be swapped out" in refused.value.message
    assert scheduler.admit(voice, None, prompt_tokens=20, received_at=time.monotonic()).ttft_s == pytest.approx(0.3)
    long.completion_tokens = 126  # two steps from its end: the wait fits the budget
    assert scheduler.admit(voice, None, 20, time.monotonic(), slot_at_hand=False).ttft_s == pytest.approx(0.3)


def test_admission_caps_a_tasks_queue() -> None:
    scheduler, sessions = scheduler_alone()
    voices = [session_of(sessions, "voice") for _ in range(3)]
    for s in voices[:2]:
        scheduler.add(generation(s, scheduler.admit(s, None, 4, time.monotonic())))
    assert all(s.busy for s in voices[:2]) and scheduler.in_flight("voice") == 2
    with pytest.raises(RequestRefused) as refused:
        scheduler.admit(voices[2], None, 4, time.monotonic())
    assert refused.value.code == ErrorCode.OVERLOADED


def test_a_step_is_capped_by_the_tightest_budget_of_a_task_with_open_sessions() -> None:
    scheduler, sessions = scheduler_alone()
    assert scheduler.step_time_cap() is None  # no deadline-bound task has a session
    session_of(sessions, "background")
    assert scheduler.step_time_cap() is None  # best effort caps nothing
    session_of(sessions, "voice")
    assert scheduler.step_time_cap() == pytest.approx(0.3 * HEADROOM)


def test_a_deadline_bound_request_swaps_out_best_effort_work_that_holds_the_only_slot(tmp_path: Path) -> None:
    with kv_on_fake_model(tmp_path, hot_slots=1, config_text={"tasks": TASKS}) as kv:
        scheduler, refused = scheduler_on(kv)
        background, voice = open_session(kv, "background"), open_session(kv, "voice")
        slow = generation(background, scheduler.admit(background, None, 8, time.monotonic()), prompt=8)
        scheduler.add(slow)
        assert [w.item for w in next_step(scheduler, kv, refused)] == [slow] and background.tier == "hot"
        compute_fed(slow, 8, kv)
        urgent = generation(voice, scheduler.admit(voice, None, 4, time.monotonic()))
        scheduler.add(urgent)
        work = next_step(scheduler, kv, refused)
        assert [w.item for w in work] == [urgent] and voice.tier == "hot" and background.tier == "pool"
        assert scheduler.waiting == [slow] and scheduler.task_stats["background"].preemptions == 1
        assert not refused
        scheduler.remove(urgent)  # the voice turn ends; the best-effort one resumes where it stopped
        voice.busy = False
        assert [w.item for w in next_step(scheduler, kv, refused)] == [slow]
        assert background.n_kv == 8 and slow.pending_tokens == 1


def compute_fed(g: Generation, n: int, kv: KvManager) -> None:
    """What a step does for ``g``: ``n`` pending tokens into the KV, then (its prompt done) one sampled token."""
    s, model = g.session, kv.model
    assert isinstance(model, FakeModel) and s.slot is not None and model.fill(s.slot, s.n_kv, n)
    kv.fed(s, n)
    s.tokens.append(42)


def test_an_idle_session_gives_its_slot_through_a_hibernate_move(tmp_path: Path) -> None:
    with kv_on_fake_model(tmp_path, hot_slots=1, config_text={"tasks": TASKS}) as kv:
        scheduler, refused = scheduler_on(kv)
        idle, talker = open_session(kv), open_session(kv)
        compute(kv, idle, 6)  # hot, not generating: the only slot
        g = generation(talker, scheduler.admit(talker, None, 4, time.monotonic()))
        scheduler.add(g)
        assert [w.item for w in next_step(scheduler, kv, refused)] == [g] and not refused
        assert idle.tier == "pool" and idle.snapshot is not None and idle.snapshot.n_kv == 6
        assert talker.tier == "hot" and scheduler.running == [g] and scheduler.waiting == []
        assert talker.restore_seconds > 0  # the hibernation it waited for counts as its restore


def test_a_generation_swaps_work_out_once_a_step_and_the_swapped_out_queue_behind(tmp_path: Path) -> None:
    """Every slot generating best-effort work, a voice turn whose KV needs more cells than one swap frees: one
    generation is swapped out, the turn waits (admission closes for the step) instead of swapping out a second."""
    with kv_on_fake_model(tmp_path, hot_slots=2, context_size=256, config_text={"tasks": TASKS}) as kv:
        scheduler, refused = scheduler_on(kv)
        voice = open_session(kv, "voice")
        compute(kv, voice, 120)
        kv.hibernate(voice)  # its 120 cells wait in the pool
        big, small = open_session(kv, "background"), open_session(kv, "background")
        g_big = generation(big, scheduler.admit(big, None, 150, time.monotonic()), prompt=150)
        scheduler.add(g_big)
        g_small = generation(small, scheduler.admit(small, None, 60, time.monotonic()), prompt=60)
        scheduler.add(g_small)
        next_step(scheduler, kv, refused)
        assert scheduler.running == [g_big, g_small]
        compute_fed(g_big, 150, kv)
        compute_fed(g_small, 60, kv)  # 210 of 256 cells held by generating sessions
        urgent = generation(voice, scheduler.admit(voice, None, 4, time.monotonic()))
        scheduler.add(urgent)
        work = next_step(scheduler, kv, refused)
        assert [w.item for w in work] == [g_big] and not refused  # the newer one went: 106 cells free, 120 needed
        assert scheduler.task_stats["background"].preemptions == 1 and small.tier == "pool" and big.tier == "hot"
        assert scheduler.waiting == [urgent, g_small]  # the turn still first; the swapped-out one behind it
