"""Where a session's cells sit when an image's cells share one position (kv/positions.py): pure logic, no model."""

from __future__ import annotations

import pytest

from kvpool.daemon.kv.positions import MAX_N_POS, Positions, Run, grid_placeholders, in_band, runs_of
from kvpool.daemon.media.media_cache import placeholders


def test_positions_follow_cells_until_a_grid_image_then_move_on_by_its_side() -> None:
    image = grid_placeholders("frame-a", 24, 6)  # a 6x4 grid: 24 cells, the text after moves on by 6
    tokens = [5, 6, 7, *image, 8, 9]
    positions = Positions.of(tokens)
    assert positions.runs == [Run(3, 24, 6)]
    assert [positions.at(i) for i in range(3)] == [0, 1, 2]
    assert {positions.at(i) for i in range(3, 27)} == {3}  # every cell of the image at its first position
    assert positions.at(27) == 9 and positions.at(28) == 10 and positions.at(29) == 11  # past the end: the next
    assert (
        positions.floor(10) == 3 and positions.floor(3) == 3 and positions.floor(27) == 27 and positions.floor(2) == 2
    )


def test_two_images_shift_the_text_after_both() -> None:
    tokens = [1, *grid_placeholders("a", 16, 4), *grid_placeholders("b", 9, 3), 2]
    positions = Positions.of(tokens)
    assert positions.runs == [Run(1, 16, 4), Run(17, 9, 3)]  # back to back, told apart by their start marks
    assert positions.at(17) == 5 and positions.at(25) == 5 and positions.at(26) == 8


def test_plain_placeholders_and_text_keep_position_equal_to_index() -> None:
    tokens = [3, *placeholders("audio", 50), 4]
    assert not any(in_band(t) for t in tokens)
    positions = Positions.of(tokens)
    assert positions.runs == [] and all(positions.at(i) == i for i in range(len(tokens) + 2))


def test_the_same_image_gives_the_same_placeholders_and_another_gives_others() -> None:
    a, again, b = grid_placeholders("x", 16, 4), grid_placeholders("x", 16, 4), grid_placeholders("y", 16, 4)
    assert a == again and not set(a) & set(b) and len(set(a)) == 16
    assert all(in_band(t) for t in a)
    assert not set(a) & set(placeholders("x", 16))  # apart from the plain placeholders' band


def test_a_cut_image_and_impossible_spans_are_refused() -> None:
    image = grid_placeholders("x", 16, 4)
    with pytest.raises(ValueError, match="does not start"):
        runs_of([1, *image[1:]])
    with pytest.raises(ValueError, match="at most"):
        grid_placeholders("x", 16, MAX_N_POS + 1)
    with pytest.raises(ValueError, match="at most"):
        grid_placeholders("x", 16, 0)
