"""Stateless chat clients through kvpool-gateway, with the real `openai` client: what conversation reuse buys.

16 conversations (distinct from their first token, so no shared prefix helps) x 8 turns, round robin, each turn
~40 new user tokens and up to 32 generated (greedy, streamed), on the default model with 4 hot slots, so the
conversations keep moving between the hot slots and the pool. Three ways, side by side on one daemon:
  (a) key       the conversation is named by prompt_cache_key: each turn sends only its new tokens
  (b) implicit  no name: the gateway finds the session whose text the resent history begins with
  (c) no reuse  a gateway with --no-reuse: every turn re-prefills the whole conversation (llama-server without
                a free slot for it, or any stateless server)
Prints time to first token per turn (p50, p99 over the 16 conversations) and total time, and plots TTFT per turn
to bench/out/chat.png. Then the gateway's own cost: the p50 latency of a 1-token completion through the gateway
(--no-reuse, no name) and through the Python client library (open, complete, close), interleaved.

    python bench/chat_turns.py [--model PATH] [--conversations 16] [--turns 8] [--overhead-requests 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from common import default_model, private_daemon  # noqa: E402

from tests.gateway_process import GatewayProcess  # noqa: E402

TOPICS = [
    "lighthouses", "bread baking", "tide pools", "glaciers", "violins", "beekeeping", "comets", "bicycles",
    "volcanoes", "origami", "owls", "tea", "submarines", "cacti", "chess", "kites",
]  # fmt: skip
FILLER = "Please keep the answer short and friendly, and mention one fact I may not know about it yet."


def user_turn(i: int, k: int) -> str:
    """~40 tokens, distinct from the first token on (the topic comes first)."""
    return f"{TOPICS[i % len(TOPICS)].capitalize()}, question {k + 1}: what else should I know? {FILLER}"


def run_conversations(url: str, model: str, mode: str, conversations: int, turns: int) -> list[list[float]]:
    """TTFT in ms per turn (rows) and conversation (columns)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    histories = [[{"role": "user", "content": user_turn(i, 0)}] for i in range(conversations)]
    ttft: list[list[float]] = []
    for k in range(turns):
        row = []
        for i, history in enumerate(histories):
            extra = {"prompt_cache_key": f"{mode}-{i}"} if mode == "key" else {}
            started = time.monotonic()
            first = None
            parts = []
            stream = client.chat.completions.create(
                model=model, messages=history, max_tokens=32, temperature=0.0, stream=True, **extra
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.monotonic()
                    parts.append(chunk.choices[0].delta.content)
            row.append(((first or time.monotonic()) - started) * 1000.0)
            history += [
                {"role": "assistant", "content": "".join(parts)},
                {"role": "user", "content": user_turn(i, k + 1)},
            ]
        ttft.append(row)
        print(f"  {mode}: turn {k + 1} p50 {statistics.median(row):.0f} ms", file=sys.stderr, flush=True)
    return ttft


def overhead(address: str, url: str, model: str, requests: int) -> tuple[float, float]:
    """p50 ms of a 1-token completion through the gateway and through the client library, interleaved."""
    import openai

    from kvpool.client import Client

    gateway = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    via_gateway, via_library = [], []
    with Client(address) as library:
        for n in range(requests):
            prompt = f"Request {n}: the sky is"
            started = time.monotonic()
            gateway.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
            via_gateway.append((time.monotonic() - started) * 1000.0)
            started = time.monotonic()
            with library.open_session(system_prompt="") as s:
                s.complete(prompt, max_tokens=1, temperature=0.0)
            via_library.append((time.monotonic() - started) * 1000.0)
    return statistics.median(via_gateway), statistics.median(via_library)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--overhead-requests", type=int, default=40)
    args = ap.parse_args()
    model_path = default_model(args.model)
    model_id = Path(model_path).name.removesuffix(".gguf")
    results: dict[str, list[list[float]]] = {}
    totals: dict[str, float] = {}
    with private_daemon(model_path, "--hot-slots", "4", "--context-size", "8192", "--threads", "2",
                        "--cache-pool-size", "512MiB") as daemon:  # fmt: skip
        work = Path(daemon.workdir)
        reusing = GatewayProcess(work / "gw", daemon.address).start()
        stateless = GatewayProcess(work / "gw-stateless", daemon.address, "--no-reuse").start()
        try:
            for mode, gateway in (("key", reusing), ("implicit", reusing), ("no reuse", stateless)):
                started = time.monotonic()
                results[mode] = run_conversations(gateway.url, model_id, mode, args.conversations, args.turns)
                totals[mode] = time.monotonic() - started
            via_gateway, via_library = overhead(daemon.address, stateless.url, model_id, args.overhead_requests)
        finally:
            reusing.stop()
            stateless.stop()
    print(f"\nTime to first token per turn (ms), {args.conversations} conversations round robin, 4 hot slots")
    header = f"{'turn':>4} | " + " | ".join(f"{m:>19}" for m in results) + " | (c)/(a) | (c)/(b)"
    print(header + "\n" + "-" * len(header))
    print(f"{'':>4} | " + " | ".join(f"{'p50':>9} {'p99':>9}" for _ in results))
    for k in range(args.turns):
        cells = {m: (statistics.median(r[k]), p99(r[k])) for m, r in results.items()}
        ratios = [cells["no reuse"][0] / cells[m][0] for m in ("key", "implicit")]
        print(
            f"{k + 1:>4} | "
            + " | ".join(f"{a:>9.0f} {b:>9.0f}" for a, b in cells.values())
            + f" | {ratios[0]:>6.1f}x | {ratios[1]:>6.1f}x"
        )
    print("total s | " + " | ".join(f"{totals[m]:>19.1f}" for m in results))
    print(
        f"\nA 1-token completion, p50 of {args.overhead_requests}: gateway {via_gateway:.1f} ms, client library "
        f"{via_library:.1f} ms, the gateway adds {via_gateway - via_library:.1f} ms"
    )
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "chat.json").write_text(json.dumps({"ttft_ms": results, "total_s": totals,
                                               "overhead_ms": [via_gateway, via_library]}, indent=1))  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for mode, rows in results.items():
            ax.plot(range(1, args.turns + 1), [statistics.median(r) for r in rows], "o-", label=mode)
        ax.set_xlabel("turn")
        ax.set_ylabel("time to first token, p50 (ms)")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title("kvpool-gateway: conversation reuse")
        fig.tight_layout()
        fig.savefig(out / "chat.png", dpi=100)
    except ImportError:
        print("(matplotlib is missing: no plot; pip install 'kvpool[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
