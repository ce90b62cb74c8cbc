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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as lc
import numpy as np

from kvpool.daemon.config import sequence_count
from kvpool.daemon.kv.codec.kv_types import F16
from kvpool.daemon.llama import ggml_rpc
from kvpool.daemon.llama.ggml_rpc import RemoteDevice
from kvpool.daemon.llama.kv_settings import KvSettings
from kvpool.protocol.status import ModelStatus

log = logging.getLogger("kvpool.llama")

# ggml.h: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5. llama.cpp is chatty at load time, so everything
# but its errors goes to debug; its errors (a failed load, say) are worth a warning in the daemon's log.
_GGML_LOG_LEVEL_ERROR = 4


@lc.llama_log_callback
def _route_llama_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp prints progress dots and continuation pieces too; only whole lines are worth a record.
    message = text.decode("utf-8", errors="replace").rstrip("\n") if text else ""
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
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None


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


class Sampler:
    """A llama.cpp sampler chain owned by one generation; free() it when the generation ends."""

    def __init__(self, model: Model, params: SamplingParams, history: list[int]):
        self._ctx = model.ctx
        self._n_vocab = model.n_vocab
        # Plain greedy is an argmax over the logits row; numpy does it without the sampler chain's copy of the
        # whole vocabulary into a candidate array (262k entries for Gemma 3), the same first-maximum rule.
        self._argmax = params.temperature == 0.0 and params.repeat_penalty == 1.0
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lc.llama_sampler_chain_add
        if params.repeat_penalty != 1.0 and params.repeat_last_n > 0:
            add(
                chain,
                lc.llama_sampler_init_penalties(model.n_vocab, params.repeat_last_n, params.repeat_penalty, 0.0, 0.0),
            )
        if params.temperature == 0.0:
            add(chain, lc.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(chain, lc.llama_sampler_init_top_k(params.top_k))
            add(chain, lc.llama_sampler_init_top_p(params.top_p, 1))
            add(chain, lc.llama_sampler_init_min_p(params.min_p, 1))
            add(chain, lc.llama_sampler_init_temp(params.temperature))
            seed = lc.LLAMA_DEFAULT_SEED if params.seed is None else params.seed
            add(chain, lc.llama_sampler_init_dist(seed))
        # The repeat penalty looks at recent tokens; the session's history counts, not just this turn.
        if params.repeat_penalty != 1.0:
            for token in history[-params.repeat_last_n :]:
                lc.llama_sampler_accept(chain, token)
        self._chain = chain

    def sample(self, batch_index: int) -> int:
        """Sample from the logits of batch row ``batch_index`` of the last decode (and accept the token)."""
        if self._argmax:
            logits = lc.llama_get_logits_ith(self._ctx, batch_index)
            return int(np.ctypeslib.as_array(logits, shape=(self._n_vocab,)).argmax())
        return lc.llama_sampler_sample(self._chain, self._ctx, batch_index)

    def free(self) -> None:
        if self._chain is not None:
            lc.llama_sampler_free(self._chain)
            self._chain = None


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
    ):
        """``kv``: the hot KV's types and flash attention (default f16, on). ``outputs``: rows of logits one
        decode may return (default one per sequence, all a step samples; a quality benchmark wants more)."""
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
        cparams.n_seq_max = sequence_count(hot_slots, prefix_slots)
        # A step samples at most once per sequence: without this, llama.cpp sizes its logits buffer for a whole
        # batch of outputs (512 x 262k floats = 512 MiB with Gemma 3) that the daemon never uses.
        cparams.n_outputs_max = outputs or cparams.n_seq_max  # llama.cpp reserves its graph for these outputs
        cparams.type_k, cparams.type_v = self.kv.type_k.ggml_id, self.kv.type_v.ggml_id
        cparams.flash_attn_type = (
            lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.kv.flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.swa_full = self.kv.swa_full
        cparams.n_threads = threads
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
        self.hot_slots = hot_slots
        self.batch = Batch(batch_size)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self.vocab))
        self.n_swa = lc.llama_model_n_swa(self._model)  # 0: every layer attends to the whole context
        self._piece_buf = ctypes.create_string_buffer(256)
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
        return lc.llama_decode(self.ctx, self.batch.as_llama_batch())

    def output_logits(self, rows: int) -> np.ndarray:
        """The logits of the last decode's first ``rows`` outputs, [rows, n_vocab] (a view: copy to keep)."""
        return np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))

    def new_sampler(self, params: SamplingParams, history: list[int]) -> Sampler:
        return Sampler(self, params, history)

    def forget_sequence(self, seq_id: int) -> None:
        """Free every KV cell of a sequence (the slot becomes empty)."""
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

    def load_state(self, seq_id: int, src: ctypes.Array[ctypes.c_uint8]) -> bool:
        """Restore a saved state into an empty sequence; False when llama.cpp rejects it (no room, mismatch)."""
        self.forget_sequence(seq_id)
        if lc.llama_state_seq_set_data(self.ctx, src, len(src), seq_id) == 0:
            self.forget_sequence(seq_id)
            return False
        return True

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
