"""kvpoold's start with RPC workers: check the build and each worker, register their devices with ggml, and plan
the memory with the layers where llama.cpp will put them."""

from __future__ import annotations

import logging
from pathlib import Path

from kvpool.daemon.config import Config
from kvpool.daemon.llama.ggml_rpc import RemoteDevice
from kvpool.daemon.llama.memory_plan import MemoryPlan, plan_memory
from kvpool.daemon.llama.model import register_workers, supports_rpc
from kvpool.daemon.rpc.endpoints import is_private, parse_endpoint, unreachable
from kvpool.daemon.rpc.faults import EXIT_WORKER_LOST, WorkerWatch, connect_deadline

log = logging.getLogger("kvpool.rpc")


class WorkersUnavailable(Exception):
    """kvpoold cannot start with its rpc workers; ``exit_code`` says whether retrying later may help."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def connect_workers(
    config: Config, model_path: Path, watch: WorkerWatch
) -> tuple[list[RemoteDevice], list[float], MemoryPlan]:
    """The workers' devices, their shares of the offloaded layers, and the memory plan for that split."""
    if not supports_rpc():
        raise WorkersUnavailable(
            "rpc_servers is set but this llama-cpp-python was built without the RPC backend: run `make setup` "
            "(it builds with -DGGML_RPC=ON), or reinstall with CMAKE_ARGS=-DGGML_RPC=ON pip install "
            "--no-cache-dir --force-reinstall llama-cpp-python==0.3.36 (--no-cache-dir: pip's wheel cache may hold "
            "a build without it).",
            2,
        )
    for text in config.rpc_servers:
        endpoint = parse_endpoint(text)
        if not is_private(endpoint):
            log.warning(
                "rpc worker %s is not on loopback or a private network: llama.cpp's RPC protocol has no "
                "authentication or encryption, so anyone who reaches that port can read and change the model's "
                "memory. Reach it through a WireGuard or SSH tunnel instead (docs/rpc.md).",
                endpoint,
            )
        if why := unreachable(endpoint, config.rpc_connect_timeout):
            raise WorkersUnavailable(
                f"rpc worker {endpoint} is down ({why}): start it there with `kvpool rpc-worker --host "
                f"{endpoint.host} --port {endpoint.port}` (or `systemctl start kvpool-rpc`), or remove it from "
                "rpc_servers.",
                EXIT_WORKER_LOST,
            )
    watch.install()  # from here on, a worker that fails makes ggml abort, and the watch makes that an exit
    deadline = connect_deadline(config.rpc_servers, config.rpc_connect_timeout)
    deadline.start()
    try:
        devices = register_workers(config.rpc_servers)
    finally:
        deadline.cancel()
    if config.tensor_split and len(config.tensor_split) != len(devices):
        raise WorkersUnavailable(
            f"tensor_split has {len(config.tensor_split)} shares but the workers offer {len(devices)} devices "
            f"({', '.join(d.name + ' on ' + d.endpoint for d in devices)}): give one share per device.",
            2,
        )
    memory = [d.memory() for d in devices]  # one round trip to each worker
    shares = list(config.tensor_split) or [float(free) for free, _ in memory]
    for device, (free, total) in zip(devices, memory, strict=True):
        log.info(
            "rpc worker %s: device %s, %.0f MiB free of %.0f MiB",
            device.endpoint,
            device.name,
            free / 2**20,
            total / 2**20,
        )
    return devices, shares, plan_memory(model_path, config, shares, [d.endpoint for d in devices])
