"""Whether llama.cpp may repack weights into its extra CPU buffer types on this machine: the pure decision.

llama.cpp's CPU backend offers "extra buffer types" that rearrange quantized weights at load time for faster
kernels: the AVX2 / AVX-512 / NEON repacks (Q4_0, Q4_K, IQ4_NL, ...) and, in builds compiled with AMX, the AMX
tile kernels. The first kind only runs instructions the CPU advertises and the build was compiled for. AMX is
different: a VM may advertise AMX in CPUID, its kernel may grant the tile state (``ARCH_REQ_XCOMP_PERM``), and
``tilezero`` still traps with SIGILL because the hypervisor does not pass the state through. Nothing but running
the kernels tells, so that case is settled by a probe in a child process (``cpu_probe``); this module only says
when a probe is needed and what its answer means.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

REPACK_MODES = ("auto", "on", "off")

# llama_print_system_info's names for compiled-in instruction sets -> the /proc/cpuinfo flag a CPU needs for
# them. Linux names the x86 SSE3 flag "pni"; aarch64 reports NEON as "asimd" and the dot product as "asimddp".
_FEATURE_FLAGS = {
    "SSE3": "pni",
    "SSSE3": "ssse3",
    "AVX": "avx",
    "AVX_VNNI": "avx_vnni",
    "AVX2": "avx2",
    "F16C": "f16c",
    "FMA": "fma",
    "BMI2": "bmi2",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
    "AMX_INT8": "amx_int8",
    "NEON": "asimd",
    "FP16_VA": "asimdhp",
    "MATMUL_INT8": "i8mm",
    "SVE": "sve",
    "DOTPROD": "asimddp",
    "SME": "sme",
}


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """What the kernel says about the CPU: its model name and feature flags (/proc/cpuinfo)."""

    model_name: str
    flags: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> CpuInfo:
        """The first processor's ``model name`` and ``flags`` (x86) or ``Features`` (aarch64) lines."""
        name, flags = "", ""
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                continue
            key = key.strip()
            if key in ("model name", "Processor", "CPU part") and not name:
                name = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value
        return cls(model_name=name or "unknown CPU", flags=frozenset(flags.split()))

    @property
    def advertises_amx(self) -> bool:
        return "amx_tile" in self.flags


@dataclass(frozen=True, slots=True)
class RepackChoice:
    """The verdict: whether the model is loaded with llama.cpp's extra (repacking) buffer types, and why."""

    mode: str  # as configured: auto, on or off
    enabled: bool
    reason: str

    def describe(self) -> str:
        return f"cpu_repack = {self.mode}: {'on' if self.enabled else 'off'} ({self.reason})"


def parse_build_features(system_info: str) -> frozenset[str]:
    """The CPU backend's compiled-in features from llama_print_system_info():
    ``"CPU : SSE3 = 1 | AVX2 = 1 | ... | REPACK = 1 | "`` -> {"SSE3", "AVX2", ..., "REPACK"}."""
    features: set[str] = set()
    for section in system_info.split("|"):
        name, sep, value = section.rpartition("=")
        if not sep:
            continue
        name = name.rpartition(":")[2].strip()  # the first entry carries the backend's name: "CPU : SSE3"
        if name and value.strip() not in ("", "0"):
            features.add(name)
    return frozenset(features)


def missing_instructions(build_features: Iterable[str], cpu: CpuInfo) -> list[str]:
    """Instruction sets the build was compiled for that this CPU does not advertise (its code would SIGILL)."""
    return sorted(f for f in build_features if f in _FEATURE_FLAGS and _FEATURE_FLAGS[f] not in cpu.flags)


# Instruction sets llama.cpp has kernels for, which a portable build leaves idle (docs/build.md): on an AMD EPYC an
# AVX-512 build's matrix kernel takes logits rows four at a time instead of two.
_FASTER_WITH = ("AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "DOTPROD", "MATMUL_INT8")


def idle_instructions(build_features: Iterable[str], cpu: CpuInfo) -> list[str]:
    """Instruction sets this CPU advertises that llama.cpp's kernels use and this build was not compiled for."""
    built = set(build_features)
    idle = [f for f in _FASTER_WITH if f not in built and _FEATURE_FLAGS[f] in cpu.flags]
    if "AVX512_VNNI" in built or "AVX512_VNNI" in idle:  # the 512-bit form does what AVX-VNNI's 256-bit one does
        idle = [f for f in idle if f != "AVX_VNNI"]
    return idle


def describe_idle(idle: Sequence[str]) -> str:
    """The start's line on what the build leaves unused."""
    if not idle:
        return "llama.cpp build: uses every instruction set of this CPU that its kernels know"
    return (
        f"llama.cpp build: this CPU also has {', '.join(idle)}, which this build leaves unused (docs/build.md: the "
        "CMAKE_ARGS for them, and what they gave on an AMD EPYC)"
    )


def needs_probe(build_features: frozenset[str], cpu: CpuInfo, amx_permitted: bool) -> bool:
    """Only AMX needs a probe: the build has its kernels, the CPU advertises it and the kernel grants the tile
    state. Without the grant ggml does not offer its AMX buffer type at all, and the other repacks are safe."""
    return "AMX_INT8" in build_features and cpu.advertises_amx and amx_permitted


def decide_repack(
    mode: str,
    build_features: frozenset[str],
    cpu: CpuInfo,
    amx_permitted: bool,
    probe: Callable[[], tuple[bool, str]],
) -> RepackChoice:
    """``probe()`` -> (the repacked model decoded in a child process, what happened); called only when needed."""
    if mode not in REPACK_MODES:
        raise ValueError(f"cpu_repack must be one of {', '.join(REPACK_MODES)}, not {mode!r}")
    if mode == "on":
        return RepackChoice(mode, True, "forced by the configuration")
    if mode == "off":
        return RepackChoice(mode, False, "forced by the configuration")
    if "REPACK" not in build_features and "AMX_INT8" not in build_features:
        return RepackChoice(mode, False, "this llama.cpp build has no repacking buffer types")
    if not needs_probe(build_features, cpu, amx_permitted):
        if "AMX_INT8" not in build_features:
            why = "the build has no AMX kernels"
        elif not cpu.advertises_amx:
            why = "the CPU does not advertise AMX"
        else:
            why = "the kernel does not grant the AMX tile state, so llama.cpp leaves AMX out"
        return RepackChoice(mode, True, f"{why}; the other repacks use only instructions the CPU advertises")
    survived, detail = probe()
    if survived:
        return RepackChoice(mode, True, f"AMX advertised and a probe decode with AMX repacking succeeded ({detail})")
    return RepackChoice(mode, False, f"AMX advertised but a probe decode with repacking failed: {detail}")
