"""A burst of HTTP users: N concurrent chat requests (half streamed) through the asyncio `openai` client, against
kvpool-gateway (default daemon: 4 hot slots; the gateway's own queue) and llama.cpp's llama-server with the same 4
slots, in the same run (when a llama-server is available: --llama-server PATH, or one scripts/build-llama-server.sh
built). Prints per N: answered, refused (HTTP 429), failed (another status, or an error event after 200), the total
time, and p50/p99 request latency (send to the last byte). Target: every request answered up to the configured
queue, total time no longer than llama-server's.

    python bench/gateway_load.py [--model PATH] [--requests 16 64 256] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from anchors import gateway, llama_server, llama_server_binary  # noqa: E402
from common import default_model, private_daemon  # noqa: E402

SLOTS = 4
MAX_TOKENS = 32
TOPICS = ["tea", "owls", "kites", "chess", "bread", "comets", "glaciers", "violins"]


def question(i: int) -> str:
    return f"Request {i}: tell me one short fact about {TOPICS[i % len(TOPICS)]}."


async def burst(url: str, n: int) -> dict[str, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)

    async def one(i: int) -> tuple[str, float]:
        sent = time.monotonic()
        request = {
            "model": "default",
            "messages": [{"role": "user", "content": question(i)}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
        }
        try:
            if i % 2:
                stream = await client.chat.completions.create(stream=True, **request)  # type: ignore[call-overload]
                async for _chunk in stream:
                    pass
            else:
                await client.chat.completions.create(**request)  # type: ignore[call-overload]
            return "answered", time.monotonic() - sent
        except openai.RateLimitError:
            return "refused", time.monotonic() - sent
        except openai.APIError:  # another status, or an error event after a 200
            return "failed", time.monotonic() - sent

    started = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    total = time.monotonic() - started
    await client.close()
    latencies = sorted(t for kind, t in results if kind == "answered")
    count = {kind: sum(1 for k, _ in results if k == kind) for kind in ("answered", "refused", "failed")}
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan")
    return {**count, "total_s": total, "p50_s": statistics.median(latencies) if latencies else float("nan"),
            "p99_s": p99}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--llama-server", help="a llama-server binary (default: one scripts/build-llama-server.sh built)")
    args = ap.parse_args()
    model = default_model(args.model)
    binary = llama_server_binary(args.llama_server)
    rows: list[tuple[str, int, dict[str, float]]] = []
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(private_daemon(model, "--hot-slots", str(SLOTS), "--threads", "2"))
        servers = {"kvpool": stack.enter_context(gateway(daemon.address, Path(tempfile.mkdtemp(prefix="kvgw-"))))}
        if binary:
            servers["llama-server"] = stack.enter_context(llama_server(binary, model, SLOTS, 2048))
        else:
            print("(no llama-server: build one with scripts/build-llama-server.sh, or pass --llama-server)")
        for n in args.requests:  # side by side: each N against every server before the next N
            for name, url in servers.items():
                rows.append((name, n, asyncio.run(burst(url, n))))
                print(f"measured {name} N={n}", file=sys.stderr, flush=True)
    print(f"\n{SLOTS} slots, chat requests of {MAX_TOKENS} greedy tokens, half streamed, all sent at once")
    print(f"{'server':>12} | {'N':>4} | {'answered':>8} | {'refused':>7} | {'failed':>6} | {'total s':>7} | "
          f"{'p50 s':>6} | {'p99 s':>6}")  # fmt: skip
    for server, n, r in rows:
        print(
            f"{server:>12} | {n:>4} | {r['answered']:>8} | {r['refused']:>7} | {r['failed']:>6} | "
            f"{r['total_s']:>7.1f} | {r['p50_s']:>6.1f} | {r['p99_s']:>6.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
