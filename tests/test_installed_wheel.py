"""The wheel users deploy: built from the sdist (scripts/build-dist.sh), installed (not editable) into a fresh venv
with llama-cpp-python from the project's wheelhouse, and run from a directory outside the checkout: every module
imports, `kvpoold --check-config`, a daemon with the default model answering `kvpool generate`, the gateway
answering /v1/models and serving its page, `kvpool rpc-worker --help`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import posix_ipc
import pytest

from .daemon_process import STOP_TIMEOUT_S, free_port, wait_until

pytestmark = pytest.mark.gemma  # the installed daemon serves the default model

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("protocol", "client", "gateway", "daemon")  # top-level folders that install as kvpool.<part>
DATA = ("*.jinja", "*.html", "*.kvprofile.json")
LLAMA_CPP_VERSION = "0.3.36"
INSTALL_S = 600.0


@dataclass
class Installed:
    venv: Path
    wheel: Path
    outside: Path  # a working directory that is not the checkout

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *cmd: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVPOOL_ADDRESS")}
        return subprocess.run(
            cmd, cwd=self.outside, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )


def llama_cmake_args() -> str:
    """The CMake arguments .venv's llama-cpp-python was built with (the Makefile records them)."""
    recorded = Path(sys.prefix) / ".llama-cmake-args"
    if not recorded.is_file():
        pytest.fail(f"{recorded} is missing: set up with `make setup`, which records llama-cpp-python's build.")
    return recorded.read_text().strip()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("installed")
    dist, venv, outside = base / "dist", base / "venv", base / "elsewhere"
    outside.mkdir()
    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-dist.sh"), sys.executable, str(dist)],
        capture_output=True,
        text=True,
        timeout=INSTALL_S,
    )
    assert built.returncode == 0, built.stderr
    wheel = next(dist.glob("kvpool-*-py3-none-any.whl"))
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        ["bash", str(ROOT / "scripts" / "install-llama-cpp.sh"), str(venv / "bin" / "python"), LLAMA_CPP_VERSION,
         llama_cmake_args()],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"{wheel}[model,gateway,remote]"],
    ]  # fmt: skip
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_S, cwd=outside)
        assert done.returncode == 0, f"{step}: {done.stderr}"
    return Installed(venv, wheel, outside)


def source_files() -> set[str]:
    """What the wheel must hold: every module and data file under the parts, as installed paths."""
    found = set()
    for part in PARTS:
        for pattern in ("*.py", *DATA):
            for path in (ROOT / part).rglob(pattern):
                if "__pycache__" not in path.parts:
                    found.add("kvpool/" + path.relative_to(ROOT).as_posix())
    return found


def modules(files: set[str]) -> list[str]:
    names = [f.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for f in files if f.endswith(".py")]
    return sorted(names)


def test_the_wheel_holds_every_module_and_data_file_of_the_tree(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        held = {name for name in wheel.namelist() if name.startswith("kvpool/")}
    assert source_files() - held == set(), "the wheel lacks these files of the tree"
    assert held - source_files() == set(), "the wheel holds files the tree does not (a stale build?)"


def test_every_module_imports_from_the_installed_package(installed: Installed) -> None:
    names = modules(source_files())
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    script += "import kvpool.daemon; print(kvpool.daemon.__file__)"
    done = installed.run(installed.bin("python"), "-c", script, *names)
    assert done.returncode == 0, done.stderr
    assert str(installed.venv) in done.stdout  # not the checkout's folders


def test_the_installed_commands_serve_the_default_model(installed: Installed) -> None:
    check = installed.run(installed.bin("kvpoold"), "--check-config")
    assert check.returncode == 0, check.stderr
    assert "memory plan" in (check.stdout + check.stderr).lower()
    rpc = installed.run(installed.bin("kvpool"), "rpc-worker", "--help")
    assert rpc.returncode == 0 and "usage: kvpool rpc-worker" in rpc.stdout, rpc.stderr
    # The default model's precision profile ships in the wheel: a pool that stores by it starts with nothing else.
    profiled = installed.run(installed.bin("kvpoold"), "--check-config", "--pool-kv-type", "profile")
    assert profiled.returncode == 0 and "precision profile: K " in profiled.stderr, profiled.stderr
    helped = installed.run(installed.bin("kvpool-kv-profile"), "--help")
    assert helped.returncode == 0 and "usage: kvpool-kv-profile" in helped.stdout, helped.stderr
    with daemon_of(installed) as address:
        generated = installed.run(
            installed.bin("kvpool"), "--address", address, "generate", "The capital of France is",
            "--max-tokens", "6", "--temperature", "0", "--stats",
        )  # fmt: skip
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout.strip() and "finish=" in generated.stderr
        with gateway_of(installed, address) as url:
            models = httpx.get(url + "/v1/models", timeout=60).json()
            assert len(models["data"]) == 1 and "gemma" in models["data"][0]["id"].lower(), models
            page = httpx.get(url + "/", timeout=60)
            assert page.status_code == 200 and "<title>kvpool</title>" in page.text


class daemon_of:
    """The installed kvpoold with the default model on a private address and pool; stopped on exit."""

    def __init__(self, installed: Installed):
        self.installed = installed
        self.dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvw-{os.getpid()}"
        self.pool = f"/kvpool-wheel-{os.getpid()}"

    def __enter__(self) -> str:
        self.dir.mkdir(exist_ok=True)
        address = f"ipc://{self.dir / 'kvpoold.sock'}"
        cmd = [self.installed.bin("kvpoold"), "--address", address, "--pool-name", self.pool,
               "--spill-dir", str(self.dir / "spill"), "--cache-pool-size", "32MiB"]  # fmt: skip
        self.log = (self.dir / "kvpoold.log").open("wb")
        self.proc = subprocess.Popen(cmd, cwd=self.installed.outside, stdout=self.log, stderr=subprocess.STDOUT)

        def healthy() -> bool:
            assert self.proc.poll() is None, (self.dir / "kvpoold.log").read_text()
            return self.installed.run(self.installed.bin("kvpool"), "--address", address, "health").returncode == 0

        wait_until(healthy, "the installed kvpoold to answer", timeout=120)
        return address

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)
        self.log.close()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.pool)
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


class gateway_of:
    """The installed kvpool-gateway in front of ``address``; stopped on exit."""

    def __init__(self, installed: Installed, address: str):
        self.installed, self.address, self.port = installed, address, free_port()

    def __enter__(self) -> str:
        state = self.installed.outside / "gateway.json"
        cmd = [self.installed.bin("kvpool-gateway"), "--port", str(self.port), "--daemon", self.address,
               "--state-file", str(state)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=self.installed.outside, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{self.port}"

        def up() -> bool:
            assert self.proc.poll() is None, self.proc.stderr.read().decode() if self.proc.stderr else ""
            try:
                return httpx.get(url + "/metrics", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, "the installed gateway to answer", timeout=60)
        return url

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)
