"""Vision captioner task: turns long scene descriptions (from a vision model upstream) into one-line captions.

Reads JSON lines {"scene": "..."} from --scenes FILE; each scene gets a fresh session (frames are
independent), and a latency summary is printed at the end. Every session starts with the same instructions
(its system prompt): the daemon computes them once and shares their KV with every later frame.

    python examples/vision_captioner.py --scenes examples/data/scenes.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from latency import summary

from kvpool.client import Client, KvpoolError

INSTRUCTIONS = (
    "You write short captions for the camera frames of a home robot. Each caption is one sentence that names "
    "the main objects and what moves.\n\n"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", help="kvpoold address (default: $KVPOOL_ADDRESS or the daemon's default)")
    ap.add_argument("--scenes", required=True, help='JSON-lines file of {"scene": text}')
    ap.add_argument("--task", default="vision")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    with open(args.scenes, encoding="utf-8") as f:
        scenes = [json.loads(line)["scene"] for line in f if line.strip()]
    ttfts: list[float] = []
    tokens = 0
    started = time.monotonic()
    try:
        with Client(args.address, name="vision-captioner") as client:
            for i, scene in enumerate(scenes):
                with client.open_session(args.task, system_prompt=INSTRUCTIONS) as session:
                    result = session.complete(
                        f"Scene: {scene}\nCaption:",
                        max_tokens=args.max_tokens,
                        temperature=0.0,
                        stop=["\n"],
                    )
                print(f"[vision] frame {i}:{result.text}", flush=True)
                ttfts.append(result.ttft_ms)
                tokens += result.usage.completion_tokens
            shared = client.status().prefixes
    except KvpoolError as exc:
        print(f"[vision] error: {exc}", file=sys.stderr)
        return 1
    print(
        summary("vision", ttfts, tokens, time.monotonic() - started)
        + f", {shared.tokens_saved} prompt tokens shared instead of computed",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
