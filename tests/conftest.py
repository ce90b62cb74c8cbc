"""Fixtures: a tiny GGUF built once per run, and real kvpoold processes that are always stopped."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .daemon_process import DaemonProcess
from .gateway_process import GatewayProcess
from .redis_server import RedisServer
from .system_packages import missing, need, require_all
from .tiny_mmproj import build_tiny_mmproj
from .tinymodel import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_mmproj(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Projectors for the tiny model (tests/tiny_mmproj.py), by kind: "vision+audio" (gemma3 images, non-causal,
    and ultravox audio), "vision" (LLaVA's mlp: causal images), "audio" (ultravox alone)."""
    folder = tmp_path_factory.mktemp("mmproj")
    kinds = {"vision+audio": "gemma3+ultravox", "vision": "mlp", "audio": "ultravox"}
    paths = {}
    for name, kind in kinds.items():
        paths[name] = folder / f"{kind}.gguf"
        build_tiny_mmproj(paths[name], kind)
    return paths


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # ipc:// socket paths are limited to ~107 bytes, so daemons get a short directory under /tmp.
    path = Path(tempfile.mkdtemp(prefix="kvp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon(short_tmp: Path, tiny_model: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start kvpoold processes on the tiny model; every one is stopped and cleaned up after the test."""
    started: list[DaemonProcess] = []

    def start(
        *args: str, model: Path | None = tiny_model, config: str | None = None, name: str = "d", wait: bool = True
    ) -> DaemonProcess:
        daemon = DaemonProcess(short_tmp / name, model, *args, config=config)
        started.append(daemon)
        return daemon.start(wait=wait)

    yield start
    for daemon in started:
        daemon.cleanup()


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    """One daemon on the tiny model: 4 hot slots, 2048 cells, short of nothing the tests need."""
    return start_daemon("--hot-slots", "4", "--context-size", "2048", "--threads", "2")


@pytest.fixture
def start_gateway(short_tmp: Path) -> Iterator[Callable[..., GatewayProcess]]:
    """Start kvpool-gateway processes; every one is stopped after the test."""
    started: list[GatewayProcess] = []

    def start(daemon_address: str, *args: str, name: str = "gw", wait_for: str = "/metrics") -> GatewayProcess:
        gateway = GatewayProcess(short_tmp / name, daemon_address, *args)
        started.append(gateway)
        return gateway.start(wait_for)

    yield start
    for gateway in started:
        gateway.stop()


@pytest.fixture
def served(daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]) -> GatewayProcess:
    """A gateway in front of the `daemon` fixture."""
    return start_gateway(daemon.address)


@pytest.fixture
def redis_server(short_tmp: Path) -> Iterator[RedisServer]:
    """A private redis-server on a free 127.0.0.1 port, killed after the test."""
    need("redis-server")
    server = RedisServer(short_tmp / "redis").start()
    try:
        yield server
    finally:
        server.kill()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if missing:
        names = " ".join(sorted(missing))
        terminalreporter.write_line(
            f"kvpool: tests skipped for missing Debian packages: {names} (sudo apt-get install {names})", yellow=True
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under KVPOOL_REQUIRE_ALL (CI) a run that skipped anything has not tested everything: it fails."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if require_all() and skipped and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        for report in skipped:
            reporter.write_line(f"KVPOOL_REQUIRE_ALL: {report.nodeid} was skipped: {report.longrepr}", red=True)
