"""Streamed text: whole UTF-8 characters, stop strings held back and cut. Pure."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvpool.daemon.engine.stream_text import StreamText

ROOT = Path(__file__).resolve().parent.parent


def test_multibyte_characters_split_across_tokens() -> None:
    text = StreamText([])
    euro = "€".encode()
    assert [text.feed(euro[:1]), text.feed(euro[1:2]), text.feed(euro[2:] + b"!")] == ["", "", "€!"]


def test_stop_string_is_held_back_and_cut() -> None:
    text = StreamText(["STOP"])
    assert text.feed(b"abc ST") == "abc "
    assert text.feed(b"O") == ""
    assert text.feed(b"Px") == ""
    assert text.stopped and text.flush() == ""


def test_held_text_is_released_when_it_is_not_a_stop() -> None:
    text = StreamText(["STOP"])
    assert text.feed(b"ST") == ""
    assert text.feed(b"AY") == "STAY"
    assert text.feed(b"S") == ""
    assert text.flush() == "S"


@given(st.text(max_size=60), st.lists(st.text(min_size=1, max_size=4), max_size=3), st.data())
def test_streamed_text_equals_text_up_to_first_stop(body: str, stops: list[str], data: st.DataObject) -> None:
    raw = body.encode()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=10)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    text = StreamText(stops)
    out = "".join(text.feed(piece) for piece in pieces) + text.flush()
    first = min((i for i in (body.find(s) for s in stops) if i >= 0), default=-1)
    assert out == (body[:first] if first >= 0 else body)
    assert text.stopped == (first >= 0)
