"""Deterministic decoding as one choice, made once at assembly (docs/determinism.md).

With ``deterministic = true`` a sequence's logits depend on nothing but its own tokens. That takes, together:
llama.cpp's tiled K-quant matmul off (it serves batches of 8 rows and more, vec_dot fewer: another sum order),
weight repacking off, two extra sequences (a pad row so that no batch has one token or one output, and a graveyard
that holds freed cells so that no later token lands before a sequence's older ones), and a KV manager that lays
the cells out again (compacts) before a step would not fit after the last appended cell. Every part that differs
reads it from this object; nothing else decides it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# ggml reads this once, at the first decode of the process.
_DETERMINISTIC_ENVIRONMENT = MappingProxyType({"GGML_CPU_TILED_MM": "0"})


@dataclass(frozen=True, slots=True)
class Determinism:
    on: bool = False

    @property
    def extra_sequences(self) -> int:
        """Sequence ids it needs besides the slots and prefixes: the pad row's and the graveyard's."""
        return 2 if self.on else 0

    @property
    def compacts(self) -> bool:
        """Freed cells go to the graveyard, not back to llama.cpp: the KV manager compacts to reuse them."""
        return self.on

    @property
    def environment(self) -> Mapping[str, str]:
        """What ggml must find in the process environment before the model is loaded."""
        return _DETERMINISTIC_ENVIRONMENT if self.on else MappingProxyType({})

    def repack(self, configured: str) -> str:
        """The cpu_repack setting to use (repacked kernels sum in another order for groups of four)."""
        return "off" if self.on else configured

    def describe(self) -> str:
        return "deterministic decoding: repacking and the tiled matmul off, steps of 2 to 63 rows" if self.on else ""


NOT_DETERMINISTIC = Determinism(on=False)
