"""Agents' APIs, side by side in one run: 8 conversations x 8 turns through each, on 4 slots, against llama-server.

  responses  kvpool-gateway chaining each turn by previous_response_id (only the new input is sent), against
             llama-server's /v1/responses given the whole history as input items (it refuses previous_response_id)
  messages   Anthropic's /v1/messages on both, the whole history resent each turn, as its clients do

The 8 conversations take turns in order (turn 1 of each, then turn 2 of each...), so with 4 slots each turn finds its
conversation's slot taken by others since its last turn. Reports the median time to first token at each turn
(streamed, send to first text), turn 8's ratio kvpool / llama-server (the target: <= 0.35 on each API), and the
floor under kvpool's turns: the daemon's own time to first token for one turn's new tokens on a held session.
Raw numbers go to bench/out/agent_apis.json.

    python bench/agent_apis.py [--conversations 8] [--turns 8] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from anchors import gateway, llama_server, llama_server_binary  # noqa: E402
from common import default_model, private_daemon  # noqa: E402

SLOTS = 4
INSTRUCTIONS = (
    "You are the household assistant of a home robot. Answer in two short sentences, plainly, and say when you do "
    "not know. The house has a kitchen, a hall, two bedrooms and a garden; the robot can move, look and fetch."
)
ANSWER_TOKENS = 32


def question(conversation: int, turn: int) -> str:
    return (
        f"(conversation {conversation}, turn {turn}) The robot is in room {(conversation + turn) % 5} and sees "
        f"{turn + 2} objects on the floor. What should it do first, and why?"
    )


def first_text(url: str, body: dict[str, Any], delta: str) -> tuple[float, dict[str, Any]]:
    """Stream ``body`` to ``url``: milliseconds to the first event of type ``delta``, and the last event (the whole
    response or message, as the stream ends with it)."""
    started, first, last, text = time.perf_counter(), None, {}, []
    with httpx.stream("POST", url, json=body, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("type") == delta:
                if first is None:
                    first = time.perf_counter()
                text.append(
                    event.get("delta", "") if isinstance(event.get("delta"), str) else event["delta"].get("text", "")
                )
            last = event
    last["text"] = "".join(text)
    return ((first or time.perf_counter()) - started) * 1000.0, last


class ResponsesChain:
    """One conversation through /v1/responses: by previous_response_id (kvpool), or whole (llama-server)."""

    def __init__(self, base: str, i: int, chained: bool):
        self.base, self.i, self.chained = base, i, chained
        self.previous: str | None = None
        self.items: list[dict[str, Any]] = []

    def turn(self, t: int) -> float:
        user = {"type": "message", "role": "user", "content": question(self.i, t)}
        body: dict[str, Any] = {
            "model": "m",
            "instructions": INSTRUCTIONS,
            "max_output_tokens": ANSWER_TOKENS,
            "temperature": 0.0,
            "stream": True,
        }
        if self.chained:
            body["input"] = [user]
            if self.previous:
                body["previous_response_id"] = self.previous
        else:
            body["input"] = [*self.items, user]
        ms, last = first_text(f"{self.base}/v1/responses", body, "response.output_text.delta")
        response = last.get("response", {})
        self.previous = response.get("id")
        self.items += [user, {"type": "message", "role": "assistant", "content": last["text"]}]
        return ms


class MessagesChain:
    """One conversation through /v1/messages, its history resent each turn."""

    def __init__(self, base: str, i: int):
        self.base, self.i = base, i
        self.messages: list[dict[str, Any]] = []

    def turn(self, t: int) -> float:
        self.messages.append({"role": "user", "content": question(self.i, t)})
        body = {
            "model": "m",
            "system": INSTRUCTIONS,
            "messages": self.messages,
            "max_tokens": ANSWER_TOKENS,
            "temperature": 0.0,
            "stream": True,
        }
        ms, last = first_text(f"{self.base}/v1/messages", body, "content_block_delta")
        self.messages.append({"role": "assistant", "content": last["text"] or "(no answer)"})
        return ms


def floor(address: str, repeat: int = 5) -> tuple[float, int]:
    """What a turn costs kvpool at the least: the daemon's time to first token for one turn's new tokens on a
    session that holds the conversation (no gateway, no restore), and how many tokens that is."""
    from kvpool.client import Client

    with Client(address, timeout=300) as client, client.open_session() as s:
        s.complete(INSTRUCTIONS + question(0, 1), max_tokens=ANSWER_TOKENS, temperature=0.0)
        times, tokens = [], 0
        for t in range(2, 2 + repeat):
            done = s.complete(question(0, t), max_tokens=1, temperature=0.0)
            times.append(done.ttft_ms)
            tokens = done.usage.prompt_tokens
    return statistics.median(times), tokens


def run(chains: list[Any], turns: int) -> list[list[float]]:
    """TTFT per turn (a list per turn, one value per conversation)."""
    out: list[list[float]] = []
    for t in range(1, turns + 1):
        out.append([chain.turn(t) for chain in chains])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--llama-server", help="a llama-server binary (default: one scripts/build-llama-server.sh built)")
    args = ap.parse_args()
    model = default_model(args.model)
    binary = llama_server_binary(args.llama_server)
    results: dict[str, list[list[float]]] = {}
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(private_daemon(model, "--hot-slots", str(SLOTS), "--threads", "2"))
        ours = stack.enter_context(gateway(daemon.address, Path(tempfile.mkdtemp(prefix="kvgw-"))))
        setups: dict[str, Any] = {
            "responses kvpool (chained)": lambda i: ResponsesChain(ours, i, chained=True),
            "messages kvpool": lambda i: MessagesChain(ours, i),
        }
        if binary:
            theirs = stack.enter_context(llama_server(binary, model, SLOTS, 4096, "--jinja"))
            setups["responses llama-server (whole)"] = lambda i: ResponsesChain(theirs, i, chained=False)
            setups["messages llama-server"] = lambda i: MessagesChain(theirs, i)
            # The same without its RAM prompt cache (on by default: it restores a resent prefix into a slot).
            cold = stack.enter_context(llama_server(binary, model, SLOTS, 4096, "--jinja", "--cache-ram", "0"))
            setups["messages llama-server, no RAM cache"] = lambda i: MessagesChain(cold, i)
        else:
            print("(no llama-server: build one with scripts/build-llama-server.sh, or pass --llama-server)")
        for name, make in setups.items():
            results[name] = run([make(i) for i in range(args.conversations)], args.turns)
            print(f"measured {name}", file=sys.stderr, flush=True)
        floor_ms, floor_tokens = floor(daemon.address)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "agent_apis.json").write_text(json.dumps(results, indent=2))
    names = list(results)
    print(f"\nTime to first token by turn (ms, medians of {args.conversations} conversations on {SLOTS} slots)")
    print(f"{'turn':>4} | " + " | ".join(f"{n:>36}" for n in names))
    for t in range(args.turns):
        print(f"{t + 1:>4} | " + " | ".join(f"{statistics.median(results[n][t]):>36.1f}" for n in names))
    print(f"floor: kvpool computes one turn's {floor_tokens} new tokens on a held session in {floor_ms:.1f} ms to "
          "first token (the daemon's own measure, no gateway, no restore)")  # fmt: skip
    for api in ("responses", "messages"):
        mine = [n for n in names if n.startswith(api) and "kvpool" in n]
        others = [n for n in names if n.startswith(api) and "llama-server" in n]
        for other in others if mine else []:
            a, b = statistics.median(results[mine[0]][-1]), statistics.median(results[other][-1])
            print(f"{api}: turn {args.turns} kvpool / {other.removeprefix(api + ' ')} = {a / b:.2f} (target <= 0.35)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
