"""A task process for the isolation tests: one session, several greedy turns, tokens printed as JSON.

Usage: turns_worker.py ADDRESS JSON_TURNS. It opens its session, prints "ready", waits for "go" on stdin (so
that all workers generate at the same time), runs the turns and prints {"session": id, "turns": [[tok...]...]}.
"""

from __future__ import annotations

import json
import sys

from kvpool.client import Client


def main() -> int:
    address, turns = sys.argv[1], json.loads(sys.argv[2])
    with Client(address, timeout=120.0) as client, client.open_session() as session:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        out = []
        for turn in turns:
            result = session.complete(turn["prompt"], max_tokens=turn["max_tokens"], temperature=0.0)
            out.append(result.tokens)
        print(json.dumps({"session": session.id, "turns": out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
