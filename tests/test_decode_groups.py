"""A step of several sessions that llama.cpp's flash attention would tile across them is decoded in parts
(llama/decode_groups.py): which items go together, what the cost model counts for it, and, on the tiny model,
that the parts give the logits one decode gives and leave the KV as it was when a part finds no room."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.client import Client
from kvpool.daemon.engine.cost_model import CostModel, StepShape, tiled_attention
from kvpool.daemon.kv.codec.kv_types import KV_TYPES
from kvpool.daemon.llama.decode_groups import ATTENTION_TILE_ROWS, decode_groups
from kvpool.daemon.llama.deterministic_mode import Determinism
from kvpool.daemon.llama.kv_settings import KvSettings
from kvpool.daemon.llama.model import Model
from kvpool.protocol import TokenLogprob

from .daemon_process import DaemonProcess
from .test_speculative import GREEDY, PROMPTS, TOP, same_but_at_float_ties, step_records
from .tinymodel import build_tiny_model

Start = Callable[..., DaemonProcess]

TILE = ATTENTION_TILE_ROWS
# Alone, a session's rows take the one-row kernels; beside a long prompt in one decode, the tiled ones (f32 sums
# instead of f16 dot products): log-probabilities move by up to about 0.01 here. Another row's logits would move
# them by far more, or change the token.
BATCH_TIE = 0.05
TOKENS = 120  # each answer: long enough that the long prompt arrives while all are decoding
LONG_PROMPT = "a long prompt that arrives while the others decode, " * 8  # ~420 byte tokens


def test_one_decode_below_the_tile_for_one_item_and_where_the_kernel_never_tiles() -> None:
    assert decode_groups([1] * 8 + [40], TILE) == [list(range(9))]  # 48 rows: each row against its own cells
    assert decode_groups([1] * 8 + [55], TILE) == [list(range(9))]  # 63 rows
    assert decode_groups([300], TILE) == [[0]]  # one sequence: its tiles hold no other
    assert decode_groups([1] * 8 + [300], 0) == [list(range(9))]  # no tiled path (quantized cells, no flash attn)
    assert decode_groups([], TILE) == [[]]


def test_a_prompt_chunk_beside_decode_rows_goes_apart_from_them() -> None:
    rows = [1, 3, 128, 1, 17, 1, 2, 1, 1]
    assert decode_groups(rows, TILE) == [[2], [0, 3, 5, 7, 8, 6, 1, 4]]  # the wide item first, the narrow by size
    # 56 rows: the 8 decode rows and a 56-token chunk reach the tile together, so the chunk goes apart
    assert decode_groups([1] * 8 + [56], TILE) == [list(range(8)), [8]]
    # a short chunk that does not fit beside the decode rows goes with the wide chunks, not into a third decode
    assert decode_groups([55, 215, 215, 1, 5, 5, 5, 5], TILE) == [[1, 2, 0], [3, 4, 5, 6, 7]]


def test_narrow_items_past_a_tile_fill_the_fewest_parts_below_it() -> None:
    rows = [1] * 100
    groups = decode_groups(rows, TILE)
    assert sorted(i for g in groups for i in g) == list(range(100)), "every item once"
    assert [sum(rows[i] for i in g) for g in groups] == [63, 37]
    assert decode_groups([1] * 100 + [200], TILE)[0] == [100, *range(63, 100)]  # past the first part: beside the wide


def test_attention_in_tiles_of_several_sequences_counts_all_their_cells() -> None:
    chunk = [(300, 200, 1)]
    assert tiled_attention(chunk, TILE) == tiled_attention(chunk, 0) == 200 * 300 + 200 * 201 // 2
    decoders = [(1000, 1, 1)] * 8
    step = [*decoders, (500, 128, 1)]
    own = tiled_attention(step, 0)
    assert own == 8 * 1001 + 128 * 500 + 128 * 129 // 2
    # The first tile: the 8 decode rows and the chunk's first 56, each row against the nine sequences' cells (the
    # chunk's up to its 56th row: causal); the next two: the chunk's rows 56-119 and 120-127, against its own.
    first = 64 * (8 * 1001 + 500 + 56)
    rest = 64 * 500 + (120 * 121 - 56 * 57) // 2 + 8 * 500 + (128 * 129 - 120 * 121) // 2
    assert tiled_attention(step, TILE) == first + rest == 590_756  # 7.4 times its own
    assert tiled_attention([*decoders, (500, 40, 1)], TILE) == tiled_attention([*decoders, (500, 40, 1)], 0)  # 48


def test_a_step_runs_in_parts_only_when_the_cost_model_predicts_them_faster() -> None:
    decoders = [(1000, 1, 1)] * 8
    step = [*decoders, (500, 128, 1)]
    cost = CostModel(tile=TILE)
    extra = 0.030  # a decode more
    cost.large.usable = np.array([0.040, 0.001, 0.002, 0.005, 0.0, 0.0, 0.0, extra])  # attention: 5 ms a 10k
    cost.large.reset_factors()
    groups, shape = cost.plan(step)
    assert groups == [[8], list(range(8))] and shape.decodes == 2
    one = StepShape.of(step, TILE)
    wasted = (one.attention - shape.attention) / 1e4 * 0.005
    assert cost.predict(shape) == pytest.approx(cost.predict(one) + extra - wasted)
    assert cost.shape(step) == shape
    cost.large.usable[3] = 0.0  # where attention costs nothing, the second pass over the weights does not pay
    assert cost.plan(step) == ([list(range(9))], one) and cost.shape(step).decodes == 1
    assert CostModel().plan(step)[0] == [list(range(9))]  # a model without a tile never splits
    assert cost.plan([*decoders, (500, 40, 1)])[0] == [list(range(9))]  # below the tile


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Iterator[Model]:
    m = Model(tiny_model, context_size=512, hot_slots=9, batch_size=256, threads=2, draft_rows=64)
    yield m
    m.close()


def test_only_flash_attention_over_unquantized_cells_outside_deterministic_decoding_tiles(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    wide_heads = build_tiny_model(tmp_path_factory.mktemp("wide") / "tiny-wide.gguf", heads=(2, 1))  # q8_0 fits
    f16, q8 = KV_TYPES["f16"], KV_TYPES["q8_0"]
    for kv, tile in (
        (KvSettings(f16, f16, flash_attn=True, rotate_k=False, rotate_v=False), TILE),
        (KvSettings(f16, f16, flash_attn=False, rotate_k=False, rotate_v=False), 0),
        (KvSettings(q8, q8, flash_attn=True, rotate_k=False, rotate_v=False), 0),
    ):
        m = Model(wide_heads, context_size=256, hot_slots=1, batch_size=64, threads=1, kv=kv)
        try:
            assert m.attention_tile_rows == tile, kv.describe()
        finally:
            m.close()
    m = Model(wide_heads, context_size=256, hot_slots=1, batch_size=64, threads=1, determinism=Determinism(on=True))
    try:
        assert m.attention_tile_rows == 0, "deterministic steps stay below the tile"
    finally:
        m.close()


CONTEXT = 40  # tokens each sequence holds before the step
PROMPT = [3 + (i * 37) % 250 for i in range(400)]


def fill(model: Model) -> None:
    model.clear()
    for seq in range(9):
        model.batch.clear()
        model.batch.add(seq, PROMPT[seq : seq + CONTEXT], 0, outputs=False)
        assert model.decode() == 0


def step(model: Model, chunk: int, guessed: int) -> tuple[list[int], list[int]]:
    """A prompt chunk of sequence 8 and sequences 0-7 each decoding one token and ``guessed`` more, every row of
    theirs with logits: the chunk first, as the runner orders a step in parts. Returns the rows with logits and the
    parts."""
    batch = model.batch
    batch.clear()
    rows = [batch.add(8, PROMPT[:chunk], CONTEXT, outputs=True)]
    for seq in range(8):
        last = batch.add(seq, PROMPT[100 + seq : 100 + seq + 1 + guessed], CONTEXT, outputs=1 + guessed)
        rows += range(last - guessed, last + 1)
    return rows, [chunk, 8 * (1 + guessed)]


def test_a_step_in_parts_gives_the_logits_of_one_decode(model: Model) -> None:
    fill(model)
    rows, parts = step(model, 120, 2)
    assert decode_groups([120] + [3] * 8, TILE) == [[0], list(range(1, 9))], "the step these parts come from"
    assert model.decode() == 0
    whole = np.array([model.row_logits(r).copy() for r in rows])
    fill(model)
    rows, parts = step(model, 120, 2)
    assert model.decode(parts) == 0
    split = np.array([model.row_logits(r).copy() for r in rows])
    # Each row's logits, from either kernel (tiled or one row at a time): equal up to rounding, never another row's
    scale = np.abs(whole).max()
    assert np.abs(split - whole).max() <= 1e-2 * scale
    assert (split.argmax(axis=1) == whole.argmax(axis=1)).all()
    distinct = [np.abs(whole[i] - whole[i + 1]).max() for i in range(len(rows) - 1)]
    assert min(distinct) > 1e-2 * scale, "the rows differ, so a row taken for another would show"
    for seq in range(8):
        assert model.highest_position(seq) == CONTEXT + 2
    assert model.highest_position(8) == CONTEXT + 119


def test_a_part_without_room_takes_back_the_parts_before_it(model: Model) -> None:
    fill(model)  # 9 x 40 cells of 512
    held_before = [model.highest_position(seq) for seq in range(9)]
    _, parts = step(model, 130, 6)  # the chunk fits (490 cells), the decode rows after it do not (+56)
    assert model.decode(parts) == 1
    assert [model.highest_position(seq) for seq in range(9)] == held_before, "the chunk's cells are taken back"
    _, parts = step(model, 60, 1)  # what fits still decodes
    assert model.decode(parts) == 0
    assert model.highest_position(8) == CONTEXT + 59


def beside_a_long_prompt(client: Client, prompts: list[str]) -> list[list[TokenLogprob]]:
    """Each prompt's greedy tokens with their log-probabilities, all answered at once while a ninth session's long
    prompt goes in (after each has its first token)."""
    sessions = [client.open_session() for _ in prompts]
    streams = [s.generate(p, max_tokens=TOKENS, logprobs=TOP, **GREEDY) for s, p in zip(sessions, prompts, strict=True)]
    beside: list[list[TokenLogprob]] = [list(next(stream).logprobs or ()) for stream in streams]  # all decoding
    long_prompt = client.open_session().generate(LONG_PROMPT, max_tokens=1, **GREEDY)
    for i, stream in enumerate(streams):
        for chunk in stream:
            beside[i].extend(chunk.logprobs or ())
        assert stream.final is not None and stream.final.usage.completion_tokens == TOKENS
    assert sum(1 for _ in long_prompt) >= 1
    return beside


def test_sessions_decoding_beside_a_long_prompt_answer_as_each_alone(start_daemon: Start, tmp_path: Path) -> None:
    """A real daemon: eight sessions decode while a ninth's long prompt goes in, in steps decoded in parts
    (step_parts = "always"; the step log says so), and each session's tokens and log-probabilities are those it
    has alone, but at float ties: no row is sampled from another's logits. With step_parts = "off", no step is."""
    prompts = [*PROMPTS, *(f"{prompt} (again)" for prompt in PROMPTS)]
    logs = {}
    for parts in ("always", "off"):
        logs[parts] = tmp_path / f"steps-{parts}.jsonl"
        daemon = start_daemon(
            "--hot-slots", "9", "--draft-tokens", "0", "--step-parts", parts, "--step-log", str(logs[parts]), name=parts
        )
        with daemon.client() as client:
            alone = [
                client.open_session().complete(p, max_tokens=TOKENS, logprobs=TOP, **GREEDY).logprobs for p in prompts
            ]
            same_but_at_float_ties(beside_a_long_prompt(client, prompts), alone, tie=BATCH_TIE)
    in_parts = [step for step in step_records(logs["always"]) if step.decodes == 2]
    assert any(
        any(item.pending > 1 for item in step.items) and sum(item.pending == 1 for item in step.items) >= 2
        for step in in_parts
    ), "a step fed the long prompt beside sessions decoding, in two decodes"
    steps = step_records(logs["off"])
    assert all(step.decodes == 1 for step in steps)
    assert any(
        any(item.pending > 1 for item in step.items) and sum(item.pending == 1 for item in step.items) >= 2
        for step in steps
    ), "the same kind of step, in one decode"
