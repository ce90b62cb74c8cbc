"""Ask a child process what this llama.cpp build does on this CPU, and remember the answer.

The child (``cpu_probe_child``) reports the build's compiled-in instruction sets and, when ``cpu_repack``
decides that only a test can tell, loads the model with repacking and decodes a few tokens. A child that dies
(SIGILL from an AMX tile instruction a hypervisor traps, or from an instruction the CPU lacks) costs nothing but
its answer. Verdicts are cached per CPU, llama.cpp library files and model file, so the probe runs once.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvpool.daemon.llama.cpu_repack import (
    CpuInfo,
    RepackChoice,
    decide_repack,
    idle_instructions,
    missing_instructions,
    parse_build_features,
)
from kvpool.daemon.llama.default_model import model_cache_dir

log = logging.getLogger("kvpool.cpu")

PROBE_TIMEOUT_S = 180.0
CHILD_MODULE = "kvpool.daemon.llama.cpu_probe_child"
FAULTS = {signal.SIGILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE}  # what an unusable instruction kills with

# arch_prctl(2): ask the kernel for the AMX tile data state (XFEATURE_XTILEDATA = 18), as ggml does itself.
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


class CpuUnsupported(Exception):
    """This llama.cpp build cannot run on this CPU; the message says how to rebuild it."""


@dataclass(frozen=True, slots=True)
class ChildResult:
    ok: bool
    output: str  # the child's stdout on success
    detail: str  # what happened, in words, on failure
    # Success or death by a signal says something about the CPU; a timeout or an error exit may be passing.
    definitive: bool = True


def read_cpu_info() -> CpuInfo:
    try:
        return CpuInfo.parse(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return CpuInfo(model_name=platform.processor() or "unknown CPU", flags=frozenset())


def amx_permitted() -> bool:
    """Whether the kernel grants this process the AMX tile state (x86-64 Linux only)."""
    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def run_child(args: list[str], timeout: float = PROBE_TIMEOUT_S, python_args: list[str] | None = None) -> ChildResult:
    """Run ``python -m cpu_probe_child ARGS`` (or ``python PYTHON_ARGS ARGS``); a signal, a non-zero exit or the
    timeout is a failure in words."""
    cmd = [sys.executable, *(python_args or ["-m", CHILD_MODULE]), *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return ChildResult(False, "", f"the probe did not finish within {timeout:.0f} s", definitive=False)
    if done.returncode == 0:
        return ChildResult(True, done.stdout, "")
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        # Only a fault of the code itself says something about the CPU; a SIGKILL may be the OOM killer.
        return ChildResult(False, "", f"the probe process was killed by {name}", definitive=-done.returncode in FAULTS)
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return ChildResult(False, "", f"the probe process exited with {done.returncode}: {last}", definitive=False)


def _library_identity() -> str:
    """Names, sizes and mtimes of llama-cpp-python's shared libraries: a rebuild or reinstall changes it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return "llama_cpp not installed"
    lib = Path(spec.origin).parent / "lib"
    parts = [str(lib)]
    for path in sorted(lib.glob("*.so*")) if lib.is_dir() else []:
        st = path.stat()
        parts.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def machine_identity(cpu: CpuInfo) -> str:
    """What a verdict depends on besides the model: the CPU and the llama.cpp library files."""
    return f"{cpu.model_name}\n{' '.join(sorted(cpu.flags))}\n{_library_identity()}"


def _file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


class VerdictCache:
    """One small JSON file per key in <cache dir>/cpu-probe; a damaged or unreadable file is a miss."""

    def __init__(self, directory: Path):
        self.directory = directory

    def _path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"

    def get(self, key: str) -> dict[str, object] | None:
        try:
            record = json.loads(self._path(key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("key") == key else None

    def put(self, key: str, record: dict[str, object]) -> None:
        path = self._path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            partial.write_text(json.dumps({**record, "key": key}), encoding="utf-8")
            os.replace(partial, path)
        except OSError as exc:  # a read-only cache only costs the probe at the next start
            log.warning("could not cache the CPU probe's verdict in %s: %s", self.directory, exc)


def build_features(cpu: CpuInfo, cache: VerdictCache) -> frozenset[str]:
    """The build's compiled-in CPU features, read in a child; CpuUnsupported when the build cannot run here."""
    key = f"features\n{machine_identity(cpu)}"
    record = cache.get(key)
    if record is None:
        result = run_child(["features"])
        if not result.ok and not result.definitive:
            raise CpuUnsupported(f"llama.cpp's library could not be checked on this CPU ({result.detail}); retry.")
        if not result.ok:
            raise CpuUnsupported(
                f"llama.cpp's library cannot start on this CPU ({cpu.model_name}): {result.detail}. It was "
                "probably compiled for instructions this CPU lacks; reinstall llama-cpp-python with "
                "CMAKE_ARGS='-DGGML_NATIVE=OFF' (see docs/build.md)."
            )
        record = {"system_info": result.output.strip()}
        cache.put(key, record)
    features = parse_build_features(str(record["system_info"]))
    if missing := missing_instructions(features, cpu):
        raise CpuUnsupported(
            f"this llama.cpp build uses {', '.join(missing)}, which this CPU ({cpu.model_name}) does not have; "
            "reinstall llama-cpp-python with CMAKE_ARGS='-DGGML_NATIVE=OFF' or with the instruction sets of "
            "this device (see docs/build.md)."
        )
    return features


def check_cpu(mode: str, model_path: Path, cache_dir: Path | None = None) -> tuple[RepackChoice, list[str]]:
    """Decide ``cpu_repack`` for serving ``model_path`` here, and name the instruction sets this CPU has that
    llama.cpp's kernels use and the build leaves idle: the CPU and the build's features are read once for both.
    CpuUnsupported when llama.cpp cannot run at all."""
    cpu = read_cpu_info()
    cache = VerdictCache((cache_dir or model_cache_dir()) / "cpu-probe")
    features = build_features(cpu, cache)

    def probe() -> tuple[bool, str]:
        key = f"repack\n{machine_identity(cpu)}\n{_file_identity(model_path)}"
        record = cache.get(key)
        if record is None:
            log.info("probing llama.cpp's AMX repacking on %s in a child process", cpu.model_name)
            result = run_child(["repack", str(model_path)])
            record = {"survived": result.ok, "detail": result.detail or "decoded a few tokens"}
            if not result.definitive:
                return False, str(record["detail"])
            cache.put(key, record)
        return bool(record["survived"]), f"{record['detail']}; verdict cached in {cache.directory}"

    return decide_repack(mode, features, cpu, amx_permitted(), probe), idle_instructions(features, cpu)


def choose_repack(mode: str, model_path: Path, cache_dir: Path | None = None) -> RepackChoice:
    """Decide ``cpu_repack`` for serving ``model_path`` here; CpuUnsupported when llama.cpp cannot run at all."""
    return check_cpu(mode, model_path, cache_dir)[0]
