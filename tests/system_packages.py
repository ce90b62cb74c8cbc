"""Programs from Debian packages that some tests need. Missing, a test is skipped with a reason naming the package,
and the run ends with one line listing them (conftest.py); with KVPOOL_REQUIRE_ALL=1 (.ci/run) it fails instead."""

from __future__ import annotations

import os
import shutil

import pytest

# program -> the Debian package that provides it
PACKAGES = {
    "redis-server": "redis-server",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
    "systemd-analyze": "systemd",
}
SKIP_PREFIX = "needs Debian package"
missing: set[str] = set()


def require_all() -> bool:
    return os.environ.get("KVPOOL_REQUIRE_ALL", "") not in ("", "0")


def need(*programs: str) -> None:
    """Skip the calling test (fail it under KVPOOL_REQUIRE_ALL) unless every program is on PATH."""
    absent = sorted({PACKAGES[p] for p in programs if shutil.which(p) is None})
    if not absent:
        return
    missing.update(absent)
    reason = f"{SKIP_PREFIX} {', '.join(absent)} (sudo apt-get install {' '.join(absent)}; make test does as root)"
    if require_all():
        pytest.fail(f"KVPOOL_REQUIRE_ALL: this test {reason}", pytrace=False)
    pytest.skip(reason)
