"""What kvpoold will run, decided before anything is loaded: the configuration, the model file, the memory plan,
the hot KV's settings, weight repacking and, with rpc_servers, where the layers go. Every refusal here is a
StartFailed with the sentence to print and the exit code; --check-config prints the plan and stops here."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.daemon.config import Config, ConfigError, load_config, unknown_environment
from kvpool.daemon.engine.cpu_share import describe_cores
from kvpool.daemon.kv.codec.kv_types import PROFILE
from kvpool.daemon.kv.codec.precision_profile import PrecisionProfile, ProfileError, find_profile
from kvpool.daemon.llama.cpu_probe import CpuUnsupported, check_cpu
from kvpool.daemon.llama.cpu_repack import RepackChoice, describe_idle
from kvpool.daemon.llama.default_model import ModelNotFound, resolve_model_path
from kvpool.daemon.llama.deterministic_mode import Determinism
from kvpool.daemon.llama.gguf_meta import GgufError
from kvpool.daemon.llama.kv_settings import KvSettings, KvSettingsError, resolve_kv_settings
from kvpool.daemon.llama.memory_plan import MemoryPlan, model_shape, plan_memory
from kvpool.daemon.llama.model import Placement
from kvpool.daemon.llama.model.loading import fingerprint
from kvpool.daemon.llama.projector import ProjectorError, ProjectorPlan, plan_projector
from kvpool.daemon.locations import appendable
from kvpool.daemon.ops.logs import setup_logging
from kvpool.daemon.rpc.connect import WorkersUnavailable, connect_workers
from kvpool.daemon.rpc.faults import WorkerWatch

log = logging.getLogger("kvpool.daemon")


class StartFailed(Exception):
    """kvpoold cannot start: the message says why and what to do; exit_code is the process's exit status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class StartPlan:
    config: Config
    model_path: Path
    memory: MemoryPlan
    kv: KvSettings
    kv_why: str
    repack: RepackChoice
    determinism: Determinism
    projector: ProjectorPlan | None = None
    kv_profile: PrecisionProfile | None = None  # for a tier whose type is "profile"
    idle_instructions: tuple[str, ...] = ()  # the CPU's, which llama.cpp's kernels use and this build does not

    def print_memory(self) -> None:
        print(f"kvpoold: memory plan for {self.model_path.name}:\n{self.memory.table()}", file=sys.stderr)


def plan_start(config_file: str | None, overrides: dict[str, Any], check_only: bool) -> StartPlan:
    """The configuration and what follows from it (exit 2 for a bad one, or a plan over memory_limit)."""
    try:
        config = load_config(config_file, overrides, dict(os.environ))
        try:
            setup_logging(config.log_level, config.log_format, config.log_file, config.log_max_bytes)
        except OSError as exc:
            raise ConfigError(
                f"log_file = {config.log_file!r} cannot be opened to append to ({exc.strerror}); create its "
                "directory, or set another log_file."
            ) from None
        if config.step_log and not appendable(Path(config.step_log)):
            raise ConfigError(
                f"step_log = {config.step_log!r} cannot be appended to (the file is not writable, or its directory "
                "does not exist or is not); create it, or set another step_log."
            )
        for name in unknown_environment(dict(os.environ)):
            log.warning("%s is not a setting (check its spelling against docs/config.md): it is ignored", name)
        model_path = resolve_model_path(config.model)
        memory = plan_memory(model_path, config)
        shape = model_shape(model_path)
        kv, kv_why = resolve_kv_settings(
            config.cache_type_k, config.cache_type_v, config.flash_attn, shape.head_k, shape.head_v
        )
        determinism = config.determinism
        repack, idle = check_cpu(determinism.repack(config.cpu_repack), model_path)
        projector = plan_projector(config.mmproj)
        kv_profile = None
        if PROFILE in (config.pool_kv_type, config.spill_kv_type):
            kv_profile = find_profile(config.kv_profile, model_path, fingerprint(model_path), shape.n_layer)
    except (
        ConfigError, ModelNotFound, GgufError, CpuUnsupported, KvSettingsError, ProjectorError, ProfileError, OSError
    ) as exc:  # fmt: skip
        raise StartFailed(str(exc), 2) from None
    plan = StartPlan(config, model_path, memory, kv, kv_why, repack, determinism, projector, kv_profile, tuple(idle))
    if check_only:
        print(f"kvpoold: {repack.describe()}", file=sys.stderr)
        print(f"kvpoold: {describe_idle(idle)}", file=sys.stderr)
        print(f"kvpoold: {kv.describe()}; {kv_why}", file=sys.stderr)
        print(f"kvpoold: {projector.describe() if projector else 'no projector (mmproj): text only'}", file=sys.stderr)
        print(f"kvpoold: {describe_cores(config.threads, config.threads_fixed_because)}", file=sys.stderr)
        if kv_profile is not None:
            print(f"kvpoold: precision profile: {kv_profile.describe()}", file=sys.stderr)
    if check_only or not memory.fits:
        plan.print_memory()
    if not memory.fits:
        raise StartFailed(
            f"the plan needs {memory.total / 2**20:.0f} MiB but memory_limit is {memory.limit / 2**20:.0f} MiB; lower "
            "cache_pool_size, context_size, hot_slots or batch_size, or raise memory_limit.",
            2,
        )
    return plan


def place_layers(plan: StartPlan, watch: WorkerWatch) -> Placement | None:
    """With rpc_servers: connect the workers, and plan memory again with the layers where their free memory puts
    them (the plan's memory is replaced). None: the whole model is local."""
    if not plan.config.rpc_servers:
        return None
    try:
        devices, shares, plan.memory = connect_workers(plan.config, plan.model_path, watch)
    except WorkersUnavailable as exc:
        raise StartFailed(str(exc), exc.exit_code) from None
    if not plan.memory.fits:
        plan.print_memory()
        raise StartFailed(
            f"the local part of the plan needs {plan.memory.total / 2**20:.0f} MiB but memory_limit is "
            f"{plan.memory.limit / 2**20:.0f} MiB; put more layers on the workers (rpc_layers, tensor_split), or "
            "lower cache_pool_size, context_size, hot_slots or batch_size.",
            2,
        )
    return Placement(devices, plan.config.rpc_layers, shares)


def log_plan(plan: StartPlan) -> None:
    m = plan.memory
    log.info("%s", describe_cores(plan.config.threads, plan.config.threads_fixed_because))
    log.info("%s", plan.repack.describe())
    log.info("%s", describe_idle(plan.idle_instructions))
    log.info("%s; %s", plan.kv.describe(), plan.kv_why)
    log.info(
        "memory plan: %.0f MiB (weights %.0f, hot KV %.0f, compute %.0f, pool %.0f, runtime %.0f, media %.0f)",
        m.total / 2**20,
        m.weights / 2**20,
        m.hot_kv / 2**20,
        m.compute / 2**20,
        m.pool / 2**20,
        m.runtime / 2**20,
        m.media / 2**20,
    )
    if plan.projector is not None:
        log.info("%s", plan.projector.describe())
    if plan.kv_profile is not None:
        log.info("precision profile: %s", plan.kv_profile.describe())
    for part in m.remote:
        log.info(
            "memory plan on rpc worker %s: %.0f MiB (%d layers%s: weights %.0f, hot KV %.0f, compute %.0f)",
            part.endpoint,
            part.total / 2**20,
            part.layers,
            " + output" if part.output else "",
            part.weights / 2**20,
            part.hot_kv / 2**20,
            part.compute / 2**20,
        )
