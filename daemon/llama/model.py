"""The model layer: the only module that imports llama_cpp.

It loads one GGUF, creates one context whose unified KV (``context_size`` cells) is shared by ``hot_slots``
sequences, and offers what the engine needs: tokenize / detokenize, one multi-sequence ``decode`` per step,
per-session sampler chains, and sequence removal. Every method must be called from the engine thread:
llama.cpp is not safe for concurrent use of one context.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from kvpool.daemon.config import sequence_count
from kvpool.daemon.kv.codec.kv_types import F16
from kvpool.daemon.llama import ggml_rpc
from kvpool.daemon.llama.constraints import integer_bounds, integer_range_gbnf, trigger_pattern
from kvpool.daemon.llama.ggml_rpc import RemoteDevice
from kvpool.daemon.llama.kv_settings import KvSettings
from kvpool.protocol import TokenLogprob, TopLogprob
from kvpool.protocol.status import ModelStatus

log = logging.getLogger("kvpool.llama")

# ggml.h: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5. llama.cpp is chatty at load time, so everything
# but its errors goes to debug; its errors (a failed load, say) are worth a warning in the daemon's log.
_GGML_LOG_LEVEL_ERROR = 4


@lc.llama_log_callback
def _route_llama_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp prints progress dots and continuation pieces too; only whole lines are worth a record.
    message = text.decode("utf-8", errors="replace").rstrip("\n") if text else ""
    if _capture is not None:
        _capture.append(message)
    if message.strip(" ."):
        log.log(logging.WARNING if level == _GGML_LOG_LEVEL_ERROR else logging.DEBUG, "%s", message)


_backend_ready = False


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        lc.llama_log_set(_route_llama_log, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _backend_ready = True


@dataclass(frozen=True, slots=True)
class Grammar:
    """GBNF whose start rule is ``root``. With trigger words or tokens it is lazy: the text is free until one of
    them is generated, and the grammar applies from there on (it must start with that word)."""

    text: str
    trigger_words: tuple[str, ...] = ()
    trigger_tokens: tuple[int, ...] = ()


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


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprob: TokenLogprob | None = None


def system_info() -> str:
    """llama.cpp's compiled-in features per backend, e.g. "CPU : SSE3 = 1 | AVX2 = 1 | ... | REPACK = 1 | "."""
    _init_backend()
    return lc.llama_print_system_info().decode("utf-8", errors="replace")


def supports_rpc() -> bool:
    """Whether this llama-cpp-python build has the RPC backend (GGML_RPC=ON)."""
    _init_backend()
    return bool(lc.llama_supports_rpc()) and ggml_rpc.has_rpc_backend()


def register_workers(endpoints: list[str]) -> list[RemoteDevice]:
    """Connect to each RPC worker and register its devices with ggml (llama-cpp-python 0.3.36 no longer takes
    ``rpc_servers``). A worker that is down makes ggml abort: check each one answers first."""
    _init_backend()
    devices: list[RemoteDevice] = []
    for endpoint in endpoints:
        devices += ggml_rpc.add_server(endpoint)
    return devices


@dataclass(frozen=True, slots=True)
class Placement:
    """Where llama.cpp puts the layers: ``devices`` (RPC workers) get ``offloaded`` layers counted from the
    output end (llama.cpp's n_gpu_layers), shared by ``tensor_split`` (empty: by their free memory)."""

    devices: list[RemoteDevice]
    offloaded: int
    tensor_split: list[float]


class ModelLoadError(Exception):
    """The GGUF could not be loaded or the context could not be created."""


# Flash attention takes a tiled path from 64 query rows on, whose sums follow absolute cell indices (ggml-cpu's
# ops.cpp, GGML_FA_TILE_Q): deterministic decoding keeps every batch below it (docs/determinism.md).
DETERMINISTIC_STEP_TOKENS = 63


class GrammarError(ValueError):
    """llama.cpp refused a grammar (the message is its parser's sentence), or the tokens replayed into it."""


TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data
SUBSET = 512  # a grammar checks the most likely tokens first: the whole vocabulary only when none of them fits


class Sampler:
    """One generation's sampling: llama.cpp's sampler chain (logit bias, penalties, then greedy or top-k, typical,
    top-p, min-p, temperature and a seeded draw) and, apart from it, its grammar, the way llama.cpp's own
    common_sampler combines them: the chain picks, the grammar checks that one token, and only when it refuses
    is the grammar applied to the candidates and the chain run again. A token is accepted (into the grammar and
    the penalties) only once it is chosen: llama.cpp aborts on a token its grammar does not allow. free() it
    when the generation ends."""

    def __init__(self, model: Model, params: SamplingParams, history: list[int], replay: list[int] | None = None):
        """``history``: the session's tokens (the penalties look back into them); ``replay``: tokens to feed the
        grammar before the first sample (a constrained answer being continued); GrammarError if they do not
        fit it, or if llama.cpp cannot parse the grammar."""
        self._n_vocab = model.n_vocab
        self._params = params
        self._grammar = _new_grammar(model, params.grammar) if params.grammar is not None else None
        self._chain = _new_chain(model, params)
        self._ids = model.token_ids
        self._piece = model.token_bytes
        self._row_logits = model.row_logits
        self._one = np.zeros(1, dtype=TOKEN_DATA)
        # Plain greedy is an argmax over the logits row; numpy does it without the sampler chain's copy of the
        # whole vocabulary into a candidate array (262k entries for Gemma 3), the same first-maximum rule.
        self._argmax = params.temperature == 0.0 and not params.logit_bias and not params.penalised
        if params.penalised:  # the penalties count recent tokens: the session's history, not just this turn
            for token in history[-params.repeat_last_n :]:
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

    def _greedy(self, logits: np.ndarray) -> int:
        token = int(logits.argmax())
        if self._grammar is None or self._allowed(token):
            return token
        for candidates in (self._subset(logits), None):  # the grammar refused the best: the best it allows
            cand = self._candidates(logits) if candidates is None else candidates
            self._apply(self._grammar, cand)
            if np.isfinite(cand["logit"]).any():
                return int(cand["id"][int(cand["logit"].argmax())])
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

    def _candidates(self, logits: np.ndarray) -> np.ndarray:
        cand = np.empty(self._n_vocab, dtype=TOKEN_DATA)
        cand["id"] = self._ids
        cand["logit"] = logits
        cand["p"] = 0.0
        return cand

    def _subset(self, logits: np.ndarray) -> np.ndarray:
        """The SUBSET most likely tokens, most likely first."""
        size = min(SUBSET, self._n_vocab)
        top = np.argpartition(logits, -size)[-size:]
        top = top[np.argsort(-logits[top], kind="stable")]
        cand = np.empty(len(top), dtype=TOKEN_DATA)
        cand["id"], cand["logit"], cand["p"] = top, logits[top], 0.0
        return cand

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

    def _allowed(self, token: int) -> bool:
        """Whether the grammar lets ``token`` come next (a lazy grammar still waiting for its trigger allows all)."""
        one = self._one
        one["id"], one["logit"], one["p"] = token, 1.0, 0.0
        self._apply(self._grammar, one)
        return bool(np.isfinite(one["logit"][0]))

    def free(self) -> None:
        for name in ("_chain", "_grammar"):
            sampler = getattr(self, name, None)
            if sampler is not None:
                lc.llama_sampler_free(sampler)
                setattr(self, name, None)


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


def _new_chain(model: Model, params: SamplingParams) -> ctypes.c_void_p:
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


def _new_grammar(model: Model, grammar: Grammar) -> ctypes.c_void_p:
    """llama.cpp's grammar sampler, or GrammarError with its parser's sentence (which llama.cpp prints to stderr,
    or logs: both are caught here while it parses)."""
    with _llama_messages() as messages:
        if grammar.trigger_words or grammar.trigger_tokens:
            patterns = [trigger_pattern(list(grammar.trigger_words))] if grammar.trigger_words else []
            words = (ctypes.c_char_p * len(patterns))(*[w.encode() for w in patterns])
            tokens = (lc.llama_token * len(grammar.trigger_tokens))(*grammar.trigger_tokens)
            sampler = lc.llama_sampler_init_grammar_lazy_patterns(
                model.vocab, grammar.text.encode(), b"root", words, len(patterns), tokens, len(tokens)
            )
        else:
            sampler = lc.llama_sampler_init_grammar(model.vocab, grammar.text.encode(), b"root")
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


_capture: list[str] | None = None  # llama.cpp's log lines, while _llama_messages() listens


@contextmanager
def _llama_messages() -> Iterator[list[str]]:
    """What llama.cpp says while the block runs: its log lines, and what it prints to stderr (the grammar parser
    prints its reason there). fd 2 is redirected only for that call."""
    global _capture
    messages: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as printed:
        os.dup2(printed.fileno(), 2)
        _capture = messages
        try:
            yield messages
        finally:
            _capture = None
            os.dup2(saved, 2)
            os.close(saved)
            printed.seek(0)
            messages.insert(0, printed.read(1 << 16).decode("utf-8", errors="replace"))


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """GBNF for the JSON values a (checked, constraints.parse_schema) schema allows, by llama-cpp-python's
    converter (a port of llama.cpp's), with what it lacks: integer bounds, strings whose characters are valid
    JSON (its own admit raw control characters), and a `.` in a pattern that cannot swallow a quote."""
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
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise GrammarError(f"The JSON schema cannot be turned into a grammar: {exc or type(exc).__name__}.") from None
    rules = converter._rules
    if "char" in rules:
        rules["char"] = JSON_CHAR
    if "dot" in rules:
        rules["dot"] = JSON_CHAR_UNESCAPED
    return str(converter.format_grammar())


# Any character JSON allows unescaped (no quote, backslash or control; no surrogate or value past U+10FFFF, which
# llama.cpp's UTF-8 decoder would let through), or an escape.
JSON_CHAR_UNESCAPED = r'[^"\\\x7F\x00-\x1F\uD800-\uDFFF\U00110000-\U001FFFFF]'
JSON_CHAR = JSON_CHAR_UNESCAPED + r' | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})'


class Batch:
    """A reusable llama_batch with numpy views on its arrays, so filling it costs no per-token ctypes calls."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._batch = lc.llama_batch_init(capacity, 0, 1)
        b = self._batch
        self.token = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        n_seq_id = np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))
        n_seq_id[:] = 1
        # seq_id is an array of per-token pointers, each to one int32 (n_seq_max = 1 per token).
        self._seq_rows = [b.seq_id[i] for i in range(capacity)]
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(
        self, seq_id: int, tokens: list[int], first_pos: int, want_last_logits: bool, all_logits: bool = False
    ) -> int:
        """Append ``tokens`` of one sequence; returns the batch row of the last token (for sampling).
        ``all_logits``: every token's row (a benchmark scoring each position; the context needs the outputs)."""
        start, count = self.n, len(tokens)
        end = start + count
        self.token[start:end] = tokens
        self.pos[start:end] = np.arange(first_pos, first_pos + count, dtype=np.int32)
        self.logits[start:end] = int(all_logits)
        if want_last_logits:
            self.logits[end - 1] = 1
        rows = self._seq_rows
        for i in range(start, end):
            rows[i][0] = seq_id
        self.n = end
        return end - 1

    def as_llama_batch(self) -> lc.llama_batch:
        self._batch.n_tokens = self.n
        return self._batch

    def free(self) -> None:
        lc.llama_batch_free(self._batch)


class Model:
    def __init__(
        self,
        path: Path,
        *,
        context_size: int,
        hot_slots: int,
        batch_size: int,
        threads: int,
        prefix_slots: int = 0,
        repack: bool = True,
        kv: KvSettings | None = None,
        outputs: int = 0,
        placement: Placement | None = None,
        lone_threads: int = 0,
        deterministic: bool = False,
    ):
        """``kv``: the hot KV's types and flash attention (default f16, on). ``outputs``: rows of logits one
        decode may return (default one per sequence, all a step samples; a quality benchmark wants more).
        ``lone_threads``: threads for a one-token batch (default ``threads``). ``deterministic``: a sequence's
        logits depend on nothing but its own tokens (docs/determinism.md): one-token batches on one thread, and
        cells kept in position order (see keep_cell_order); the caller also turns repacking and llama.cpp's
        tiled matmul off and keeps batches under DETERMINISTIC_STEP_TOKENS."""
        _init_backend()
        self.kv = kv or KvSettings(F16, F16, flash_attn=True, rotate_k=False, rotate_v=False)
        self.path = Path(path)
        mparams = lc.llama_model_default_params()
        if placement is not None and placement.devices:
            # Passed explicitly: llama.cpp's default device selection is not relied on to pick the workers.
            devices = (ctypes.c_void_p * (len(placement.devices) + 1))(*[d.handle for d in placement.devices], None)
            mparams.devices = ctypes.cast(devices, ctypes.c_void_p)
            mparams.n_gpu_layers = placement.offloaded
            split = (ctypes.c_float * lc.llama_max_devices())(*placement.tensor_split)
            mparams.tensor_split = split
            self._keep_alive = (devices, split)  # llama.cpp reads both while loading
        # llama.cpp's extra buffer types repack weights for faster CPU kernels (AVX2/AVX-512/NEON, AMX); whether
        # this CPU can run them is decided before loading (cpu_repack). Repacking does not change the KV state.
        mparams.use_extra_bufts = repack
        self.repack = repack
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path}: the file is not a GGUF model it supports, or is damaged"
                + (" (or the rpc workers lack the memory for their layers)." if placement else ".")
            )
        self.vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = context_size
        cparams.n_batch = batch_size
        cparams.n_ubatch = batch_size
        # Sequence ids: the hot slots, then one per shared prefix, then one scratch sequence that a suffix-only
        # snapshot is cut out through (only when sharing is on: every sequence id widens the sliding-window cache).
        self.prefix_seqs = list(range(hot_slots, hot_slots + prefix_slots))
        self.scratch_seq = hot_slots + prefix_slots if prefix_slots else -1
        self.deterministic = deterministic
        cparams.n_seq_max = sequence_count(hot_slots, prefix_slots, deterministic)
        # Deterministic decoding never frees a cell between compactions: a sequence's cells are handed to this one
        # instead (they stay occupied, masked for everyone), so no later token can land before a sequence's older
        # cells, whose order flash attention's reduction follows.
        self.graveyard = cparams.n_seq_max - 1 if deterministic else -1
        # A step samples at most once per sequence: without this, llama.cpp sizes its logits buffer for a whole
        # batch of outputs (512 x 262k floats = 512 MiB with Gemma 3) that the daemon never uses.
        cparams.n_outputs_max = outputs or cparams.n_seq_max  # llama.cpp reserves its graph for these outputs
        cparams.type_k, cparams.type_v = self.kv.type_k.ggml_id, self.kv.type_v.ggml_id
        cparams.flash_attn_type = (
            lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.kv.flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.swa_full = self.kv.swa_full
        # llama.cpp runs a one-token batch on n_threads and any other on n_threads_batch.
        cparams.n_threads = 1 if deterministic else (lone_threads or threads)
        cparams.n_threads_batch = threads
        cparams.kv_unified = True  # one pool of cells for all slots: what the KV tiers are built on
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self._model, cparams)
        if not self.ctx:
            lc.llama_model_free(self._model)
            raise ModelLoadError(
                f"llama.cpp could not create a context of {context_size} cells for {hot_slots} slots "
                f"with {self.path.name} ({self.kv.describe()}); lower context_size or hot_slots, or use f16 "
                "cache types (the log shows llama.cpp's reason)."
            )
        self.memory = lc.llama_get_memory(self.ctx)
        self.context_size = lc.llama_n_ctx(self.ctx)
        self.n_swa = lc.llama_model_n_swa(self._model)  # 0: every layer attends to the whole context
        # Cells appended since the KV was last laid out (deterministic decoding): the cells before this count are
        # taken (live or in the graveyard), those after it free. Each cache of the model has its own size: the
        # sliding-window one (llama-kv-cache-iswa.cpp) is smaller when the window times the sequences is.
        self.appended = 0
        swa_cells = self.n_swa * cparams.n_seq_max + batch_size
        self.cell_room = self.context_size if not self.n_swa or self.kv.swa_full else min(
            self.context_size, -(-swa_cells // 256) * 256
        )
        self.hot_slots = hot_slots
        self.batch = Batch(batch_size)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self._piece_buf = ctypes.create_string_buffer(256)
        self.token_ids = np.arange(self.n_vocab, dtype=np.int32)  # the id column of a candidate array
        self.description = self._desc()
        self.fingerprint = self._fingerprint()
        # What a saved sequence state depends on besides the weights; a pool written with other values is refused.
        self.kv_layout = self.kv.layout

    # ------------------------------------------------------------------ text

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
        n = lc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else ""

    def chat_template(self) -> str:
        """The GGUF's tokenizer.chat_template ("" when it has none)."""
        template = lc.llama_model_chat_template(self._model, None)
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
        n = lc.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
        if n < 0:
            self._piece_buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
        return self._piece_buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))

    def valid_token(self, token: int) -> bool:
        return 0 <= token < self.n_vocab

    # ------------------------------------------------------------------ decoding

    def decode(self) -> int:
        """Run the filled batch through the model. 0: done; 1: no room in the KV (state unchanged)."""
        rc = lc.llama_decode(self.ctx, self.batch.as_llama_batch())
        if rc == 0:
            self.appended += self.batch.n
        return rc

    @property
    def step_tokens(self) -> int:
        """The most tokens one decode may take."""
        return min(self.batch.capacity, DETERMINISTIC_STEP_TOKENS) if self.deterministic else self.batch.capacity

    def cells_free(self) -> int:
        """Deterministic decoding: cells left after the last appended one (a compaction makes more)."""
        return self.cell_room - self.appended

    def clear(self) -> None:
        """Empty the whole KV (every sequence, the graveyard too): the first step of a compaction."""
        lc.llama_memory_clear(self.memory, False)
        self.appended = 0

    def row_logits(self, row: int) -> np.ndarray:
        """The logits of batch row ``row`` of the last decode (a view: copy to keep)."""
        return np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))

    def output_logits(self, rows: int) -> np.ndarray:
        """The logits of the last decode's first ``rows`` outputs, [rows, n_vocab] (a view: copy to keep)."""
        return np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))

    def new_sampler(self, params: SamplingParams, history: list[int], replay: list[int] | None = None) -> Sampler:
        return Sampler(self, params, history, replay)

    def forget_sequence(self, seq_id: int) -> None:
        """Empty a sequence (the slot becomes empty). Its cells are freed, or, in deterministic decoding, handed
        to the graveyard: a freed cell would take the next token of any sequence out of position order."""
        if self.graveyard >= 0 and seq_id != self.graveyard:
            lc.llama_memory_seq_cp(self.memory, seq_id, self.graveyard, -1, -1)
        lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def share_cells(self, src: int, dst: int, first: int, end: int) -> None:
        """Give ``dst`` the cells of ``src`` for positions [first, end) (end -1: all): the cells are shared in the
        unified KV (one more sequence id on each), not copied."""
        lc.llama_memory_seq_cp(self.memory, src, dst, first, end)

    def lowest_position(self, seq_id: int) -> int:
        """The lowest position whose cells the sequence holds (-1 when empty). Above 0 after a sliding-window
        model has moved past its window, or after a restore: positions below it cannot be shared."""
        return lc.llama_memory_seq_pos_min(self.memory, seq_id)

    def highest_position(self, seq_id: int) -> int:
        """The highest position the sequence holds cells for (-1 when empty)."""
        return lc.llama_memory_seq_pos_max(self.memory, seq_id)

    def state_size(self, seq_id: int) -> int:
        """Bytes llama_state_seq_get_data needs for the sequence's KV cells."""
        return lc.llama_state_seq_get_size(self.ctx, seq_id)

    def save_state(self, seq_id: int, dest: ctypes.Array[ctypes.c_uint8]) -> int:
        """Copy the sequence's KV state into ``dest`` (e.g. a view of the shared-memory pool); bytes written."""
        return lc.llama_state_seq_get_data(self.ctx, dest, len(dest), seq_id)

    @contextmanager
    def cells_from(self, seq_id: int, first: int) -> Iterator[int]:
        """A sequence holding just ``seq_id``'s cells at positions >= ``first`` (a suffix past a shared prefix),
        to size and save: the scratch sequence, sharing those cells while the block runs (``first`` 0: the
        sequence itself)."""
        if not first:
            yield seq_id
            return
        self.share_cells(seq_id, self.scratch_seq, first, -1)
        try:
            yield self.scratch_seq
        finally:
            self.forget_sequence(self.scratch_seq)

    def load_state(self, seq_id: int, src: ctypes.Array[ctypes.c_uint8], first: int = 0) -> bool:
        """Restore a saved state into an empty sequence; False when llama.cpp rejects it (no room, mismatch).
        ``first``: the state's first position (a suffix past a shared prefix starts there): the full-attention
        cache gets a cell for every position from it on (llama.cpp reports positions of the sliding-window cache,
        which may start later)."""
        self.forget_sequence(seq_id)
        if lc.llama_state_seq_set_data(self.ctx, src, len(src), seq_id) == 0:
            self.forget_sequence(seq_id)
            return False
        high = self.highest_position(seq_id)
        self.appended += high - first + 1 if high >= first else 0
        return True

    def copy_state(self, seq_id: int, first: int = 0) -> ctypes.Array[ctypes.c_uint8]:
        """The sequence's state from position ``first`` on, in a buffer of its own (a compaction's copy)."""
        with self.cells_from(seq_id, first) as seq:
            buf = (ctypes.c_uint8 * self.state_size(seq))()
            written = self.save_state(seq, buf)
        return (ctypes.c_uint8 * written).from_buffer(buf) if written != len(buf) else buf

    # ------------------------------------------------------------------ identity

    def _desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def _fingerprint(self) -> str:
        """Identifies the weights: file size plus hashes of its head and tail (hashing 250 MB at every start
        would cost seconds on a device; the GGUF header and tensor data at both ends change with any model)."""
        size = self.path.stat().st_size
        digest = hashlib.sha256(str(size).encode())
        with self.path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
        return digest.hexdigest()[:32]

    def info(self) -> ModelStatus:
        return ModelStatus(
            path=str(self.path),
            description=self.description,
            fingerprint=self.fingerprint,
            n_vocab=self.n_vocab,
            n_params=lc.llama_model_n_params(self._model),
            size_bytes=lc.llama_model_size(self._model),
            context_size=self.context_size,
            context_size_train=lc.llama_model_n_ctx_train(self._model),
            sliding_window=lc.llama_model_n_swa(self._model),
            cpu_repack=self.repack,
            deterministic=self.deterministic,
            kv_type_k=self.kv.type_k.name,
            kv_type_v=self.kv.type_v.name,
            flash_attn=self.kv.flash_attn,
            chat_template=self.chat_template(),
            architecture=self.metadata("general.architecture"),
            bos_token=self.token_text(lc.llama_vocab_bos(self.vocab)) if self.add_bos else "",
            eos_token=self.token_text(lc.llama_vocab_eos(self.vocab)),
        )

    def close(self) -> None:
        if self.ctx:
            self.batch.free()
            lc.llama_free(self.ctx)
            lc.llama_model_free(self._model)
            self.ctx = None
