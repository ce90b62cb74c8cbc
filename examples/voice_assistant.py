"""Voice assistant task: each utterance becomes a call of one of the robot's device functions (lights, volume,
timer) or a short spoken answer, in one multi-turn session (the daemon keeps the conversation).

Reads one user turn per line from --script FILE or stdin, and prints each call or answer and a latency summary at the
end. The answer is constrained by a JSON Schema (constrained decoding in the daemon, docs/protocol.md): the model
picks the function and its arguments, the grammar guarantees the syntax, so every turn parses. The conversation is in
the model's chat format (kvpool.client.chat_session), and each turn computes only its new part.

    python examples/voice_assistant.py --script examples/data/voice_turns.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from latency import summary

from kvpool.client import Client, KvpoolError
from kvpool.client.chat_session import ChatSession
from kvpool.client.errors import BudgetUnmeetable

PREAMBLE = (
    "You are the voice of a home robot. Answer every request with one JSON object: to switch lights, "
    '{"device": "lights", "room": ROOM, "on": true or false}; to change the volume, {"device": "volume", "level": '
    '0 to 100}; to start a timer, {"device": "timer", "minutes": N}; otherwise {"say": "one short sentence"}.'
)
ROOMS = ["kitchen", "living room", "bedroom", "hall"]
# The device functions, and a spoken answer: what the model may produce, and nothing else.
ANSWER = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"device": {"const": "lights"}, "room": {"enum": ROOMS}, "on": {"type": "boolean"}},
            "required": ["device", "room", "on"],
        },
        {
            "type": "object",
            "properties": {"device": {"const": "volume"}, "level": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["device", "level"],
        },
        {
            "type": "object",
            "properties": {"device": {"const": "timer"}, "minutes": {"type": "integer", "minimum": 1, "maximum": 180}},
            "required": ["device", "minutes"],
        },
        {"type": "object", "properties": {"say": {"type": "string", "maxLength": 160}}, "required": ["say"]},
    ]
}


def act(answer: dict[str, object]) -> str:
    """What the robot does with an answer: a device call (printed here), or words to speak."""
    if "say" in answer:
        return f"[voice] assistant: {answer['say']}"
    arguments = ", ".join(f"{k}={v!r}" for k, v in answer.items() if k != "device")
    return f"[voice] device: {answer['device']}({arguments})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", help="kvpoold address (default: $KVPOOL_ADDRESS or the daemon's default)")
    ap.add_argument("--script", help="file with one user turn per line (default: stdin)")
    ap.add_argument("--task", default="voice")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    lines = Path(args.script).read_text(encoding="utf-8").splitlines() if args.script else sys.stdin
    ttfts: list[float] = []
    tokens = 0
    refused = 0
    started = time.monotonic()
    try:
        with Client(args.address, name="voice-assistant") as client:
            chat = ChatSession(client, task=args.task, system=PREAMBLE, max_tokens=args.max_tokens)
            for line in lines:
                question = line.strip()
                if not question:
                    continue
                print(f"[voice] user: {question}", flush=True)
                for attempt in range(3):
                    try:
                        reply = chat.say(question, json_schema=ANSWER)
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
                assert reply.final is not None
                if reply.final.finish_reason != "stop":  # cut by max_tokens: the JSON is unfinished
                    print(f"[voice] assistant: (no answer within {args.max_tokens} tokens)", flush=True)
                else:
                    print(act(json.loads(reply.text)), flush=True)
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
