"""Grammar jump-forward: the text a generation's grammar forces next, appended without sampling it.

Where a constrained generation's grammar lets one text only come next (a JSON schema's `", "room": "` between a
record's values, a tool envelope's fixed words), sampling it token by token would only compute what is known. The
engine appends its tokens to the answer at once, as if sampled (the grammar and the penalties take them), and the
next step computes them like a prompt chunk (no logits rows, no output projection) and samples after the last.

Its tokens are the tokenizer's: the forced text is tokenized in its context (after the answer's last few tokens'
text), and it goes only when that context tokenizes as it is and the text after it as the forced text, so that no
token would span the boundary; appended, its last token is left to the model, which may write it merged with what
follows (`"` and the value's first letters). A model may still split the same text otherwise when it samples it
(Gemma 3 writes ` {` `"` where its tokenizer writes ` {"`): the text is the grammar's either way, but the answer's
later tokens may differ from what sampling every token would give. Fed as a guess instead (jump_forward = "guess"),
sampling verifies every token. Pure logic, no llama.cpp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

JUMP_BYTES = 256  # the most forced text asked for at once
CONTEXT_TOKENS = 3  # the answer's tokens the forced text is tokenized after


class Tokens(Protocol):
    """What the tokens of a forced text are read with (the model's tokenizer)."""

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...


def jump_mode(setting: str, draft_tokens: int, logprobs: bool) -> str:
    """How a constrained answer's forced text goes ("guess", "append" or "off"), from the ``jump_forward`` setting: a
    forced token has no logits, so an answer that reports log-probabilities has it guessed instead of appended; a
    guess needs guesses on (``draft_tokens``)."""
    mode = "guess" if setting == "append" and logprobs else setting
    return "off" if mode == "guess" and not draft_tokens else mode


def forced_after(context: list[int], forced: bytes, model: Tokens) -> list[int]:
    """forced_tokens, with the model's tokenizer."""
    return forced_tokens(context, forced, lambda text: model.tokenize(text, add_bos=False), model.token_bytes)


def forced_tokens(
    context: list[int], forced: bytes, tokenize: Callable[[str], list[int]], piece: Callable[[int], bytes]
) -> list[int]:
    """The tokens of ``forced`` (what a grammar lets come after ``context``, the answer's last tokens, and nothing
    else): its tokens in that context, as far as they spell it; [] when the boundary would move (a token of the
    context would merge with the forced text).
    (A tokenizer may spell some of the text otherwise than the model writes it, as a SentencePiece vocabulary
    without a token for its space mark: the tokens up to there still go.)"""
    if not forced or not context or any(t < 0 for t in context):
        return []
    try:
        before = b"".join(piece(t) for t in context).decode("utf-8")
        text = forced.decode("utf-8")
    except UnicodeDecodeError:  # (the context ends inside a character: its tokens are not the text's)
        return []
    head = tokenize(before)
    whole = tokenize(before + text)
    if whole[: len(head)] != head:
        return []
    spelled, end = [], 0
    for token in whole[len(head) :]:
        part = piece(token)
        if not part or forced[end : end + len(part)] != part:
            break
        spelled.append(token)
        end += len(part)
    return spelled
