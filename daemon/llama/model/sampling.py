"""Sampling one generation's tokens: its parameters, llama.cpp's sampler chain, the grammar that constrains it, and
the log-probabilities reported with each token."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import llama_cpp as lc
import numpy as np

from kvpool.daemon.llama.model.grammar import Grammar, GrammarError, new_grammar_sampler
from kvpool.daemon.llama.model.tokenizer import AN_END
from kvpool.protocol import TokenLogprob, TopLogprob


class Vocabulary(Protocol):
    """What a sampler reads from the model: its vocabulary and the last decode's logits."""

    n_vocab: int
    vocab: ctypes.c_void_p
    token_ids: np.ndarray

    def token_bytes(self, token: int) -> bytes: ...

    @property
    def byte_tokens(self) -> np.ndarray | None: ...  # a token per byte, then the ends (tokenizer.py)

    @property
    def grammar_first_bytes(self) -> np.ndarray: ...  # each token's first byte as a grammar reads it (tokenizer.py)

    def row_logits(self, row: int) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # top log-probabilities to report per token (None: none)
    grammar: Grammar | None = None

    @property
    def penalised(self) -> bool:
        return self.repeat_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


SAMPLER_FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprob: TokenLogprob | None = None


TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data
SUBSET = 512  # a grammar checks the most likely tokens first: the whole vocabulary only when none of them fits
# Where the grammar refuses the greedy token, the next likeliest are asked about one at a time, up to this many,
# before the grammar is run over SUBSET candidates: on Gemma 3's JSON grammar a question takes about 6 us and a pass
# over SUBSET 0.14-0.17 ms, and in bench/speculative.py's JSON answer 5 of the 9 refused tokens had an allowed one
# among the next 8.
ONE_AT_A_TIME = 8


class Sampler:
    """One generation's sampling: llama.cpp's sampler chain (logit bias, penalties, then greedy or top-k, typical,
    top-p, min-p, temperature and a seeded draw) and, apart from it, its grammar, the way llama.cpp's own
    common_sampler combines them: the chain picks, the grammar checks that one token, and only when it refuses
    is the grammar applied to the candidates and the chain run again. A token is accepted (into the grammar and
    the penalties) only once it is chosen: llama.cpp aborts on a token its grammar does not allow. free() it
    when the generation ends."""

    def __init__(self, model: Vocabulary, params: SamplingParams, history: list[int], replay: list[int] | None = None):
        """``history``: the session's tokens (the penalties look back into them); ``replay``: tokens to feed the
        grammar before the first sample (a constrained answer being continued); GrammarError if they do not
        fit it, or if llama.cpp cannot parse the grammar."""
        self._n_vocab = model.n_vocab
        self._params = params
        self._grammar = new_grammar_sampler(model.vocab, params.grammar) if params.grammar is not None else None
        self._chain = _new_chain(model, params)
        self._ids = model.token_ids
        self._piece = model.token_bytes
        self._model = model
        self._row_logits = model.row_logits
        self._one = np.zeros(1, dtype=TOKEN_DATA)
        # Plain greedy is an argmax over the logits row; numpy does it without the sampler chain's copy of the
        # whole vocabulary into a candidate array (262k entries for Gemma 3), the same first-maximum rule.
        self._argmax = params.temperature == 0.0 and not params.logit_bias and not params.penalised
        if params.penalised:  # the penalties count recent tokens: the session's history, not just this turn
            for token in history[-params.repeat_last_n :]:
                if token >= 0:  # (a medium's cells stand as negative ids: no token to penalise)
                    lc.llama_sampler_accept(self._chain, token)
        try:
            for position, token in enumerate(replay or ()):
                if not self._allowed(token):
                    raise GrammarError(
                        f"The session's token {token} at grammar_from + {position} does not fit the grammar: "
                        "continue with the grammar the answer was started with, from where it started."
                    )
                lc.llama_sampler_accept(self._grammar, token)
        except BaseException:
            self.free()
            raise

    def sample(self, row: int) -> Sampled:
        """Sample from the logits of batch row ``row`` of the last decode, and accept the token."""
        logits = self._row_logits(row)
        token = self._greedy(logits) if self._argmax else self._from_chain(logits)
        if self._grammar is not None:
            lc.llama_sampler_accept(self._grammar, token)
        if not self._argmax:
            lc.llama_sampler_accept(self._chain, token)
        if self._params.logprobs is None:
            return Sampled(token)
        return Sampled(token, token_logprob(logits, token, self._params.logprobs, self._piece))

    @property
    def constrained(self) -> bool:
        """It has a grammar (a lazy one too, waiting for its trigger)."""
        return self._grammar is not None

    def admitted(self, guess: list[int]) -> int:
        """How many of ``guess``'s first tokens the grammar lets come next, one after the other (all, without a
        grammar): a copy of the grammar takes them, so this one's state stays as it is."""
        if self._grammar is None or not guess:
            return len(guess)
        if not self._allowed(guess[0]):
            return 0
        probe = lc.llama_sampler_clone(self._grammar)
        try:
            lc.llama_sampler_accept(probe, guess[0])
            for n, token in enumerate(guess[1:], start=1):
                if not self._allowed(token, probe):
                    return n
                lc.llama_sampler_accept(probe, token)
            return len(guess)
        finally:
            lc.llama_sampler_free(probe)

    def forced(self, most: int) -> bytes:
        """The text the grammar lets come next and nothing else, up to ``most`` bytes: b"" without a grammar (or
        a lazy one waiting for its trigger), or where two bytes, or a byte and the end, could come. It stops at a
        byte past ASCII (a character of several bytes: a key's text is ASCII in practice). A copy of the grammar is
        asked, one byte at a time, about a token per byte value (_bytes_allowed): a token that begins with an ASCII
        byte the grammar refuses is refused, so one byte allowed means every allowed token begins with it, but for
        a byte past ASCII that the grammar refuses alone where it allows a character it begins (_best_allowed)."""
        if self._grammar is None or most <= 0:
            return b""
        ids = self._model.byte_tokens
        if ids is None:
            return b""
        out = bytearray()
        probe = lc.llama_sampler_clone(self._grammar)
        try:
            while len(out) < most:
                allowed = np.flatnonzero(self._bytes_allowed(ids, probe))
                if len(allowed) != 1:
                    break
                token = int(ids[allowed[0]])
                piece = self._piece(token)
                if len(piece) != 1 or piece[0] >= 0x80:  # (the end of the answer, or a longer character)
                    break
                lc.llama_sampler_accept(probe, token)
                out += piece
        finally:
            lc.llama_sampler_free(probe)
        return bytes(out)

    def take(self, token: int) -> None:
        """Accept a token that was not sampled (one the grammar forces, appended as it is): the grammar and the
        penalties move on as if it had been."""
        if self._grammar is not None:
            lc.llama_sampler_accept(self._grammar, token)
        if not self._argmax:
            lc.llama_sampler_accept(self._chain, token)

    def _greedy(self, logits: np.ndarray) -> int:
        token = int(logits.argmax())
        if self._grammar is None or self._allowed(token):
            return token
        # The grammar refused the best: the best it allows. The subset is in the order of its logits, ties as
        # they come, so its first allowed token is the one a pass of the grammar over it would pick.
        subset = self._subset(logits)
        for candidate in subset["id"][:ONE_AT_A_TIME].tolist():
            if self._allowed(candidate):
                return candidate
        self._apply(self._grammar, subset)
        if np.isfinite(subset["logit"]).any():
            return int(subset["id"][int(subset["logit"].argmax())])
        best = self._best_allowed(logits)
        if best is not None:
            return best
        raise GrammarError("The grammar allows no token here (not even the end of the answer).")

    def _from_chain(self, logits: np.ndarray) -> int:
        token = self._pick(self._candidates(logits))
        if self._grammar is None or self._allowed(token):
            return token
        # The chain's pick breaks the grammar: the grammar first, then the chain again. With top_k on (and no
        # bias or penalty reordering logits before it), the k best tokens the grammar allows are among the most
        # likely SUBSET whenever at least k of those fit, and then the result is the whole vocabulary's.
        k = self._params.top_k
        if k > 0 and not self._params.logit_bias and not self._params.penalised:
            cand = self._subset(logits)
            self._apply(self._grammar, cand)
            allowed = cand[np.isfinite(cand["logit"])]
            if len(allowed) >= k:
                return self._pick(np.ascontiguousarray(allowed))
        cand = self._candidates(logits)
        self._apply(self._grammar, cand)
        return self._pick(cand)

    def _best_allowed(self, logits: np.ndarray) -> int | None:
        """The likeliest token the grammar allows, the first in id order among equals (None: it allows none): what
        a pass of the grammar over the whole vocabulary gives (20-39 ms for Gemma 3's 262k tokens, about twice in a
        JSON answer, where the schema wants a byte the model did not), asking it about far fewer tokens. A token
        that begins with an ASCII byte the grammar refuses is refused for that byte: the grammar is asked about a
        token per byte value, then about the tokens that begin with an ASCII byte it allowed, and the ends. A byte
        past ASCII alone is half a character, which llama.cpp checks against the characters it may begin, and a
        class such as [^"\\] refuses it wherever it begins one character the class leaves out, though the class
        allows the others (0xED begins the surrogates and Korean syllables): of the tokens that begin so, the
        grammar is asked about those at least as likely as the best found."""
        ids = self._model.byte_tokens
        if ids is None:
            return self._best_of(self._ids, logits)[0]
        byte_allowed = self._bytes_allowed(ids, self._grammar)
        if byte_allowed.all():  # (free text, or a grammar waiting for its trigger: nothing to leave out)
            return self._best_of(self._ids, logits)[0]
        first = self._model.grammar_first_bytes
        allowed = np.zeros(AN_END + 1, dtype=bool)
        allowed[first[ids]] = byte_allowed
        allowed[AN_END] = True
        ascii_first = (first >= 0) & (first < 0x80)
        best, at_least = self._best_of(np.flatnonzero((ascii_first | (first == AN_END)) & allowed[first]), logits)
        past_ascii = np.flatnonzero((first >= 0x80) & (first < AN_END))
        rival, its_logit = self._best_of(past_ascii[logits[past_ascii] >= at_least], logits)
        if rival is not None and (best is None or its_logit > at_least or rival < best):
            return rival
        return best

    def _best_of(self, tokens: np.ndarray, logits: np.ndarray) -> tuple[int | None, float]:
        """Of ``tokens`` (in id order), the likeliest the grammar allows (the first among equals) and its logit;
        (None, -inf) where it allows none."""
        cand = _as_candidates(tokens, logits[tokens])
        self._apply(self._grammar, cand)
        finite = np.isfinite(cand["logit"])
        if not finite.any():
            return None, -np.inf
        i = int(cand["logit"].argmax())
        return int(cand["id"][i]), float(cand["logit"][i])

    def _candidates(self, logits: np.ndarray) -> np.ndarray:
        return _as_candidates(self._ids, logits)

    def _subset(self, logits: np.ndarray) -> np.ndarray:
        """The SUBSET most likely tokens, most likely first."""
        size = min(SUBSET, self._n_vocab)
        top = np.argpartition(logits, -size)[-size:]
        top = top[np.argsort(-logits[top], kind="stable")]
        return _as_candidates(top, logits[top])

    def _pick(self, cand: np.ndarray) -> int:
        array = self._apply(self._chain, cand)
        if array.selected < 0:
            raise GrammarError("The sampler chain selected no token (every candidate was excluded).")
        return int(array.data[array.selected].id)

    @staticmethod
    def _apply(sampler: ctypes.c_void_p, cand: np.ndarray) -> lc.llama_token_data_array:
        array = lc.llama_token_data_array(
            data=cand.ctypes.data_as(lc.llama_token_data_p), size=len(cand), selected=-1, sorted=False
        )
        lc.llama_sampler_apply(sampler, ctypes.byref(array))
        return array

    def _bytes_allowed(self, ids: np.ndarray, grammar: ctypes.c_void_p) -> np.ndarray:
        """For each of the byte table's tokens (``ids``: the model's byte_tokens), whether ``grammar`` lets it come
        next."""
        probe = _as_candidates(ids, 1.0)
        self._apply(grammar, probe)
        return np.isfinite(probe["logit"])

    def _allowed(self, token: int, grammar: ctypes.c_void_p | None = None) -> bool:
        """Whether the grammar (or a copy of it) lets ``token`` come next (a lazy grammar still waiting for its
        trigger allows all)."""
        one = self._one
        one["id"], one["logit"], one["p"] = token, 1.0, 0.0
        self._apply(self._grammar if grammar is None else grammar, one)
        return bool(np.isfinite(one["logit"][0]))

    def free(self) -> None:
        for name in ("_chain", "_grammar"):
            sampler = getattr(self, name, None)
            if sampler is not None:
                lc.llama_sampler_free(sampler)
                setattr(self, name, None)


def _as_candidates(ids: np.ndarray, logits: np.ndarray | float) -> np.ndarray:
    """llama.cpp's candidate array (llama_token_data) of ``ids`` with these ``logits``."""
    cand = np.empty(len(ids), dtype=TOKEN_DATA)
    cand["id"], cand["logit"], cand["p"] = ids, logits, 0.0
    return cand


def token_logprob(logits: np.ndarray, token: int, top: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """``token``'s log-probability under the raw logits (log-softmax over the vocabulary, before any sampler, as
    llama-server reports them by default), and the ``top`` most likely tokens' (most likely first), with the
    bytes each stands for."""
    peak = float(logits.max())
    norm = peak + float(np.log(np.exp(logits - peak, dtype=np.float32).sum(dtype=np.float64)))
    best: list[TopLogprob] = []
    top = min(top, len(logits))
    if top:
        idx = np.argpartition(logits, -top)[-top:]
        idx = idx[np.lexsort((idx, -logits[idx]))]
        best = [TopLogprob(int(i), float(logits[i]) - norm, piece(int(i))) for i in idx]
    return TokenLogprob(token=token, logprob=float(logits[token]) - norm, piece=piece(token), top=best)


def _new_chain(model: Vocabulary, params: SamplingParams) -> ctypes.c_void_p:
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    add = lc.llama_sampler_chain_add
    if params.logit_bias:
        biases = (lc.llama_logit_bias * len(params.logit_bias))(*params.logit_bias)
        add(chain, lc.llama_sampler_init_logit_bias(model.n_vocab, len(params.logit_bias), biases))
    if params.penalised:
        add(
            chain,
            lc.llama_sampler_init_penalties(
                model.n_vocab,
                params.repeat_last_n,
                params.repeat_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            ),
        )
    if params.temperature == 0.0:
        add(chain, lc.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        add(chain, lc.llama_sampler_init_top_k(params.top_k))
    if params.typical_p < 1.0:
        add(chain, lc.llama_sampler_init_typical(params.typical_p, 1))
    add(chain, lc.llama_sampler_init_top_p(params.top_p, 1))
    add(chain, lc.llama_sampler_init_min_p(params.min_p, 1))
    add(chain, lc.llama_sampler_init_temp(params.temperature))
    add(chain, lc.llama_sampler_init_dist(lc.LLAMA_DEFAULT_SEED if params.seed is None else params.seed))
    return chain
