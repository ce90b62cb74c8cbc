"""llama.cpp's RPC backend (ggml-rpc) and its backend registry, through ctypes on the libraries that
llama-cpp-python ships in ``llama_cpp/lib``.

The worker (``kvpool rpc-worker``) needs ggml alone: it serves its CPU with ``ggml_backend_rpc_start_server``
and never loads libllama or a model, so this module finds the library folder with
``importlib.util.find_spec`` instead of importing llama_cpp (the model/ package stays the only llama_cpp importer;
it calls the master-side functions here before it loads a model).

The wheel's ``lib`` folder holds *copies*, not symlinks: ``libggml-base.so`` and ``libggml-base.so.0`` are two
files, and loading both gives two independent ggml instances (two backend registries, two abort callbacks).
libllama is linked against the ``.so.0`` names, so those are the ones loaded here: then the RPC devices registered
and the abort callback set here are the ones llama.cpp itself uses.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type
_AbortCallback = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_AddServer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_StartServer = ctypes.CFUNCTYPE(
    None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)
)


class RpcUnavailable(Exception):
    """This llama-cpp-python build has no RPC backend (it was built without GGML_RPC=ON)."""


def lib_dir() -> Path:
    """llama-cpp-python's folder of shared libraries, found without importing (and so loading) llama_cpp."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RpcUnavailable("llama-cpp-python is not installed in this environment.")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _library_path(folder: Path, name: str) -> Path:
    """``lib<name>.so.<major>`` (the name libllama links against) when the wheel has it, else ``lib<name>.so``."""
    versioned = sorted(p for p in folder.glob(f"lib{name}.so.*") if p.name.count(".") == 2)
    return versioned[0] if versioned else folder / f"lib{name}.so"


@cache
def _ggml() -> ctypes.CDLL:
    folder = lib_dir()
    ctypes.CDLL(str(_library_path(folder, "ggml-base")), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(_library_path(folder, "ggml")), mode=ctypes.RTLD_GLOBAL)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    signatures: dict[str, tuple[list[object], object]] = {
        "ggml_backend_reg_by_name": ([ctypes.c_char_p], vp),
        "ggml_backend_reg_get_proc_address": ([vp, ctypes.c_char_p], vp),
        "ggml_backend_register": ([vp], None),
        "ggml_backend_reg_dev_count": ([vp], sz),
        "ggml_backend_reg_dev_get": ([vp, sz], vp),
        "ggml_backend_dev_by_type": ([ctypes.c_int], vp),
        "ggml_backend_dev_name": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_memory": ([vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
    }
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


@cache
def _ggml_base() -> ctypes.CDLL:
    _ggml()
    base = ctypes.CDLL(str(_library_path(lib_dir(), "ggml-base")), mode=ctypes.RTLD_GLOBAL)
    base.ggml_set_abort_callback.argtypes = [_AbortCallback]
    base.ggml_set_abort_callback.restype = ctypes.c_void_p
    return base


def _rpc_function(name: str) -> int:
    lib = _ggml()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    address = lib.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    if not address:
        raise RpcUnavailable(
            f"this llama-cpp-python build has no RPC backend ({name} is missing): reinstall it built with "
            "-DGGML_RPC=ON (`make setup` does; see docs/rpc.md)."
        )
    return address


def has_rpc_backend() -> bool:
    try:
        _rpc_function("ggml_backend_rpc_add_server")
    except RpcUnavailable:
        return False
    return True


# ---------------------------------------------------------------------------------------------------- worker


def serve(endpoint: str, cache_dir: str | None, threads: int) -> None:
    """Serve this machine's CPU to RPC masters on ``endpoint`` ("HOST:PORT") with llama.cpp's own server loop.
    Returns only when the server could not start (e.g. the port is taken); otherwise it serves until killed."""
    start = _StartServer(_rpc_function("ggml_backend_rpc_start_server"))
    cpu = _ggml().ggml_backend_dev_by_type(DEVICE_TYPE_CPU)
    if not cpu:
        raise RpcUnavailable("ggml has no CPU device.")
    devices = (ctypes.c_void_p * 1)(cpu)
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, 1, devices)


# ---------------------------------------------------------------------------------------------------- master


@dataclass(frozen=True, slots=True)
class RemoteDevice:
    endpoint: str
    name: str  # llama.cpp's device name, e.g. RPC0
    handle: int  # ggml_backend_dev_t

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes the worker reports for this device: one request over the RPC connection."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _ggml().ggml_backend_dev_memory(self.handle, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


def add_server(endpoint: str) -> list[RemoteDevice]:
    """Register the devices of the worker at ``endpoint`` with ggml (``ggml_backend_rpc_add_server`` connects and
    asks it for its device count). A worker that cannot be reached makes llama.cpp abort: check it first."""
    add = _AddServer(_rpc_function("ggml_backend_rpc_add_server"))
    lib = _ggml()
    reg = add(endpoint.encode())
    if not reg:
        raise RpcUnavailable(f"the rpc worker at {endpoint} reports no devices.")
    lib.ggml_backend_register(reg)
    handles = [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]
    return [RemoteDevice(endpoint, lib.ggml_backend_dev_name(h).decode(), h) for h in handles]


_abort_handler: list[object] = []  # keeps the ctypes callback alive as long as ggml may call it


def on_ggml_abort(handler: Callable[[str], None]) -> None:
    """Call ``handler(message)`` when ggml is about to abort() the process (on whichever thread hit the fault;
    ggml-rpc aborts when its connection to a worker breaks). The process still ends when it returns: the handler
    should do its last work and leave with os._exit()."""

    def trampoline(message: bytes | None) -> None:
        handler((message or b"").decode("utf-8", errors="replace"))

    callback = _AbortCallback(trampoline)
    _abort_handler[:] = [callback]
    _ggml_base().ggml_set_abort_callback(callback)
