"""What a constrained generation may produce, checked before llama.cpp sees it (pure logic, no model): integer
bounds as digit grammars, schemas refused by keyword, trigger words escaped into one pattern."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.daemon.llama.constraints import (
    ConstraintError,
    integer_range_gbnf,
    integer_range_regex,
    parse_schema,
    trigger_pattern,
)

bound = st.one_of(st.none(), st.integers(-3000, 3000))


@given(bound, bound)
def test_an_integer_range_spells_exactly_the_numbers_in_it(lo: int | None, hi: int | None) -> None:
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    spelled = re.compile(integer_range_regex(lo, hi) + r"\Z")
    for n in range(-3100, 3100, 7):
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert bool(spelled.match(str(n))) == inside, n
    for edge in (lo, hi):
        if edge is not None:
            assert spelled.match(str(edge))
    assert not spelled.match("-0") and not spelled.match("01") and not spelled.match("")


def test_integer_range_grammar_is_gbnf_alternatives() -> None:
    assert integer_range_gbnf(0, 100) == "([0-9] | [1-9] [0-9] | [1] [0] [0])"
    assert integer_range_gbnf(-5, 5) == '("-" [1-5] | [0-5])'
    with pytest.raises(ConstraintError, match="above its maximum"):
        integer_range_gbnf(3, 2)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ('{"type": "object", "uniqueItems": true}', "`uniqueItems`"),
        ('{"type": "number", "maximum": 3}', "only on integers"),
        ('{"type": "integer", "minimum": 1.5}', "integer bound"),
        ('{"type": "strnig"}', "unknown type"),
        ('{"type": "string", "pattern": "a+"}', r"\^\.\.\.\$"),
        ('{"$ref": "https://example.com/s.json"}', "local references"),
        ('{"properties": {"a": {"enum": []}}}', r"\$\.properties\.a: `enum` must list at least one value"),
        ('{"properties": {"a": {"not": {}}}}', r"\$\.properties\.a: the keyword `not`"),
        ('{"type": "array", "items": {"type": "string", "format": "email"}}', r"\$\.items: format 'email'"),
        ("[1, 2]", "must be a JSON object"),
        ("{", "not valid JSON"),
    ],
)
def test_schemas_with_what_a_grammar_cannot_enforce_are_refused_by_name(schema: str, words: str) -> None:
    with pytest.raises(ConstraintError, match=words):
        parse_schema(schema)


def test_enforced_keywords_and_annotations_pass() -> None:
    schema = parse_schema(
        '{"title": "t", "type": "object", "description": "d", "properties": {"n": {"type": "integer", "minimum": 0,'
        ' "maximum": 9, "examples": [1]}, "s": {"type": "string", "maxLength": 4}}, "required": ["n"],'
        ' "additionalProperties": false}'
    )
    assert schema["properties"]["n"]["maximum"] == 9


def test_trigger_words_become_one_escaped_pattern() -> None:
    pattern = trigger_pattern(["<tool_call>", "a.b", "(x)"])
    assert pattern == r"[\s\S]*?(<tool_call>|a\.b|\(x\))[\s\S]*"
    found = re.fullmatch(pattern, "hello <tool_call>{...}")
    assert found and found.group(1) == "<tool_call>"
    assert not re.fullmatch(pattern, "aXb")  # the dot is a dot
