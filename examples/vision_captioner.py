"""Vision captioner task: turns long scene descriptions (from a vision model upstream) into one JSON record per
frame (the objects, how many people, the animals, a one-line caption), validated against its schema.

Reads JSON lines {"scene": "..."} from --scenes FILE; each scene gets a fresh session (frames are
independent), and a latency summary is printed at the end. Every session starts with the same instructions
(its system prompt): the daemon computes them once and shares their KV with every later frame. The record is
constrained by the schema in the daemon (docs/protocol.md), so every frame's record parses and validates.

    python examples/vision_captioner.py --scenes examples/data/scenes.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jsonschema
from task_summary import summary

from kvpool.client import Client, KvpoolError

INSTRUCTIONS = (
    "You describe the camera frames of a home robot as JSON: the main objects, the number of people, the "
    "animals, and a caption of one sentence that names what moves.\n\n"
)
RECORD = {
    "type": "object",
    "properties": {
        "objects": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 6},
        "people": {"type": "integer", "minimum": 0, "maximum": 20},
        "animals": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
        "caption": {"type": "string", "maxLength": 120},
    },
    "required": ["objects", "people", "animals", "caption"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", help="kvpoold address (default: $KVPOOL_ADDRESS or the daemon's default)")
    ap.add_argument("--scenes", required=True, help='JSON-lines file of {"scene": text}')
    ap.add_argument("--task", default="vision")
    ap.add_argument("--max-tokens", type=int, default=160)
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
                        f"Scene: {scene}\nRecord:", max_tokens=args.max_tokens, temperature=0.0, json_schema=RECORD
                    )
                if result.finish_reason == "stop":
                    record = json.loads(result.text)
                    jsonschema.validate(record, RECORD)  # the daemon's grammar guarantees it; the task checks
                    print(f"[vision] frame {i}: {json.dumps(record)}", flush=True)
                else:  # cut by max_tokens: the record is unfinished
                    print(f"[vision] frame {i}: (no whole record within {args.max_tokens} tokens)", flush=True)
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
