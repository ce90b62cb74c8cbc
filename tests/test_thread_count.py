"""The decode's thread count (engine/thread_count.py) and what it reads of the machine (engine/cpu_share.py): pure
logic on a simulated CPU and a fake clock, and /proc and cgroup files written here. No model."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kvpool.daemon.engine.cpu_share import IdleCores, IdleSampler, cgroup_quota, usable_cores
from kvpool.daemon.engine.thread_count import PROBE_MAX_S, PROBE_STEPS, ThreadCount

STEP_S = 0.04  # a decode step's time at start


class Machine:
    """A simulated CPU: each thread count's slowdown now, the CPU its threads get (in cores: all they ask for,
    unless given) and the idle cores /proc/stat would show."""

    def __init__(
        self, slowdown: dict[int, float], idle: float | None = None, cores: dict[int, float] | None = None
    ) -> None:
        self.slowdown, self.idle, self.t = slowdown, idle, 0.0
        self.cores = cores or {}

    def clock(self) -> float:
        return self.t

    def run(self, count: ThreadCount, steps: int, may_probe: Callable[[int], bool] = lambda _: True) -> list[int]:
        """``steps`` engine steps; the thread count each ran with."""
        used = []
        for i in range(steps):
            threads = count.for_next_step(may_probe(i))
            self.t += STEP_S * self.slowdown[threads]
            count.observe(threads, self.slowdown[threads], cores=self.cores.get(threads, float(threads)))
            used.append(threads)
        return used


def counted(machine: Machine, most: int = 2) -> ThreadCount:
    return ThreadCount(most, adaptive=True, idle_cores=lambda: machine.idle, clock=machine.clock)


ALONE = {1: 1.7, 2: 1.0}
BESIDE_ONE = {1: 1.8, 2: 4.0}  # measured on 2 cores beside a busy process: 1 thread more than twice as fast
SHARED = {1: 1.0, 2: 1.3}  # the cores 1 and 2 threads get beside it (3 runnable threads on 2 cores)


def test_alone_it_keeps_every_thread_and_never_probes() -> None:
    machine = Machine(ALONE, idle=0.0)
    count = counted(machine)
    assert set(machine.run(count, 5000)) == {2}  # 200 s: its threads got every core they asked for
    assert count.probes == 0 and count.switches == 0


def test_started_beside_a_neighbour_it_sees_its_threads_wait_for_a_core() -> None:
    # Calibrated while the neighbour ran: the steps show no slowdown, but two threads get 1.3 cores.
    machine = Machine({1: 0.45, 2: 1.0}, idle=0.0, cores=SHARED)
    count = counted(machine)
    machine.run(count, 200)
    assert count.now == 1 and count.switches == 1
    assert count.status().cores == 1.0


def test_beside_a_busy_neighbour_it_drops_a_thread_within_a_few_steps() -> None:
    machine = Machine(ALONE, idle=0.0)
    count = counted(machine)
    machine.run(count, 50)
    machine.slowdown = BESIDE_ONE
    used = machine.run(count, 200)
    assert count.now == 1
    assert used.index(1) < 20  # settle (8 steps), see the slowdown, probe one fewer
    assert used[-100:].count(2) <= 8  # then it stays, bar the odd probe up


def test_it_comes_back_when_a_core_goes_idle() -> None:
    machine = Machine(BESIDE_ONE, idle=0.0, cores=SHARED)
    count = counted(machine)
    machine.run(count, 200)
    assert count.now == 1
    machine.slowdown, machine.idle, machine.cores = ALONE, 1.0, {}  # the neighbour left: its core sits idle
    used = machine.run(count, 60)
    assert count.now == 2 and used.index(2) < 40


def test_it_comes_back_by_probing_when_no_core_shows_idle() -> None:
    # A neighbour at a low priority fills the idle core, yet yields it to the daemon's second thread.
    machine = Machine(BESIDE_ONE, idle=0.0, cores=SHARED)
    count = counted(machine)
    machine.run(count, 200)
    machine.slowdown = {1: 1.7, 2: 1.1}
    started = machine.t
    while count.now == 1 and machine.t - started < 2 * PROBE_MAX_S:
        machine.run(count, 1)
    assert count.now == 2


def test_a_heavier_moment_that_passes_does_not_make_a_probe_look_better_than_it_is() -> None:
    # Beside one neighbour at one thread; two more run for a moment (three busy processes on two cores), then stop.
    # The steps at one thread speed up again, which calls for a probe of two: it must be judged against how one
    # thread runs now, not during the heavier moment, or two threads beside the neighbour win on stale numbers
    # (seen beside a numpy loop: voice turns of 265 ms until it switched back).
    machine = Machine(BESIDE_ONE, idle=0.0, cores=SHARED)
    count = counted(machine)
    machine.run(count, 200)
    assert count.now == 1
    machine.slowdown = {1: 3.1, 2: 5.0}
    machine.run(count, 24)
    machine.slowdown = {1: 1.5, 2: 1.75}  # as measured: one thread beside the one neighbour left is still faster
    used = machine.run(count, 200)
    assert count.now == 1 and count.switches == 1, used
    assert used.count(2) <= 2 * PROBE_STEPS


def test_a_probe_and_the_steps_it_is_judged_against_must_be_of_one_moment() -> None:
    # The neighbour leaves, a probe of two threads measures fast; then the engine waits five seconds, the neighbour
    # comes back, and the next steps at one thread are slow. Two moments: no verdict (two threads would lose now).
    machine = Machine(BESIDE_ONE, idle=0.0, cores=SHARED)
    count = counted(machine)
    machine.run(count, 200)
    assert count.now == 1
    machine.slowdown, machine.idle, machine.cores = ALONE, 1.0, {}
    used: list[int] = []
    while not (used and used[-1] == 2 and not count.probing):  # until the probe's own steps are done
        used += machine.run(count, 1)
    assert used.count(2) == PROBE_STEPS
    machine.t += 5.0
    machine.slowdown, machine.idle, machine.cores = BESIDE_ONE, 0.0, SHARED
    machine.run(count, PROBE_STEPS + 4)
    assert count.now == 1 and count.switches == 1


def test_probes_that_do_not_pay_back_off() -> None:
    machine = Machine(BESIDE_ONE, idle=0.0, cores=SHARED)
    count = counted(machine)
    machine.run(count, 200)
    probes = count.probes
    used = []
    while machine.t < 300.0:  # five minutes beside the neighbour
        used += machine.run(count, 100)
    assert count.now == 1
    assert count.probes - probes <= 14  # 2, 4, 8, 16, then every 32 s
    assert count.switches == 1
    assert used.count(2) <= 2 * (count.probes - probes)  # a probe that is clearly slower ends after two steps


def test_no_probe_while_a_first_token_is_due() -> None:
    machine = Machine(ALONE, idle=0.0)
    count = counted(machine)
    machine.run(count, 50)
    machine.slowdown = BESIDE_ONE
    used = machine.run(count, 300, may_probe=lambda _: False)
    assert set(used) == {2} and count.probes == 0
    assert count.for_next_step(True) == 1 and count.probing  # once it may: a probe of one thread fewer
    count.observe(1, BESIDE_ONE[1])
    assert count.for_next_step(False) == 2 and not count.probing  # a deadline came due: the probe is given up


def test_steps_with_a_thread_lent_to_an_encode_do_not_count() -> None:
    machine = Machine(ALONE, idle=0.0)
    count = counted(machine)
    machine.run(count, 40)  # 1.6 s: before the first periodic probe, and the clock stands still below
    for _ in range(200):  # steps with one thread lent are slower, by the lent thread, not by a neighbour
        threads = count.for_next_step(True)
        count.observe(threads, 1.7, lent=True)
    assert count.now == 2 and count.probes == 0


def test_on_eight_cores_beside_one_neighbour_it_settles_on_seven() -> None:
    free = 7

    def slowdown(n: int) -> float:
        return 8 / n * (3.0 if n > free else 1.0)

    machine = Machine({n: 8 / n for n in range(1, 9)}, idle=0.0)
    count = counted(machine, most=8)
    machine.run(count, 50)
    machine.slowdown = {n: slowdown(n) for n in range(1, 9)}
    while machine.t < 120.0:
        machine.run(count, 100)
    assert count.now == 7


def test_a_fixed_count_never_moves() -> None:
    machine = Machine(BESIDE_ONE, idle=1.0)
    count = ThreadCount(2, adaptive=False, fixed_because="deterministic decoding", clock=machine.clock)
    assert set(machine.run(count, 500)) == {2}
    assert count.status().fixed_because == "deterministic decoding" and not count.status().adaptive
    assert ThreadCount(1, adaptive=True).status().fixed_because == "one core"


# ---------------------------------------------------------------- cpu_share


def test_usable_cores_are_the_affinity_capped_by_the_cgroup_quota(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "system.slice" / "kvpoold.service").mkdir(parents=True)
    me = tmp_path / "self-cgroup"
    me.write_text("0::/system.slice/kvpoold.service\n")
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(me, root) == affinity  # no cpu.max anywhere
    (root / "system.slice" / "kvpoold.service" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(me, root) is None
    (root / "system.slice" / "cpu.max").write_text("50000 100000\n")  # an ancestor's quota binds too
    assert cgroup_quota(me, root) == 0.5
    assert usable_cores(me, root) == 1
    (root / "system.slice" / "cpu.max").write_text("150000 100000\n")
    assert usable_cores(me, root) == min(affinity, 2)
    me.write_text("12:cpu:/legacy\n")  # cgroup v1 only: no quota read, the affinity stands
    assert usable_cores(me, root) == affinity


def stat_lines(cpus: dict[int, tuple[int, int, int]]) -> str:
    """/proc/stat with, per CPU, (busy user ticks, idle ticks, iowait ticks)."""
    lines = ["cpu  1 2 3 4 5 6 7 8 9 10"]
    for cpu, (busy, idle, iowait) in cpus.items():
        lines.append(f"cpu{cpu} {busy} 0 0 {idle} {iowait} 0 0 0 0 0")
    return "\n".join([*lines, "intr 1 2 3", "ctxt 99"]) + "\n"


def test_idle_cores_count_only_the_cpus_the_daemon_may_use(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(stat_lines({0: (100, 100, 0), 1: (100, 100, 0), 2: (100, 100, 0)}))
    idle = IdleCores(stat, cpus={0, 1})
    # Over the interval: cpu0 all busy, cpu1 idle half the time (part of it waiting on I/O), cpu2 (not ours) idle.
    stat.write_text(stat_lines({0: (200, 100, 0), 1: (150, 140, 10), 2: (100, 200, 0)}))
    assert idle.since_last() == 0.5
    assert idle.since_last() is None  # no tick passed: it cannot tell
    assert IdleCores(tmp_path / "missing", cpus={0}).since_last() is None


class Always(IdleCores):
    def __init__(self, idle: float) -> None:
        self.idle, self.reads = idle, 0

    def since_last(self) -> float | None:
        self.reads += 1
        return self.idle


def test_a_core_left_idle_while_the_engine_waited_is_not_a_free_one() -> None:
    t = [0.0]
    reader = Always(1.0)
    sampler = IdleSampler(reader, every=0.5, clock=lambda: t[0])
    t[0] = 0.6
    assert sampler() == 1.0
    sampler.engine_waited()  # between two answers: the engine's own core sat idle
    assert sampler() is None and reader.reads == 2  # a fresh baseline, no reading yet
    t[0] = 0.9
    assert sampler() is None  # under `every` of stepping: nothing to tell
    t[0] = 1.2
    assert sampler() == 1.0  # half a second of stepping with a core idle: it is free
