"""The model layer: the only package that imports llama_cpp. Model (model.py) composes its parts: loading.py (the
weights, on this CPU or split across RPC workers), tokenizer.py, sequences.py (the unified KV's sequences and their
saved state), batch.py, sampling.py (a generation's sampler) with grammar.py, mtmd.py (images and audio through
the projector, libmtmd) and backend.py (llama.cpp for the whole process). Everything the rest of the daemon uses
is importable from here."""

from kvpool.daemon.llama.model.backend import register_workers, supports_rpc, system_info
from kvpool.daemon.llama.model.grammar import Grammar, GrammarError, json_schema_grammar
from kvpool.daemon.llama.model.loading import ModelLoadError, Placement
from kvpool.daemon.llama.model.model import Model
from kvpool.daemon.llama.model.mtmd import MediaEncoder, MediaError, Piece, Prepared
from kvpool.daemon.llama.model.sampling import SAMPLER_FIELDS, Sampled, Sampler, SamplingParams

__all__ = [
    "SAMPLER_FIELDS",
    "Grammar",
    "GrammarError",
    "MediaEncoder",
    "MediaError",
    "Model",
    "ModelLoadError",
    "Piece",
    "Placement",
    "Prepared",
    "Sampled",
    "Sampler",
    "SamplingParams",
    "json_schema_grammar",
    "register_workers",
    "supports_rpc",
    "system_info",
]
