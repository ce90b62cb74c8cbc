"""What storing a snapshot's K and V rows at smaller codings costs a model's answers, measured on the model itself.

A text (by default one shipped with Python, pydoc_data.topics) is cut into windows. In each, the context part is
computed with f16 K and V and flash attention (the daemon's default) and saved as the sequence's state; the
state is stored at a coding and written back at f16 through the codec a tier uses, loaded, and the window's
scored part is computed after it with a logit row for every position. Each position's next-token distribution
is compared with the one after the uncompressed state: mean KL divergence and top-1 agreement. The noise floor
is measured beside it: the same text through llama.cpp's other f16 attention path (flash attention off).
Used by `kvpool-kv-profile` (profile_command.py) and bench/kv_quality.py.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvpool.daemon.kv.codec.kv_types import StoreType
from kvpool.daemon.kv.codec.state_format import parse
from kvpool.daemon.kv.codec.tier_codec import TierCodec
from kvpool.daemon.llama.kv_settings import resolve_kv_settings
from kvpool.daemon.llama.memory_plan import model_shape
from kvpool.daemon.llama.model import Model


class ScoringModel(Model):
    """Every position of a batch gives its logits (the daemon's model gives one row per sequence)."""

    def __init__(self, path: Path, **settings) -> None:  # type: ignore[no-untyped-def]
        self.batch_capacity = settings["batch_size"]
        super().__init__(path, **settings)

    def tune_context(self, params) -> None:  # type: ignore[no-untyped-def]
        params.n_outputs_max = self.batch_capacity


def text_tokens(model: Model, count: int, text: str | None = None) -> list[int]:
    """The first ``count`` tokens of ``text`` (default: Python's own pydoc topics, English prose and code)."""
    if text is None:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
    tokens = model.tokenize(text[: count * 16], add_bos=True)
    if len(tokens) < count:
        raise ValueError(f"the text has {len(tokens)} tokens; {count} are needed")
    return tokens[:count]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@dataclass
class Score:
    """Per scored position: KL divergence from the reference, and whether the most likely token is the same."""

    kld: list[np.ndarray] = field(default_factory=list)
    agree: list[np.ndarray] = field(default_factory=list)

    def add(self, ref_logp: np.ndarray, logp: np.ndarray) -> None:
        self.kld.append((np.exp(ref_logp) * (ref_logp - logp)).sum(axis=1))
        self.agree.append(logp.argmax(axis=1) == ref_logp.argmax(axis=1))

    @property
    def mean_kld(self) -> float:
        return float(np.concatenate(self.kld).mean())

    @property
    def top1(self) -> float:
        return float(np.concatenate(self.agree).mean())


@dataclass(frozen=True)
class Window:
    tokens: list[int]  # context, then the scored part
    context: int


class SensitivityMeter:
    """A reference context and a noise-floor context of one model, and the windows of text both score."""

    def __init__(
        self, path: Path, *, context: int, score: int, windows: int, threads: int, text: str | None = None
    ) -> None:
        shape = model_shape(path)
        self.context, self.score = context, score
        self.models: list[ScoringModel] = []
        for flash_attn in ("auto", "off"):
            kv, _ = resolve_kv_settings("f16", "f16", flash_attn, shape.head_k, shape.head_v)
            self.models.append(
                ScoringModel(
                    path, context_size=context + score + 64, hot_slots=1, batch_size=score, threads=threads, kv=kv
                )
            )
        self.ref, self.floor_model = self.models
        self.codec = TierCodec(self.ref.kv, "same", "always", "same", cell_ext=self.ref.mrope)
        length = context + score + 1
        tokens = text_tokens(self.ref, length * windows, text)
        self.windows = [Window(tokens[w * length : (w + 1) * length], context) for w in range(windows)]
        self.states: list[bytes] = []  # each window's context, saved at f16 (by the first measure)
        self.floor = Score()

    @property
    def positions(self) -> int:
        return self.score * len(self.windows)

    def close(self) -> None:
        for m in self.models:
            m.close()

    def _prefill(self, m: Model, w: Window) -> None:
        m.forget_sequence(0)
        for first in range(0, w.context, self.score):
            chunk = w.tokens[first : min(first + self.score, w.context)]
            m.batch.clear()
            m.batch.add(0, chunk, first, outputs=False)
            if m.decode() != 0:
                raise RuntimeError("llama.cpp found no room for the context")

    def _scored(self, m: Model, w: Window) -> np.ndarray:
        chunk = w.tokens[w.context : w.context + self.score]
        m.batch.clear()
        m.batch.add(0, chunk, w.context, outputs=True)
        m.batch.logits[: len(chunk)] = 1  # every position (ScoringModel sized its outputs for it)
        if m.decode() != 0:
            raise RuntimeError("llama.cpp found no room for the scored part")
        return log_softmax(m.output_logits(len(chunk)).astype(np.float32))

    def _saved(self, m: Model) -> bytes:
        size = m.state_size(0)
        buffer = (ctypes.c_uint8 * size)()
        if m.save_state(0, buffer) != size:
            raise RuntimeError("llama.cpp saved a state of another size than it announced")
        return bytes(buffer)

    def stored_bytes(self, to: StoreType | None) -> int:
        """The first window's snapshot at ``to`` (None: the f16 state as llama.cpp writes it)."""
        state = self.states[0]
        if to is None:
            return len(state)
        stored = self.codec.compress(state, to)
        assert stored is not None, "the codec reads every state this model writes"
        return len(stored)

    def k_layers(self) -> list[tuple[int, int]]:
        """Each K layer of the first window's state, in order: (cells, values per cell)."""
        return [(x.n_rows, x.n_cols) for x in parse(self.states[0], self.ref.mrope).layers if x.kind == "k"]

    def measure(self, setups: Sequence[StoreType]) -> tuple[Score, list[Score]]:
        """The noise floor's score and each setup's, over every window (the floor and the saved states are
        measured by the first call and kept)."""
        first = not self.states
        floor = Score() if first else self.floor
        scores = [Score() for _ in setups]
        for i, w in enumerate(self.windows):
            self._prefill(self.ref, w)
            state = self._saved(self.ref) if first else self.states[i]
            ref_logp = self._scored(self.ref, w)
            if first:
                self.states.append(state)
                self._prefill(self.floor_model, w)
                floor.add(ref_logp, self._scored(self.floor_model, w))
            for to, score in zip(setups, scores, strict=True):
                stored = self.codec.compress(state, to)
                assert stored is not None, "the codec reads every state this model writes"
                back = self.codec.to_hot(stored)
                self.ref.forget_sequence(0)
                if not self.ref.load_state(0, (ctypes.c_uint8 * len(back)).from_buffer_copy(back)):
                    raise RuntimeError("llama.cpp refused a state written back at f16")
                score.add(ref_logp, self._scored(self.ref, w))
        self.floor = floor
        return floor, scores
