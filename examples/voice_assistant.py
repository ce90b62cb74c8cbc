"""Voice assistant task: each utterance becomes a call of one of the robot's device functions (lights, volume,
timer) or a short spoken answer, in one multi-turn session (the daemon keeps the conversation). The conversation
starts with instructions and a few example turns, computed once and shared (docs/prefix-sharing.md).

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

from task_summary import summary

from kvpool.client import Client, KvpoolError
from kvpool.client.chat_session import ChatSession
from kvpool.client.errors import BudgetUnmeetable

PREAMBLE = (
    "A home robot turns each request into one JSON command for its devices (lights, volume, timer), "
    "or says one short sentence."
)
ROOMS = ["kitchen", "living room", "bedroom", "hall"]
# The device functions, and a spoken answer: what the model may produce, and nothing else. Every answer starts
# with its action, so the model's first choice is what to do (a 270M model picks it well from the examples).
ANSWER = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"action": {"const": "lights"}, "room": {"enum": ROOMS}, "power": {"enum": ["on", "off"]}},
            "required": ["action", "room", "power"],
        },
        {
            "type": "object",
            "properties": {"action": {"const": "volume"}, "level": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["action", "level"],
        },
        {
            "type": "object",
            "properties": {"action": {"const": "timer"}, "minutes": {"type": "integer", "minimum": 1, "maximum": 180}},
            "required": ["action", "minutes"],
        },
        {
            "type": "object",
            "properties": {"action": {"const": "say"}, "text": {"type": "string", "maxLength": 160}},
            "required": ["action", "text"],
        },
    ]
}
# Few-shot turns the conversation starts with: a small base model follows examples better than instructions.
EXAMPLES = [
    message
    for question, answer in [
        ("Who wrote Hamlet?", {"action": "say", "text": "William Shakespeare wrote Hamlet."}),
        ("Lights on in the hall, please.", {"action": "lights", "room": "hall", "power": "on"}),
        ("Turn the volume up to 80.", {"action": "volume", "level": 80}),
        ("Thanks a lot!", {"action": "say", "text": "You are welcome."}),
        ("Switch off the bedroom lights.", {"action": "lights", "room": "bedroom", "power": "off"}),
        ("Remind me in 10 minutes.", {"action": "timer", "minutes": 10}),
    ]
    for message in ({"role": "user", "content": question}, {"role": "assistant", "content": json.dumps(answer)})
]


def act(answer: dict[str, object]) -> str:
    """What the robot does with an answer: a device call (printed here), or words to speak."""
    if answer["action"] == "say":
        return f"[voice] assistant: {answer['text']}"
    arguments = ", ".join(f"{k}={v!r}" for k, v in answer.items() if k != "action")
    return f"[voice] device: {answer['action']}({arguments})"


def start(client: Client, task: str, max_tokens: int) -> ChatSession:
    """A conversation that starts with the instructions and the examples, shared as a prefix in the daemon."""
    return ChatSession(client, task=task, system=PREAMBLE, examples=EXAMPLES, share_start=True, max_tokens=max_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", help="kvpoold address (default: $KVPOOL_ADDRESS or the daemon's default)")
    ap.add_argument("--script", help="file with one user turn per line (default: stdin)")
    ap.add_argument("--task", default="voice")
    ap.add_argument("--warm-up-task", default="default", help="task that computes the shared start (no tight budget)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    lines = Path(args.script).read_text(encoding="utf-8").splitlines() if args.script else sys.stdin
    ttfts: list[float] = []
    tokens = 0
    refused = 0
    started = time.monotonic()
    try:
        with Client(args.address, name="voice-assistant") as client:
            # The instructions and examples (~200 tokens) are computed once, at start, on the relaxed warm-up task:
            # the voice conversation shares them, so each of its turns computes only the utterance and meets the
            # voice budget. The warm session stays open, which keeps the shared prefix alive.
            warm = start(client, args.warm_up_task, 1)
            warm.say("Hello.")
            chat = start(client, args.task, args.max_tokens)
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
            warm.close()
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
