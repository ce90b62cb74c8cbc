"""Several task processes share one daemon: their sessions stay isolated, and their tokens are batched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .daemon_process import DaemonProcess

WORKER = Path(__file__).with_name("turns_worker.py")
WAIT_S = 120.0


def turns_for(worker: int) -> list[dict[str, object]]:
    return [
        {"prompt": f"Task {worker} opens the conversation: hello number {worker}!", "max_tokens": 40},
        {"prompt": f" Then worker {worker} asks another question", "max_tokens": 24 + worker},
        {"prompt": " and ends.", "max_tokens": 32},
    ]


def run_workers(daemon: DaemonProcess, plans: list[list[dict[str, object]]]) -> list[dict[str, object]]:
    """Run one worker process per plan, all released at once; return their outputs."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), daemon.address, json.dumps(plan)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for plan in plans
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=WAIT_S)
            assert proc.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_concurrent_processes_match_isolated_runs_and_share_decodes(daemon: DaemonProcess) -> None:
    plans = [turns_for(i) for i in range(4)]
    with daemon.client() as client:
        before = client.status().counters
    together = run_workers(daemon, plans)
    with daemon.client() as client:
        after = client.status().counters

    generated = after.generated_tokens - before.generated_tokens
    decodes = after.decode_calls - before.decode_calls
    assert generated == sum(t["max_tokens"] for plan in plans for t in plan)  # tiny model: no early EOS
    # Batching: sessions that generate at the same time share llama_decode calls.
    assert decodes < generated, f"{decodes} decode calls for {generated} tokens: nothing was batched"

    alone = [run_workers(daemon, [plan])[0] for plan in plans]
    for i, (t, a) in enumerate(zip(together, alone, strict=True)):
        assert t["turns"] == a["turns"], f"worker {i}: concurrent tokens differ from the isolated run"
        assert [len(turn) for turn in t["turns"]] == [p["max_tokens"] for p in plans[i]]
    assert len({r["session"] for r in together}) == 4
