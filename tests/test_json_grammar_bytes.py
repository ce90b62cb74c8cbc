"""A JSON-schema grammar takes every character JSON allows in a string however a token splits it: on the tiny
model's vocabulary (a token per byte) each character is written a byte at a time, through llama.cpp's check of a
token that ends inside a character. And a schema the grammar converter cannot follow is refused with what to write.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.daemon.llama.constraints import parse_schema
from kvpool.daemon.llama.model import Grammar, GrammarError, Model, SamplingParams, json_schema_grammar


def test_a_json_string_takes_every_character_json_allows_byte_by_byte(tiny_model: Path) -> None:
    # (llama.cpp checks a token that ends inside a character against the characters it may begin: a class of what
    # it leaves out refused a lone 0xED, and so the Korean syllables U+D000-U+D7FF, which begin with it)
    model = Model(tiny_model, context_size=128, hot_slots=1, batch_size=32, threads=1)
    grammar = Grammar(json_schema_grammar(parse_schema(json.dumps({"type": "string"}))))

    def admitted(text: bytes) -> bool:
        by_byte = [3 + b for b in text]  # (tests/tinymodel.py: <unk> <s> </s>, then a token per byte)
        sampler = model.new_sampler(SamplingParams(temperature=0.0, grammar=grammar), [])
        try:
            return sampler.admitted(by_byte) == len(by_byte)
        finally:
            sampler.free()

    for text in ["é", "日本", "한국어", "퟿", "\ue000", "𝄞", "\U0010ffff", "~ !#[]"]:
        assert admitted(b'"' + text.encode() + b'"'), text
    # (a surrogate, DEL, a control, a quote past the end, an escape JSON does not have)
    for refused in [b"\xed\xa0\x80", b"\x7f", b"\x1f", b'"', b"\\x"]:
        assert not admitted(b'"' + refused + b'"'), refused


def test_a_top_that_refers_to_itself_is_refused_with_what_to_write() -> None:
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}
    with pytest.raises(GrammarError, match="write that definition's keywords at the top"):
        json_schema_grammar({"$defs": {"node": node}, "$ref": "#/$defs/node"})
    assert json_schema_grammar({"$defs": {"node": node}, **node})  # (written so, the same schema is served)
