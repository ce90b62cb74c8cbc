"""Memory of N tasks on one daemon vs N tasks each loading the model: total PSS (psutil), N = 1, 2, 4, 8.

  kvpool   one kvpoold (N hot slots, N x 512 cells, a 16 MiB pool) plus N task processes on the client
           library, each holding a session with ~480 tokens of context
  bare     N idle Python processes: the interpreter a Python task has with or without kvpool, so the client
           library's own share of a task process can be told apart
  Llama    N processes, each running llama-cpp-python's `Llama` with a 512-token context on the same prompt
Reports the marginal MiB per added task and the ratio at N = 4 next to a floor: what any design with one Python
daemon and N Python tasks must hold at least (the weights, a Python process holding just the loaded model, N idle
Python processes and N contexts of KV). Then checks the start-up memory plan against
the measured PSS of a daemon on configs/edge-2gb.toml whose hot slots are full (weights, KV and compute
buffers all touched). PSS divides shared pages (the model file, libraries) among the processes mapping them.

    python bench/memory.py [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client  # noqa: E402
from kvpool.daemon.config import load_config  # noqa: E402
from kvpool.daemon.llama.memory_plan import plan_memory  # noqa: E402

PROMPT = "The robot walked through the quiet house and noted every open window, lamp and sleeping pet. " * 24
COUNTS = [1, 2, 4, 8]
MIB = 2**20
POOL_MIB = 16


def pss(pids: list[int]) -> int:
    return sum(psutil.Process(pid).memory_full_info().pss for pid in pids)


def role_llama(model: str) -> None:
    import llama_cpp  # the status quo: every task loads the model itself

    llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_threads=2, verbose=False)
    llm.create_completion(PROMPT, max_tokens=4, temperature=0.0)
    print("ready", flush=True)
    sys.stdin.readline()


def role_model(model: str) -> None:
    import llama_cpp  # the model alone, no context: what any Python process serving it holds besides the KV

    llama_cpp.llama_backend_init()
    loaded = llama_cpp.llama_model_load_from_file(model.encode(), llama_cpp.llama_model_default_params())
    if not loaded:
        raise SystemExit("the model did not load")
    print("ready", flush=True)
    sys.stdin.readline()


def pss_besides(pid: int, path: str) -> int:
    """The process's PSS in bytes, without its mapping of the file ``path``."""
    total, skip = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):  # a mapping's header line
                skip = len(fields) > 5 and fields[5] == path
            elif fields[0] == "Pss:" and not skip:
                total += int(fields[1]) * 1024
    return total


def model_process_mib(model: str) -> float:
    """MiB a Python process that has only loaded the model holds besides the weights file (vocabulary, llama.cpp's
    model structures, the interpreter, numpy)."""
    proc = subprocess.Popen(
        me("model", model), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the model process failed to start")
        time.sleep(1.0)  # let page accounting settle (measurement, not synchronisation)
        return pss_besides(proc.pid, os.path.realpath(model)) / MIB
    finally:
        if proc.poll() is None:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            proc.wait(60)


def hold(cmds: list[list[str]], extra_pids: list[int]) -> tuple[int, list[int]]:
    """Start the processes, wait until each is ready (holding its context), measure total PSS, release."""
    procs = [
        subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for c in cmds
    ]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a task process failed to start")
        time.sleep(1.0)  # let page accounting settle (measurement, not synchronisation)
        parts = [pss([pid]) for pid in [p.pid for p in procs] + extra_pids]
        return sum(parts), parts
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.stdin.write("go\n")
                proc.stdin.flush()
                proc.wait(60)


# A task process that does nothing: the interpreter every Python task has, with kvpool or without.
BARE = [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.readline()"]


def me(role: str, arg: str) -> list[str]:
    return [sys.executable, str(Path(__file__)), "--role", role, arg]


def edge_plan_check(model: str) -> dict[str, float]:
    edge = HERE.parent / "configs" / "edge-2gb.toml"
    config = load_config(edge)
    plan = plan_memory(Path(model), config)
    with private_daemon(model, "--config", str(edge)) as daemon:
        with Client(daemon.address, timeout=600) as client:
            # fill both hot slots (1,000 tokens each) so the KV and the compute buffers are touched
            sessions = [client.open_session("vision") for _ in range(config.hot_slots)]
            for s in sessions:
                s.complete(PROMPT * 2, max_tokens=4, temperature=0.0)
        measured = pss([daemon.proc.pid])
    return {
        "plan_mib": plan.total / MIB,
        "measured_pss_mib": measured / MIB,
        "error": (plan.total - measured) / measured,
        "plan_table": plan.table(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    args = ap.parse_args()
    if args.role:
        {"llama": role_llama, "model": role_model}[args.role](args.args[0])
        return 0
    model = default_model(args.model)
    rows = []
    for n in COUNTS:
        # The same context per task as the Llama processes (512 cells each), and the smallest useful pool.
        with private_daemon(
            model,
            "--hot-slots",
            str(n),
            "--context-size",
            str(512 * n),
            "--cache-pool-size",
            f"{POOL_MIB}MiB",
            "--threads",
            "2",
        ) as daemon:
            task = [sys.executable, str(HERE / "memory_task.py"), daemon.address]
            kvpool, parts = hold([task] * n, [daemon.proc.pid])
            with Client(daemon.address) as client:
                status = msgspec.to_builtins(client.status())
            # the weights every decode has read, as resident in the only process mapping the file
            weights = pss([daemon.proc.pid]) - pss_besides(daemon.proc.pid, os.path.realpath(model))
        llama, _ = hold([me("llama", model) for _ in range(n)], [])
        bare, _ = hold([BARE] * n, [])
        kv_per_task = status["kv"]["cells_used"] / n * 18 * 1024  # Gemma 3 270M: 18 layers x 1 KiB per cell
        rows.append(
            {
                "n": n,
                "kvpool_mib": kvpool / MIB,
                "llama_mib": llama / MIB,
                "daemon_mib": parts[-1] / MIB,
                "task_process_mib": sum(parts[:-1]) / n / MIB,
                "kv_per_task_mib": kv_per_task / MIB,
                "bare_python_mib": bare / n / MIB,
                "weights_mib": weights / MIB,
            }
        )
        print(f"measured N={n}: {rows[-1]}", file=sys.stderr, flush=True)

    def marginal(key: str) -> float:
        return (rows[-1][key] - rows[0][key]) / (rows[-1]["n"] - rows[0]["n"])

    at4 = next(r for r in rows if r["n"] == 4)
    edge = edge_plan_check(model)
    print("\nTotal PSS (MiB) of N tasks, each with ~480 tokens of context (Gemma 3 270M Q4_K_M)")
    print(
        f"{'N':>2} | {'kvpool (daemon + tasks)':>23} | {'daemon':>7} | {'per task process':>16} | {'N x Llama':>9} | "
        f"{'ratio':>5}"
    )
    for r in rows:
        print(
            f"{r['n']:>2} | {r['kvpool_mib']:>23.1f} | {r['daemon_mib']:>7.1f} | {r['task_process_mib']:>16.1f} | "
            f"{r['llama_mib']:>9.1f} | {r['kvpool_mib'] / r['llama_mib']:>5.2f}"
        )
    kv = rows[-1]["kv_per_task_mib"]
    print(
        f"\nmarginal cost per added task: kvpool {marginal('kvpool_mib'):.1f} MiB = daemon "
        f"{marginal('daemon_mib'):.1f} MiB (its KV is {kv:.1f} MiB) + the task process "
        f"{rows[-1]['task_process_mib']:.1f} MiB; Llama {marginal('llama_mib'):.1f} MiB"
    )
    bare = rows[-1]["bare_python_mib"]
    client_library = rows[-1]["task_process_mib"] - bare
    print(
        f"of the task process, {bare:.1f} MiB is the Python interpreter alone (an idle Python process, {rows[-1]['n']} "
        f"running) and {client_library:.1f} MiB the client library (pyzmq, msgspec, kvpool.client); without the "
        f"interpreter every task has anyway, a task costs KV {kv:.1f} + daemon "
        f"{marginal('daemon_mib') - kv:.1f} + client library {client_library:.1f} MiB"
    )
    print(f"ratio at N=4: {at4['kvpool_mib'] / at4['llama_mib']:.2f}")
    weights = at4["weights_mib"]
    model_rest = model_process_mib(model)
    floor4 = weights + model_rest + 4 * (bare + at4["kv_per_task_mib"])
    print(
        f"floor at N=4 for one Python daemon and 4 Python tasks: resident weights {weights:.1f} + the loaded model's "
        f"process besides them {model_rest:.1f} + 4 x (idle Python {bare:.1f} + KV {at4['kv_per_task_mib']:.1f}) = "
        f"{floor4:.1f} MiB = {floor4 / at4['llama_mib']:.2f} of N x Llama (target <= 0.50); marginal floor per task: "
        f"idle Python + KV = KV + {bare:.1f} MiB (target KV + 5)"
    )
    print(f"\nconfigs/edge-2gb.toml memory plan:\n{edge['plan_table']}")
    print(
        f"measured PSS with both hot slots full: {edge['measured_pss_mib']:.1f} MiB; plan {edge['plan_mib']:.1f} "
        f"MiB ({edge['error']:+.1%})"
    )
    marginal_kvpool, marginal_llama = marginal("kvpool_mib"), marginal("llama_mib")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "memory.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "marginal_kvpool_mib": marginal_kvpool,
                "marginal_llama_mib": marginal_llama,
                "floor_at_4_mib": floor4,
                "weights_mib": weights,
                "model_process_besides_weights_mib": model_rest,
                "edge": edge,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
