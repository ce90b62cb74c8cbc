"""Grammars: GBNF (a JSON schema converted to it) for llama.cpp's grammar sampler, and the sentence a bad one is
refused with."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import llama_cpp as lc

from kvpool.daemon.llama.constraints import integer_bounds, integer_range_gbnf, trigger_pattern
from kvpool.daemon.llama.model.backend import llama_messages


@dataclass(frozen=True, slots=True)
class Grammar:
    """GBNF whose start rule is ``root``. With trigger words or tokens it is lazy: the text is free until one of
    them is generated, and the grammar applies from there on (it must start with that word)."""

    text: str
    trigger_words: tuple[str, ...] = ()
    trigger_tokens: tuple[int, ...] = ()


class GrammarError(ValueError):
    """llama.cpp refused a grammar (the message is its parser's sentence), or the tokens replayed into it."""


def new_grammar_sampler(vocab: ctypes.c_void_p, grammar: Grammar) -> ctypes.c_void_p:
    """llama.cpp's grammar sampler, or GrammarError with its parser's sentence (which llama.cpp prints to stderr,
    or logs: both are caught here while it parses)."""
    with llama_messages() as messages:
        if grammar.trigger_words or grammar.trigger_tokens:
            patterns = [trigger_pattern(list(grammar.trigger_words))] if grammar.trigger_words else []
            words = (ctypes.c_char_p * len(patterns))(*[w.encode() for w in patterns])
            tokens = (lc.llama_token * len(grammar.trigger_tokens))(*grammar.trigger_tokens)
            sampler = lc.llama_sampler_init_grammar_lazy_patterns(
                vocab, grammar.text.encode(), b"root", words, len(patterns), tokens, len(tokens)
            )
        else:
            sampler = lc.llama_sampler_init_grammar(vocab, grammar.text.encode(), b"root")
    if not sampler:
        raise GrammarError(f"The grammar is not valid GBNF: {_parser_sentence(messages)}")
    return sampler


def _parser_sentence(messages: list[str]) -> str:
    """The parser's reason from what llama.cpp printed (messages[0]) or logged (the rest)."""
    for line in messages[0].splitlines():
        if "error parsing grammar:" in line:
            return line.split("error parsing grammar:", 1)[1].strip()
    logged = [m.strip() for m in messages[1:] if m.strip() and "failed to parse grammar" not in m]
    return logged[0] if logged else "llama.cpp could not parse it."


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """GBNF for the JSON values a (checked, constraints.parse_schema) schema allows, by llama-cpp-python's
    converter (a port of llama.cpp's), with what it lacks: integer bounds, strings whose characters are valid
    JSON (its own admit raw control characters), and a `.` in a pattern that cannot swallow a quote.

    Whitespace is fixed, as Python's json.dumps writes it: one space after each `,` and `:` and none elsewhere
    (the converter's own lets a space or none follow every literal). Then what a schema fixes is one text only —
    `, "room": "` between a record's values — which a generation appends without sampling it (jump-forward,
    docs/speculative.md); a model writes JSON this way unasked (docs/decisions.md)."""
    from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

    class Converter(SchemaConverter):  # type: ignore[misc]
        def visit(self, schema: Any, name: str) -> str:
            bounds = integer_bounds(schema) if isinstance(schema, dict) else None
            if bounds is None:
                return str(super().visit(schema, name))
            rule = name + "-" if name in RESERVED_NAMES else name or "root"
            return str(self._add_rule(rule, integer_range_gbnf(*bounds) + " space"))

    converter = Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        converter.visit(converter.resolve_refs(schema, "schema"), "")
    except KeyError as exc:  # (the converter's rule for a reference is written after what it refers to)
        raise GrammarError(
            f"The JSON schema cannot be turned into a grammar: its top is a reference ({exc}) to a definition that "
            "contains itself; write that definition's keywords at the top (the references inside it can stay)."
            if "$ref" in schema
            else f"The JSON schema cannot be turned into a grammar: the reference {exc} cannot be followed."
        ) from None
    except (AssertionError, ValueError, TypeError, RecursionError) as exc:
        raise GrammarError(f"The JSON schema cannot be turned into a grammar: {exc or type(exc).__name__}.") from None
    rules = converter._rules
    if "char" in rules:
        rules["char"] = JSON_CHAR
    if "dot" in rules:
        rules["dot"] = JSON_CHAR_UNESCAPED
    rules["space"] = '""'
    return _canonical_separators(str(converter.format_grammar()))


def _canonical_separators(gbnf: str) -> str:
    """The converter writes every separator as its literal then the `space` rule (empty here): `"," space`,
    `":" space`. A literal of the schema's own (a key, an enum value) is a JSON string, so its quotes are escaped
    inside the rule's literal and never spell these."""
    return gbnf.replace('"," space', '", "').replace('":" space', '": "')


# Any character JSON allows unescaped (no quote, backslash or control; no surrogate or value past U+10FFFF, which
# llama.cpp's UTF-8 decoder would let through), or an escape. Written as the ranges it allows, not as a class of
# what it leaves out: llama.cpp lets a token end inside a character only where a character the class allows begins
# so, and a class of what it leaves out refuses every such ending whose characters include one it leaves out (a
# lone 0xED, which begins the surrogates and the Korean syllables U+D000-U+D7FF alike).
JSON_CHAR_UNESCAPED = r"[\x20\x21\x23-\x5B\x5D-\x7E\x80-\uD7FF\uE000-\U0010FFFF]"
JSON_CHAR = JSON_CHAR_UNESCAPED + r' | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})'
