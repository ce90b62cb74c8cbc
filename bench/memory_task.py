"""A minimal task process for bench/memory.py: only the client library, as a real task would import it."""

from __future__ import annotations

import sys

from kvpool.client import Client

PROMPT = "The robot walked through the quiet house and noted every open window, lamp and sleeping pet. " * 24


def main() -> int:
    with Client(sys.argv[1], timeout=300) as client:
        session = client.open_session()
        session.complete(PROMPT, max_tokens=4, temperature=0.0)
        print("ready", flush=True)
        sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
