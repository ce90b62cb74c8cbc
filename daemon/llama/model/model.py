"""Model: one GGUF loaded once, with one context whose unified KV (``context_size`` cells) is shared by
``hot_slots`` sequences. It composes the parts (loading.py, tokenizer.py, sequences.py, batch.py, sampling.py) into
what the engine and the tiers call: tokens, one multi-sequence ``decode`` per step, per-session samplers, and the
sequences' state. Every method must be called from the engine thread: llama.cpp is not safe for concurrent use of
one context.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import llama_cpp as lc
import numpy as np

from kvpool.daemon.config import sequence_count
from kvpool.daemon.kv.codec.kv_types import F16
from kvpool.daemon.llama.decode_groups import ATTENTION_TILE_ROWS
from kvpool.daemon.llama.deterministic_mode import NOT_DETERMINISTIC, Determinism
from kvpool.daemon.llama.kv_settings import KvSettings
from kvpool.daemon.llama.memory_plan import sliding_window_cells
from kvpool.daemon.llama.model.backend import init_backend
from kvpool.daemon.llama.model.batch import Batch
from kvpool.daemon.llama.model.loading import ModelLoadError, Placement, fingerprint, load_weights
from kvpool.daemon.llama.model.mtmd import EmbeddingBatch, MediaEncoder
from kvpool.daemon.llama.model.sampling import Sampler, SamplingParams
from kvpool.daemon.llama.model.sequences import Sequences
from kvpool.daemon.llama.model.tokenizer import Tokenizer
from kvpool.protocol.status import ModelStatus

# Flash attention takes a tiled path from 64 query rows on, whose sums follow absolute cell indices (ggml-cpu's
# ops.cpp, GGML_FA_TILE_Q): deterministic decoding keeps every batch below it (docs/determinism.md).
DETERMINISTIC_STEP_TOKENS = 62  # (and room for a pad row)
# llama.cpp's rope types that take a position per section (llama_hparams::n_pos_per_embd: M-RoPE, interleaved)
_MROPE_TYPES = (lc.LLAMA_ROPE_TYPE_MROPE, lc.LLAMA_ROPE_TYPE_IMROPE)


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
        placement: Placement | None = None,
        determinism: Determinism = NOT_DETERMINISTIC,
        mmproj: Path | None = None,
        media_threads: int = 0,
        draft_rows: int = 0,
    ):
        """``kv``: the hot KV's types and flash attention (default f16, on). ``determinism``: on, a sequence's
        logits depend on nothing but its own tokens (llama/deterministic_mode.py): no batch of one token or one
        output (a pad row makes two), and cells kept in position order (sequences.py); the assembly also turns
        repacking and llama.cpp's tiled matmul off and the engine keeps batches within DETERMINISTIC_STEP_TOKENS.
        ``mmproj``: a projector GGUF, for images and audio in sessions (mtmd.py; None: text only), encoding with
        ``media_threads`` CPU threads (0: ``threads``). ``draft_rows``: output rows a decode may have beyond one
        per sequence (guessed tokens, engine/drafts.py)."""
        init_backend()
        self.kv = kv or KvSettings(F16, F16, flash_attn=True, rotate_k=False, rotate_v=False)
        self.path = Path(path)
        self.repack = repack
        self._model = load_weights(self.path, placement, repack)
        self.text = Tokenizer(self._model)
        self.vocab, self.n_vocab = self.text.vocab, self.text.n_vocab
        self.token_ids = self.text.token_ids
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = context_size
        batch_size = min(batch_size, context_size)  # llama.cpp takes no more per decode (it clamps n_batch so)
        cparams.n_batch = batch_size
        cparams.n_ubatch = batch_size
        # Sequence ids: the hot slots, then one per shared prefix, then one scratch sequence that a suffix-only
        # snapshot is cut out through (only when sharing is on: every sequence id widens the sliding-window cache).
        self.prefix_seqs = list(range(hot_slots, hot_slots + prefix_slots))
        scratch_seq = hot_slots + prefix_slots if prefix_slots else -1
        self.determinism = determinism
        self.deterministic = determinism.on
        cparams.n_seq_max = sequence_count(hot_slots, prefix_slots, determinism.extra_sequences)
        # Deterministic decoding never frees a cell between compactions: a sequence's cells are handed to the
        # graveyard instead (they stay occupied, masked for everyone), so no later token can land before a
        # sequence's older cells, whose order flash attention's reduction follows. The pad row's sequence holds
        # one cell during a decode (see decode).
        graveyard = cparams.n_seq_max - 1 if determinism.on else -1
        self.pad_seq = cparams.n_seq_max - 2 if determinism.on else -1
        # A step samples at most once per sequence: without this, llama.cpp sizes its logits buffer for a whole
        # batch of outputs (512 x 262k floats = 512 MiB with Gemma 3) that the daemon never uses.
        # Guesses (engine/drafts.py) want a row each, up to ``draft_rows`` in a step.
        cparams.n_outputs_max = cparams.n_seq_max + draft_rows  # llama.cpp reserves its graph for these outputs
        self.draft_rows = draft_rows
        cparams.type_k, cparams.type_v = self.kv.type_k.ggml_id, self.kv.type_v.ggml_id
        cparams.flash_attn_type = (
            lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.kv.flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.swa_full = self.kv.swa_full
        # llama.cpp runs a one-token batch on n_threads and any other on n_threads_batch.
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True  # one pool of cells for all slots: what the KV tiers are built on
        cparams.no_perf = True
        self.tune_context(cparams)
        self.ctx = lc.llama_init_from_model(self._model, cparams)
        if not self.ctx:
            lc.llama_model_free(self._model)
            raise ModelLoadError(
                f"llama.cpp could not create a context of {context_size} cells for {hot_slots} slots "
                f"with {self.path.name} ({self.kv.describe()}); lower context_size or hot_slots, or use f16 "
                "cache types (the log shows llama.cpp's reason)."
            )
        self.context_size = lc.llama_n_ctx(self.ctx)
        self.n_swa = lc.llama_model_n_swa(self._model)  # 0: every layer attends to the whole context
        # Qwen2-VL and its kind: four positions per cell (kv/positions.py), and cells whose saved state carries them
        self.mrope = lc.llama_model_rope_type(self._model) in _MROPE_TYPES
        # Each cache of the model has its own size: the sliding-window one is smaller when the window times the
        # sequences is.
        cell_room = (
            self.context_size
            if not self.n_swa or self.kv.swa_full
            else sliding_window_cells(self.context_size, self.n_swa, cparams.n_seq_max, batch_size)
        )
        self.seqs = Sequences(self.ctx, cell_room, scratch_seq, graveyard)
        self.hot_slots = hot_slots
        self.batch = Batch(batch_size)
        # The last decode in parts: the copied logits of its earlier parts' rows, and where its last part began.
        self._kept: dict[int, np.ndarray] = {}
        self._last_part = 0
        self.description = self._desc()
        self.fingerprint = fingerprint(self.path)
        # What a saved sequence state depends on besides the weights; a pool written with other values is refused.
        self.kv_layout = self.kv.layout
        self.threads = self._decode_threads = threads
        self.media: MediaEncoder | None = None
        self._embeddings: EmbeddingBatch | None = None
        if mmproj is not None:
            n_embd = lc.llama_model_n_embd_inp(self._model)
            try:
                self.media = MediaEncoder(mmproj, self._model, n_embd, media_threads or threads, max_tokens=batch_size)
            except ModelLoadError:
                self.close()
                raise
            self._embeddings = EmbeddingBatch(batch_size, n_embd, mrope=self.media.mrope)

    def tune_context(self, params: lc.llama_context_params) -> None:
        """llama.cpp's context parameters, just before the context is made: the daemon changes nothing here. A
        measurement may, in a subclass of its own (bench/kv_quality.py scores every position of a turn,
        bench/determinism.py runs a one-token batch on other threads)."""

    # ------------------------------------------------------------------ text (tokenizer.py)

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]:
        return self.text.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.text.detokenize(tokens)

    def token_bytes(self, token: int) -> bytes:
        return self.text.token_bytes(token)

    def token_text(self, token: int) -> str:
        return self.text.token_text(token)

    def is_end_of_generation(self, token: int) -> bool:
        return self.text.is_end_of_generation(token)

    @property
    def byte_tokens(self) -> np.ndarray | None:
        return self.text.byte_tokens

    @property
    def grammar_first_bytes(self) -> np.ndarray:
        return self.text.grammar_first_bytes

    @property
    def longest_piece(self) -> int:
        return self.text.longest_piece

    def valid_token(self, token: int) -> bool:
        return self.text.valid_token(token)

    def chat_template(self) -> str:
        return self.text.chat_template()

    def apply_builtin_chat_template(self, template: str, messages: list[tuple[str, str]], add_assistant: bool) -> str:
        return self.text.apply_builtin_chat_template(template, messages, add_assistant)

    # ------------------------------------------------------------------ decoding

    @property
    def attention_tile_rows(self) -> int:
        """The query rows from which llama.cpp's flash attention tiles a batch, wasting work on a tile of several
        sequences (decode_groups.py); 0 where it never does: without flash attention or with cells other than f16
        or f32 (ggml's tiled path takes only those, K and V alike), and in deterministic decoding, whose batches
        stay below it."""
        tiled = self.kv.flash_attn and self.kv.type_k == self.kv.type_v and self.kv.type_k.name in ("f16", "f32")
        return ATTENTION_TILE_ROWS if tiled and not self.deterministic else 0

    def decode(self, parts: Sequence[int] = ()) -> int:
        """Run the filled batch through the model: in one decode, or in ``parts`` (each a count of the batch's
        rows, in order; decode_groups.py). 0: done; 1: no room in the KV (state unchanged)."""
        if len(parts) > 1:
            return self._decode_parts(parts)
        self._in_one_part()
        batch = self.batch
        tokens = batch.n
        # A batch of one token takes other kernels than any larger one (a matrix-vector product; flash attention
        # split across threads), and one output row other kernels than two: deterministic decoding never runs
        # either. A pad row of its own sequence makes it two, then leaves: its cell was the last one taken, so
        # freeing it puts the next token where it would have gone.
        padded = False
        if self.deterministic and tokens < batch.capacity:
            one_output = batch.outputs() == 1
            padded = tokens == 1 or one_output
            if padded:
                batch.add(self.pad_seq, [0], 0, outputs=one_output)
        try:
            rc = lc.llama_decode(self.ctx, batch.as_llama_batch())
        finally:
            if padded:
                self.seqs.free(self.pad_seq)
                batch.n = tokens
        if rc == 0:
            self.seqs.appended += tokens
        return rc

    def _decode_parts(self, parts: Sequence[int]) -> int:
        """The batch in several decodes. The logits of a part's output rows are copied before the next part
        replaces them (the narrow parts, which hold most output rows, run last). A part without room takes back
        the parts before it, so the KV is as it was."""
        batch, start = self.batch, 0
        kept: dict[int, np.ndarray] = {}
        assert sum(parts) == batch.n, "the parts cover the batch"
        assert not self.deterministic, "deterministic decoding runs no step in parts (and pads the one it runs)"
        for i, count in enumerate(parts):
            end = start + count
            rc = lc.llama_decode(self.ctx, batch.rows(start, end))
            if rc != 0:
                for seq, first in batch.sequences(0, start).items():
                    self.seqs.forget_from(seq, first)
                self._in_one_part()
                return rc
            if i < len(parts) - 1:
                for row in np.flatnonzero(batch.logits[start:end]):
                    kept[start + int(row)] = self._logits(int(row)).copy()
            else:
                self._last_part = start
            start = end
        self._kept = kept
        self.seqs.appended += batch.n
        return 0

    def _in_one_part(self) -> None:
        """The next logits are read as one decode's: none kept from earlier parts."""
        self._kept, self._last_part = {}, 0

    def decode_embeddings(
        self,
        seq_id: int,
        rows: np.ndarray,
        first_pos: int,
        non_causal: bool,
        logits: bool,
        positions: np.ndarray | None = None,
    ) -> int:
        """Decode a medium's embedding rows into ``seq_id`` at ``first_pos`` on (an M-RoPE model: at ``positions``,
        [4, rows], mtmd.MediumPositions), as llama.cpp takes them: a batch of their own (non-causal ones in one
        batch, attending to each other both ways). ``logits``: the last row gives them (the prompt ends with the
        medium); sample from row ``len(rows) - 1``. Returns llama_decode's answer."""
        assert self._embeddings is not None, "a model without a projector decodes no embeddings"
        self._in_one_part()
        # Deterministic decoding never runs one output row (another kernel than two): the row before it gives some too.
        outputs = (2 if self.deterministic and len(rows) > 1 else 1) if logits else 0
        self._embeddings.fill(seq_id, rows, first_pos, outputs, positions)
        if non_causal:
            lc.llama_set_causal_attn(self.ctx, False)
        try:
            rc = lc.llama_decode(self.ctx, self._embeddings.as_llama_batch())
        finally:
            if non_causal:
                lc.llama_set_causal_attn(self.ctx, True)
        if rc == 0:
            self.seqs.appended += len(rows)
        return rc

    def decode_with(self, threads: int) -> None:
        """The CPU threads the next decodes take (fewer while an encode runs beside them, media_cache.py)."""
        threads = max(1, min(threads, self.threads))
        if threads != self._decode_threads:
            lc.llama_set_n_threads(self.ctx, threads, threads)
            self._decode_threads = threads

    @property
    def step_tokens(self) -> int:
        """The most tokens one decode may take."""
        if self.deterministic:  # (and room in the batch for a pad row)
            return min(self.batch.capacity - 1, DETERMINISTIC_STEP_TOKENS)
        return self.batch.capacity

    def row_logits(self, row: int) -> np.ndarray:
        """The logits of batch row ``row`` of the last decode (a view: copy to keep)."""
        kept = self._kept.get(row)
        if kept is not None:
            return kept
        assert row >= self._last_part, "a row of an earlier part whose logits were not kept"
        return self._logits(row - self._last_part)

    def _logits(self, row: int) -> np.ndarray:
        """Row ``row`` of what llama.cpp's last decode returned."""
        return np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))

    def output_logits(self, rows: int) -> np.ndarray:
        """The logits of the last decode's first ``rows`` outputs, [rows, n_vocab] (a view: copy to keep)."""
        return np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))

    def new_sampler(self, params: SamplingParams, history: list[int], replay: list[int] | None = None) -> Sampler:
        return Sampler(self, params, history, replay)

    # ------------------------------------------------------------------ the sequences' state (sequences.py)

    def cells_free(self) -> int:
        return self.seqs.cells_free()

    def clear(self) -> None:
        self.seqs.clear()

    def forget_sequence(self, seq_id: int) -> None:
        self.seqs.forget_sequence(seq_id)

    def forget_from(self, seq_id: int, first: int) -> None:
        self.seqs.forget_from(seq_id, first)

    def share_cells(self, src: int, dst: int, first: int, end: int) -> None:
        self.seqs.share_cells(src, dst, first, end)

    def lowest_position(self, seq_id: int) -> int:
        return self.seqs.lowest_position(seq_id)

    def highest_position(self, seq_id: int) -> int:
        return self.seqs.highest_position(seq_id)

    def state_size(self, seq_id: int) -> int:
        return self.seqs.state_size(seq_id)

    def save_state(self, seq_id: int, dest: ctypes.Array[ctypes.c_uint8]) -> int:
        return self.seqs.save_state(seq_id, dest)

    def cells_from(self, seq_id: int, first: int) -> AbstractContextManager[int]:
        return self.seqs.cells_from(seq_id, first)

    def load_state(
        self, seq_id: int, src: ctypes.Array[ctypes.c_uint8], first: int = 0, cells: int | None = None
    ) -> bool:
        return self.seqs.load_state(seq_id, src, first, cells)

    def copy_state(self, seq_id: int, first: int = 0) -> ctypes.Array[ctypes.c_uint8]:
        return self.seqs.copy_state(seq_id, first)

    # ------------------------------------------------------------------ identity

    def _desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

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
            architecture=self.text.metadata("general.architecture"),
            bos_token=self.text.bos_text(),
            eos_token=self.text.eos_text(),
        )

    def close(self) -> None:
        if self.media is not None:
            self.media.close()
            self.media = None
        if self._embeddings is not None:
            self._embeddings.free()
            self._embeddings = None
        if self.ctx:
            self.batch.free()
            lc.llama_free(self.ctx)
            lc.llama_model_free(self._model)
            self.ctx = None
