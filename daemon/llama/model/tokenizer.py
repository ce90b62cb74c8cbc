"""The model's vocabulary: text to tokens and back, special tokens, and the GGUF's metadata and chat template."""

from __future__ import annotations

import ctypes
from functools import cached_property

import llama_cpp as lc
import numpy as np

NO_BYTE = -1  # grammar_first_bytes: a token every grammar refuses (no text, or a NUL first)
AN_END = 256  # grammar_first_bytes: an end-of-generation token


class Tokenizer:
    def __init__(self, weights: ctypes.c_void_p):
        self._weights = weights
        self.vocab = lc.llama_model_get_vocab(weights)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self._piece_buf = ctypes.create_string_buffer(256)
        self.token_ids = np.arange(self.n_vocab, dtype=np.int32)  # the id column of a candidate array

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]:
        """``special``: text that spells a special token (a chat template's ``<start_of_turn>``) becomes it."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        out = (lc.llama_token * capacity)()
        n = lc.llama_tokenize(self.vocab, data, len(data), out, capacity, add_bos and self.add_bos, special)
        if n < 0:  # more tokens than bytes can only happen with added specials; retry with the exact size
            capacity = -n
            out = (lc.llama_token * capacity)()
            n = lc.llama_tokenize(self.vocab, data, len(data), out, capacity, add_bos and self.add_bos, special)
        return list(out[:n])

    def token_text(self, token: int) -> str:
        """How a special token is written in text (``<bos>``, ``<end_of_turn>``); "" for none (-1)."""
        if token < 0:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")

    def metadata(self, key: str) -> str:
        """A GGUF metadata value as text ("" when the key is absent)."""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_meta_val_str(self._weights, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else ""

    def chat_template(self) -> str:
        """The GGUF's tokenizer.chat_template ("" when it has none)."""
        template = lc.llama_model_chat_template(self._weights, None)
        return template.decode("utf-8", errors="replace") if template else ""

    def apply_builtin_chat_template(self, template: str, messages: list[tuple[str, str]], add_assistant: bool) -> str:
        """llama.cpp's own C++ rendering of a known template family (it recognises Gemma, ChatML, ...): the
        reference a Jinja rendering is checked against."""
        chat = (lc.llama_chat_message * len(messages))()
        keep = []
        for i, (role, content) in enumerate(messages):
            keep += [role.encode(), content.encode()]
            chat[i].role, chat[i].content = keep[-2], keep[-1]
        size = 1024 + sum(len(c) for _, c in messages) * 2
        buf = ctypes.create_string_buffer(size)
        n = lc.llama_chat_apply_template(template.encode(), chat, len(messages), add_assistant, buf, size)
        if n < 0:
            raise ValueError("llama.cpp does not know this chat template")
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = lc.llama_chat_apply_template(template.encode(), chat, len(messages), add_assistant, buf, n)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (special tokens such as end-of-turn render as nothing)."""
        return self._piece(token, special=False)

    def _piece(self, token: int, special: bool) -> bytes:
        """``special``: a control token as its text (``<start_of_turn>``), as llama.cpp's grammar reads it."""
        n = lc.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
        if n < 0:
            self._piece_buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
        return self._piece_buf.raw[:n]

    @property
    def byte_tokens(self) -> np.ndarray | None:
        """What a grammar is asked about to learn the bytes it lets come next (Sampler.forced,
        Sampler._best_allowed): for each byte value a token that spells that byte alone, then the end-of-generation
        tokens; None when an ASCII byte has no token of its own (a grammar could then let it come unseen)."""
        return self._vocabulary_bytes[0]

    @property
    def grammar_first_bytes(self) -> np.ndarray:
        """Each token's first byte as a grammar reads it (a control token as its text); NO_BYTE where the grammar
        refuses it whatever its state (no text, or a NUL first: llama_grammar_apply_impl), AN_END for an
        end-of-generation token (allowed where the grammar may end, whatever its text)."""
        return self._vocabulary_bytes[1]

    @property
    def longest_piece(self) -> int:
        """The most bytes one token stands for (a control token as its text): a text of more bytes than n times
        this cannot be n tokens or fewer, whatever the tokenizer does."""
        return self._vocabulary_bytes[2]

    @cached_property
    def _vocabulary_bytes(self) -> tuple[np.ndarray | None, np.ndarray, int]:
        """One pass over the vocabulary (0.4 s for 262k tokens), which the engine makes at start
        (Engine._calibrate): byte_tokens, grammar_first_bytes and longest_piece."""
        by_byte: dict[int, int] = {}
        ends: list[int] = []
        first = np.full(self.n_vocab, NO_BYTE, dtype=np.int16)
        longest = 1
        for token in range(self.n_vocab):
            if self.is_end_of_generation(token):
                ends.append(token)
                first[token] = AN_END
                continue
            piece = self.token_bytes(token)
            if len(piece) == 1:
                by_byte.setdefault(piece[0], token)
            read = piece or self._piece(token, special=True)  # (only a control token has no text without it)
            if read and read[0]:
                first[token] = read[0]
            longest = max(longest, len(read))
        table = np.array([*by_byte.values(), *ends], dtype=np.int32)
        return (None if any(b not in by_byte for b in range(128)) else table), first, longest

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))

    def valid_token(self, token: int) -> bool:
        return 0 <= token < self.n_vocab

    def bos_text(self) -> str:
        return self.token_text(lc.llama_vocab_bos(self.vocab)) if self.add_bos else ""

    def eos_text(self) -> str:
        return self.token_text(lc.llama_vocab_eos(self.vocab))
