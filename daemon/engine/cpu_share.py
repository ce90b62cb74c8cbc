"""The cores this process may run on, and how many of them other processes leave idle (Linux's /proc and cgroup
files; no llama.cpp). The thread count follows the second; the first is its ceiling."""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

PROC_STAT = Path("/proc/stat")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(proc_self_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may use: its affinity (taskset, systemd's CPUAffinity=), capped by a cgroup v2 CPU
    quota (systemd's CPUQuota=, a container's --cpus) on its cgroup or an ancestor's. os.cpu_count() counts the
    machine's CPUs, which is too many threads when the daemon may use only some of them."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_quota(proc_self_cgroup, cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else max(1, cores)


def process_cpu_seconds() -> float:
    """CPU time of every thread of this process so far (spinning at a barrier counts: a thread waiting for a core
    does not)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def describe_cores(threads: int, fixed_because: str) -> str:
    """The decode's threads as --check-config and the log say them: how many, from what, and whether they adapt."""
    most = threads or usable_cores()
    quota = cgroup_quota(Path("/proc/self/cgroup"), CGROUP_ROOT)
    source = "the threads setting" if threads else "one per core it may use"
    where = f"{len(os.sched_getaffinity(0))} CPUs in its affinity" + (
        f", a cgroup CPU quota of {quota:g}" if quota is not None else ""
    )
    if most == 1:
        follows = "one thread: nothing to adapt"
    elif fixed_because:
        follows = f"fixed ({fixed_because})"
    else:
        follows = "fewer while other processes take cores (adapt_threads)"
    return f"decode threads: {most} ({source}; {where}); {follows}"


def cgroup_quota(proc_self_cgroup: Path, cgroup_root: Path) -> float | None:
    """The tightest cgroup v2 ``cpu.max`` quota (in CPUs) on this process's cgroup and its ancestors; None if none."""
    try:
        line = next(x for x in proc_self_cgroup.read_text().splitlines() if x.startswith("0::"))
    except (OSError, StopIteration):
        return None
    tightest = None
    path = cgroup_root / line[3:].strip().lstrip("/")
    while True:
        try:
            quota, period = (path / "cpu.max").read_text().split()
            if quota != "max":
                cpus = int(quota) / int(period)
                tightest = cpus if tightest is None else min(tightest, cpus)
        except (OSError, ValueError):
            pass
        if path == cgroup_root or cgroup_root not in path.parents:
            return tightest
        path = path.parent


class IdleCores:
    """How many of this process's CPUs sat idle since the last reading (per-CPU idle and iowait ticks in
    /proc/stat): a core other processes left free, which more threads could use."""

    def __init__(self, stat: Path = PROC_STAT, cpus: set[int] | None = None) -> None:
        self.stat = stat
        self.cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        self._last = self._read()

    def _read(self) -> dict[int, tuple[int, int]]:
        """Per CPU: (idle ticks, all ticks)."""
        ticks = {}
        try:
            lines = self.stat.read_text().splitlines()
        except OSError:
            return ticks
        for line in lines:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
                continue
            cpu = int(name[3:])
            if cpu in self.cpus and len(fields) >= 5:
                values = [int(v) for v in fields[:8]]
                ticks[cpu] = (values[3] + values[4], sum(values))
        return ticks

    def since_last(self) -> float | None:
        """Idle CPUs (a fraction of each summed) since the previous call; None when it cannot tell."""
        now = self._read()
        idle = 0.0
        counted = 0
        for cpu, (idle_ticks, all_ticks) in now.items():
            before = self._last.get(cpu)
            if before is None or all_ticks <= before[1]:
                continue
            idle += (idle_ticks - before[0]) / (all_ticks - before[1])
            counted += 1
        self._last = now
        return idle if counted else None


class IdleSampler:
    """IdleCores read at most every ``every`` seconds (a reading over a shorter interval is only tick noise), over
    time the engine spent stepping: a core idle while the engine itself waited for work is its own, not a free one."""

    def __init__(
        self, reader: IdleCores | None = None, every: float = 0.5, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.reader = reader or IdleCores()
        self.every = every
        self._clock = clock
        self._at = clock()
        self._restart = False
        self.last: float | None = None

    def engine_waited(self) -> None:
        """The engine waited for work: the reading under way counts the core it left idle. Start anew."""
        self._restart = True

    def __call__(self) -> float | None:
        now = self._clock()
        if self._restart:  # a fresh baseline: the next reading covers stepping time only
            self._restart, self._at, self.last = False, now, None
            self.reader.since_last()
        elif now - self._at >= self.every:
            self._at = now
            self.last = self.reader.since_last()
        return self.last
