"""Voice assistant task: short turns in one multi-turn session (the daemon keeps the conversation).

Reads one user turn per line from --script FILE or stdin, prints each answer, and a latency summary at the end.
The conversation is in the model's chat format (kvpool.client.chat_session: the GGUF's chat template; the
default model is a base model without one, so a plain transcript), and each turn computes only its new part.

    python examples/voice_assistant.py --script examples/data/voice_turns.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from latency import summary

from kvpool.client import Client, KvpoolError
from kvpool.client.chat_session import ChatSession
from kvpool.client.errors import BudgetUnmeetable

PREAMBLE = "A friendly voice assistant on a home robot answers each question in one short sentence."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", help="kvpoold address (default: $KVPOOL_ADDRESS or the daemon's default)")
    ap.add_argument("--script", help="file with one user turn per line (default: stdin)")
    ap.add_argument("--task", default="voice")
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    lines = Path(args.script).read_text(encoding="utf-8").splitlines() if args.script else sys.stdin
    ttfts: list[float] = []
    tokens = 0
    refused = 0
    started = time.monotonic()
    try:
        with Client(args.address, name="voice-assistant") as client:
            chat = ChatSession(client, task=args.task, system=PREAMBLE, max_tokens=args.max_tokens, stop=["\n"])
            for line in lines:
                question = line.strip()
                if not question:
                    continue
                print(f"[voice] user: {question}", flush=True)
                for attempt in range(3):
                    try:
                        reply = chat.say(question)
                        break
                    except BudgetUnmeetable as exc:  # told at once that it would be late: say so, try again
                        print(
                            f"[voice] (one moment: {exc.detail.get('estimate_ms', 0):.0f} ms is over budget)",
                            flush=True,
                        )
                        time.sleep(0.2 * (attempt + 1))
                else:
                    print("[voice] assistant: (too busy right now)", flush=True)
                    refused += 1
                    continue
                print(f"[voice] assistant: {reply.text.strip()}", flush=True)
                assert reply.final is not None
                ttfts.append(reply.final.timings.ttft_ms)
                tokens += reply.final.usage.completion_tokens
            chat.close()
    except KvpoolError as exc:
        print(f"[voice] error: {exc} {exc.detail or ''}", file=sys.stderr)
        return 1
    print(
        summary("voice", ttfts, tokens, time.monotonic() - started)
        + (f", {refused} turns refused for their budget" if refused else ""),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
