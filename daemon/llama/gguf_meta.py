"""Read a GGUF file's metadata (not its tensors) in pure Python: what the memory plan needs before anything
is loaded or allocated. Format: magic "GGUF", version, tensor count, metadata count, then typed key/values."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufError(Exception):
    """Not a GGUF file this reader understands."""


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GgufError("the file ends inside its metadata")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > 1 << 24:
        raise GgufError("implausible string length in the metadata")
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item_kind, count = _read(f, "<I"), _read(f, "<Q")
        if item_kind in _SCALARS and count > 4096:  # long numeric arrays (token scores): skip, keep the length
            f.seek(count * struct.calcsize(_SCALARS[item_kind]), 1)
            return count
        if item_kind == _STRING and count > 4096:  # the vocabulary: only its size matters here
            for _ in range(count):
                f.seek(_read(f, "<Q"), 1)
            return count
        return [_value(f, item_kind) for _ in range(count)]
    raise GgufError(f"unknown metadata value type {kind}")


def _header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int]:
    if f.read(4) != b"GGUF":
        raise GgufError(f"{path} is not a GGUF file")
    version = _read(f, "<I")
    if version < 2:
        raise GgufError(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
    tensors, count = _read(f, "<Q"), _read(f, "<Q")
    meta: dict[str, Any] = {}
    for _ in range(count):
        key = _string(f)
        meta[key] = _value(f, _read(f, "<I"))
    return meta, tensors


def read_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key; arrays longer than 4096 items are given as their length."""
    with _named(path), path.open("rb") as f:
        return _header(f, path)[0]


@contextlib.contextmanager
def _named(path: Path) -> Iterator[None]:
    """A GgufError that names the file it is about."""
    try:
        yield
    except GgufError as exc:
        if str(path) in str(exc):
            raise
        raise GgufError(f"{path}: {exc}; is it a whole GGUF file?") from None


def read_tensor_sizes(path: Path) -> dict[str, int]:
    """Bytes of every tensor in the file, by name: the distance from its data offset to the next tensor's (the
    last one runs to the end of the file), so no table of quantisation block sizes is needed."""
    with _named(path), path.open("rb") as f:
        meta, count = _header(f, path)
        offsets: list[tuple[int, str]] = []
        for _ in range(count):
            name = _string(f)
            n_dims = _read(f, "<I")
            f.seek(8 * n_dims + 4, 1)  # dimensions, type
            offsets.append((_read(f, "<Q"), name))
        alignment = int(meta.get("general.alignment", 32))
        data_start = -(-f.tell() // alignment) * alignment
    data_size = path.stat().st_size - data_start
    offsets.sort()
    ends = [offset for offset, _ in offsets[1:]] + [data_size]
    return {name: end - offset for (offset, name), end in zip(offsets, ends, strict=True)}
