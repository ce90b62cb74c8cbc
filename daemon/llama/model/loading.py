"""Loading a GGUF's weights with llama.cpp, on this CPU or split across RPC workers, and what identifies them."""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as lc

from kvpool.daemon.llama.ggml_rpc import RemoteDevice


@dataclass(frozen=True, slots=True)
class Placement:
    """Where llama.cpp puts the layers: ``devices`` (RPC workers) get ``offloaded`` layers counted from the
    output end (llama.cpp's n_gpu_layers), shared by ``tensor_split`` (empty: by their free memory)."""

    devices: list[RemoteDevice]
    offloaded: int
    tensor_split: list[float]


class ModelLoadError(Exception):
    """The GGUF could not be loaded or the context could not be created."""


def load_weights(path: Path, placement: Placement | None, repack: bool) -> ctypes.c_void_p:
    """llama.cpp's model (free it with llama_model_free); ModelLoadError when llama.cpp cannot load it."""
    mparams = lc.llama_model_default_params()
    keep_alive = None
    if placement is not None and placement.devices:
        # Passed explicitly: llama.cpp's default device selection is not relied on to pick the workers.
        devices = (ctypes.c_void_p * (len(placement.devices) + 1))(*[d.handle for d in placement.devices], None)
        mparams.devices = ctypes.cast(devices, ctypes.c_void_p)
        mparams.n_gpu_layers = placement.offloaded
        split = (ctypes.c_float * lc.llama_max_devices())(*placement.tensor_split)
        mparams.tensor_split = split
        keep_alive = (devices, split)  # llama.cpp reads both while loading
    # llama.cpp's extra buffer types repack weights for faster CPU kernels (AVX2/AVX-512/NEON, AMX); whether
    # this CPU can run them is decided before loading (cpu_repack). Repacking does not change the KV state.
    mparams.use_extra_bufts = repack
    weights = lc.llama_model_load_from_file(str(path).encode(), mparams)
    del keep_alive
    if not weights:
        raise ModelLoadError(
            f"llama.cpp could not load {path}: the file is not a GGUF model it supports, or is damaged"
            + (" (or the rpc workers lack the memory for their layers)." if placement else ".")
        )
    return weights


def fingerprint(path: Path) -> str:
    """Identifies the weights: file size plus hashes of its head and tail (hashing 250 MB at every start
    would cost seconds on a device; the GGUF header and tensor data at both ends change with any model)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:32]
