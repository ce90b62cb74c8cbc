"""cpu_repack: the decision (pure), the probe's child processes and cache (real processes), and the check on
whatever machine runs the suite: a 'safe' verdict must hold when the repacked model really decodes here."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.daemon.llama import cpu_probe
from kvpool.daemon.llama.cpu_repack import (
    CpuInfo,
    decide_repack,
    describe_idle,
    idle_instructions,
    missing_instructions,
    needs_probe,
    parse_build_features,
)

SYSTEM_INFO = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
SYSTEM_INFO += "OPENMP = 1 | REPACK = 1 | "
AMX_CPU = CpuInfo("Intel(R) Xeon(R) Processor", frozenset({"avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16"}))
AMD_CPU = CpuInfo("AMD EPYC 7B13", frozenset({"avx2", "fma", "f16c", "bmi2", "pni", "ssse3", "avx"}))


def test_system_info_is_parsed_into_features() -> None:
    features = parse_build_features(SYSTEM_INFO + "RPC : ")
    assert {"SSE3", "AVX2", "REPACK", "OPENMP"} <= features
    assert "AMX_INT8" not in features and "CPU" not in features
    assert parse_build_features("CPU : AVX2 = 0 | SVE_CNT = 16 | ") == {"SVE_CNT"}


def test_cpuinfo_of_x86_and_aarch64() -> None:
    x86 = CpuInfo.parse("processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu avx2 amx_tile\n\nprocessor\t: 1\n")
    assert x86.model_name == "Intel Xeon" and x86.advertises_amx and "avx2" in x86.flags
    arm = CpuInfo.parse("processor\t: 0\nFeatures\t: fp asimd asimddp\nCPU part\t: 0xd0b\n")
    assert arm.flags == {"fp", "asimd", "asimddp"} and not arm.advertises_amx


def test_a_build_for_instructions_the_cpu_lacks_is_named() -> None:
    assert missing_instructions({"AVX2", "AVX512", "AMX_INT8", "REPACK"}, AMD_CPU) == ["AMX_INT8", "AVX512"]
    assert missing_instructions(parse_build_features(SYSTEM_INFO), AMD_CPU) == []


def test_instruction_sets_the_cpu_has_and_the_build_leaves_unused_are_named() -> None:
    portable = parse_build_features(SYSTEM_INFO)
    zen4 = CpuInfo("AMD EPYC", AMD_CPU.flags | {"avx512f", "avx512_vnni", "avx512_bf16", "avx512bw"})
    assert idle_instructions(portable, zen4) == ["AVX512", "AVX512_VNNI", "AVX512_BF16"]
    assert idle_instructions(portable | {"AVX512", "AVX512_VNNI", "AVX512_BF16"}, zen4) == []
    assert idle_instructions(portable, AMD_CPU) == []  # an AVX2 CPU: nothing left
    alder_lake = CpuInfo("Intel Core", AMD_CPU.flags | {"avx_vnni"})
    assert idle_instructions(portable, alder_lake) == ["AVX_VNNI"]
    sapphire = CpuInfo("Intel Xeon", zen4.flags | {"avx_vnni"})
    assert "AVX_VNNI" not in idle_instructions(portable, sapphire)  # its AVX-512 form covers it
    pi5 = CpuInfo.parse("Features\t: fp asimd asimddp\n")
    assert idle_instructions(parse_build_features("CPU : NEON = 1 | "), pi5) == ["DOTPROD"]
    assert "AVX512, AVX512_VNNI" in describe_idle(["AVX512", "AVX512_VNNI"]) and "docs/build.md" in describe_idle(["X"])
    assert "every instruction set" in describe_idle([])


@pytest.mark.parametrize(("compiled", "advertised", "permitted"), list(itertools.product([True, False], repeat=3)))
@pytest.mark.parametrize("probe_survives", [True, False])
def test_auto_probes_only_where_amx_is_compiled_advertised_and_granted(
    compiled: bool, advertised: bool, permitted: bool, probe_survives: bool
) -> None:
    features = parse_build_features(SYSTEM_INFO) | ({"AMX_INT8"} if compiled else set())
    cpu = AMX_CPU if advertised else AMD_CPU
    probes: list[int] = []

    def probe() -> tuple[bool, str]:
        probes.append(1)
        return probe_survives, "the probe process was killed by SIGILL" if not probe_survives else "decoded"

    choice = decide_repack("auto", frozenset(features), cpu, permitted, probe)
    risky = compiled and advertised and permitted
    assert needs_probe(frozenset(features), cpu, permitted) == risky
    assert len(probes) == int(risky)
    assert choice.enabled == (probe_survives if risky else True)
    assert choice.mode == "auto" and choice.reason
    if risky and not probe_survives:
        assert "SIGILL" in choice.describe() and ": off (" in choice.describe()


def test_forced_modes_never_probe_and_bad_modes_are_refused() -> None:
    def probe() -> tuple[bool, str]:
        raise AssertionError("a forced mode must not probe")

    features = parse_build_features(SYSTEM_INFO) | {"AMX_INT8"}
    assert decide_repack("on", features, AMX_CPU, True, probe).enabled
    assert not decide_repack("off", features, AMX_CPU, True, probe).enabled
    assert not decide_repack("auto", frozenset({"AVX2"}), AMD_CPU, False, probe).enabled  # nothing to repack with
    with pytest.raises(ValueError, match="auto, on, off"):
        decide_repack("maybe", features, AMX_CPU, True, probe)


def test_a_child_killed_by_sigill_is_a_definitive_failure() -> None:
    killed = cpu_probe.run_child([], python_args=["-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    assert not killed.ok and killed.definitive and "SIGILL" in killed.detail
    oom = cpu_probe.run_child([], python_args=["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert not oom.ok and not oom.definitive  # what the OOM killer does says nothing about the CPU
    failed = cpu_probe.run_child([], python_args=["-c", "raise SystemExit('no model here')"])
    assert not failed.ok and not failed.definitive and "no model here" in failed.detail
    slow = cpu_probe.run_child([], timeout=0.5, python_args=["-c", "import time; time.sleep(30)"])
    assert not slow.ok and not slow.definitive and "did not finish" in slow.detail
    fine = cpu_probe.run_child([], python_args=["-c", "print('ok')"])
    assert fine.ok and fine.output.strip() == "ok"


def test_verdict_cache_round_trips_and_treats_damage_as_a_miss(tmp_path: Path) -> None:
    cache = cpu_probe.VerdictCache(tmp_path / "cpu-probe")
    assert cache.get("k") is None
    cache.put("k", {"survived": False, "detail": "SIGILL"})
    assert cache.get("k") == {"survived": False, "detail": "SIGILL", "key": "k"}
    assert cache.get("other") is None
    next((tmp_path / "cpu-probe").glob("*.json")).write_text("{not json")
    assert cache.get("k") is None


def test_this_machine_the_verdict_holds_for_the_tiny_model(tmp_path: Path, tiny_model: Path) -> None:
    """Runs the real decision here (CPU, build, kernel as they are) and checks it: the build's features are read
    in a child, and when auto says repacking is on, a repacked decode in a child really survives."""
    choice = cpu_probe.choose_repack("auto", tiny_model, cache_dir=tmp_path)
    assert list((tmp_path / "cpu-probe").glob("*.json")), "the build's features were not cached"
    if choice.enabled:
        result = cpu_probe.run_child(["repack", str(tiny_model)])
        assert result.ok, result.detail


def test_check_config_prints_the_repack_choice(tiny_model: Path, tmp_path: Path) -> None:
    for mode, expected in (("off", "cpu_repack = off: off (forced"), ("auto", "cpu_repack = auto: ")):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvpool.daemon.main",
                "--check-config",
                "--model",
                str(tiny_model),
                "--cpu-repack",
                mode,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert expected in done.stderr
        assert "kvpoold: llama.cpp build: " in done.stderr  # what it leaves unused of this CPU, or that it uses all


def test_daemon_logs_its_choice_and_serves(start_daemon) -> None:  # type: ignore[no-untyped-def]
    daemon = start_daemon("--cpu-repack", "off")
    assert "cpu_repack = off: off (forced by the configuration)" in daemon.log()
    with daemon.client() as client, client.open_session() as s:
        assert s.complete("ab", max_tokens=2, temperature=0.0).tokens
