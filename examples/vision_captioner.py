"""Vision captioner task: one JSON record per camera frame (the objects, how many people, the animals, a
one-line caption), validated against its schema.

When the daemon has a projector that reads images (`kvpoold --mmproj`, docs/multimodal.md), each frame goes to it
as an image, through the connection's shared-memory frame area: the files of --frames DIR (PNG, JPEG), else
synthetic frames made with numpy (a moving shape on a gradient) as a stand-in camera. Without one it says so and
falls back to text: the scene descriptions of --scenes FILE (JSON lines {"scene": "..."}), as a vision model
upstream would write them. Each frame gets a fresh session (frames are independent); every session starts with the
same instructions (its system prompt), which the daemon computes once and shares. The record is constrained by the
schema in the daemon (docs/protocol.md), so every frame's record parses and validates.

    python examples/vision_captioner.py --scenes examples/data/scenes.jsonl [--frames DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np
from task_summary import summary

from kvpool.client import Client, Image, KvpoolError

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
    ap.add_argument("--frames", type=Path, help="a folder of PNG or JPEG frames (default: synthetic frames)")
    args = ap.parse_args()
    with open(args.scenes, encoding="utf-8") as f:
        scenes = [json.loads(line)["scene"] for line in f if line.strip()]
    files = (
        sorted(p for p in args.frames.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg")) if args.frames else []
    )
    ttfts: list[float] = []
    tokens = 0
    started = time.monotonic()
    try:
        with Client(args.address, name="vision-captioner") as client:
            media = client.status().media
            sees = media is not None and media.vision
            if sees:
                print(f"[vision] sending {'the frames of ' + str(args.frames) if files else 'synthetic frames'} "
                      f"as images ({media.projector})", flush=True)  # fmt: skip
            else:
                print("[vision] the daemon reads text only (no projector, mmproj): describing the scenes as text",
                      flush=True)  # fmt: skip
            for i, scene in enumerate(scenes):
                if sees:
                    frame = Image(files[i % len(files)].read_bytes()) if files else Image(synthetic_frame(i))
                    prompt: str | list = [f"Frame {i}: ", frame, "\nRecord:"]
                else:
                    prompt = f"Scene: {scene}\nRecord:"
                with client.open_session(args.task, system_prompt=INSTRUCTIONS) as session:
                    result = session.complete(prompt, max_tokens=args.max_tokens, temperature=0.0, json_schema=RECORD)
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


def synthetic_frame(i: int, height: int = 240, width: int = 320) -> np.ndarray:
    """A stand-in camera frame: a gradient with a square that moves from frame to frame (RGB, uint8)."""
    frame = np.zeros((height, width, 3), dtype=np.uint8)
    frame[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    frame[..., 2] = np.linspace(255, 0, height, dtype=np.uint8)[:, None]
    x, y = (40 * i) % (width - 60), (25 * i) % (height - 60)
    frame[y : y + 60, x : x + 60] = (240, 220, 40)
    return frame


if __name__ == "__main__":
    sys.exit(main())
