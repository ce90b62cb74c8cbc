"""A scripted tool loop through the `openai` client: what keeping a conversation's KV buys an agent.

8 conversations x 4 rounds, round robin, on 4 slots (so conversations move between the hot slots and the pool).
Each round: the user asks for something a tool does; the model calls a tool (tool_choice "required", one call:
parallel_tool_calls false); the tool's result goes back; the model answers (tool_choice "auto", streamed).
Reported: the time to the first token of those answers (p50, p99; the first streamed chunk, which the gateway
sends once the first token is generated, and llama-server's first text), side by side on one machine:
  (a) kvpool       kvpool-gateway, the conversation named by prompt_cache_key: each request computes only its
                   new tokens (the call, the result, the next question); after a call the gateway computes the
                   opening of its result while the tool runs (docs/gateway.md)
  (a') no prefill  the same without that (--no-tool-result-prefill)
  (b) no reuse     kvpool-gateway --no-reuse: every request re-prefills the whole conversation
  (c) llama-server llama.cpp's server with the same 4 slots and its prompt cache; it has no tool syntax for this
                   model, so the benchmark offers the tools itself in the same words and envelope (the gateway's
                   tools.Toolbox: the system text, and the envelope's JSON Schema as response_format); it renders
                   them with its own default template for a GGUF without one, ChatML (spelled out in text: these
                   are not special tokens of Gemma's vocabulary)
  (d) same text    llama-server given the gateway's transcript template (--chat-template-file), so both servers
                   compute the same text: what its template adds to (c)
Target: (a) <= 0.5x (c) (or (b) when no llama-server is available).

Then the floor those times run into, side by side in the same run: the time each server takes to compute N new
tokens on a conversation it holds (HISTORY tokens, one output, no grammar), for N = what (a) and (c) computed per
answer. kvpool: the daemon's time to the first token, and the client library's; llama-server: /completion on one
slot with its cache, its own prompt_ms (and prompt_n, the tokens it evaluated) and the wall time of the request.

The tools answer at once unless --tool-ms says how long each takes (the loop waits that long between the call
and the request with its result): a tool that switches a lamp or fetches a forecast takes tens to hundreds of ms.

    python bench/tool_loop.py [--model PATH] [--conversations 8] [--rounds 4] [--llama-server PATH]
                              [--floor-repeat 7] [--tool-ms 0]
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from anchors import ROOT, gateway, llama_server, llama_server_binary  # noqa: E402
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client  # noqa: E402
from kvpool.gateway.tools import Tool, Toolbox  # noqa: E402

SLOTS = 4
HISTORY = 450  # tokens a conversation holds when the floor is measured: the loop's answers start at 250 to 650
TRANSCRIPT = ROOT / "client" / "templates" / "transcript.jinja"  # the gateway's template for this model
SYSTEM = "You are a home robot's assistant. Keep answers short."
TOOLS = [
    Tool("get_weather", "The weather now in a city.", {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}),
    Tool("set_timer", "Start a kitchen timer.", {"type": "object", "properties": {"minutes": {"type": "integer",
         "minimum": 1, "maximum": 120}}, "required": ["minutes"]}),
    Tool("note", "Write a note on the fridge screen.", {"type": "object", "properties": {"text": {"type": "string",
         "maxLength": 80}}, "required": ["text"]}),
]  # fmt: skip
ASKS = [
    "What is the weather in {city}?",
    "Set a timer for {minutes} minutes, please.",
    "Write a note that we need {thing}.",
    "And the weather in {city} tomorrow?",
]
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Dublin"]
THINGS = ["milk", "bread", "eggs", "tea", "rice", "soap", "apples", "salt"]


def ask(conversation: int, round_: int) -> str:
    return ASKS[round_ % len(ASKS)].format(
        city=CITIES[(conversation + round_) % len(CITIES)], minutes=5 + conversation, thing=THINGS[conversation]
    )


def tool_result(name: str, arguments: str) -> str:
    return {"get_weather": "18 C, light rain", "set_timer": "timer started", "note": "note written"}.get(name, "done")


def openai_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
             "parameters": t.parameters}} for t in TOOLS]  # fmt: skip


class KvpoolLoop:
    """One conversation through kvpool-gateway, with OpenAI's tool messages."""

    def __init__(self, client: Any, i: int, named: bool):
        self.client, self.key = client, (f"loop-{i}" if named else None)
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]

    def _create(self, **kw: Any) -> Any:
        extra = {"prompt_cache_key": self.key} if self.key else {}
        return self.client.chat.completions.create(
            model="default", messages=self.messages, tools=openai_tools(), parallel_tool_calls=False, max_tokens=48,
            temperature=0.0, **extra, **kw,
        )  # fmt: skip

    def call(self, question: str) -> None:
        self.messages.append({"role": "user", "content": question})
        message = self._create(tool_choice="required").choices[0].message
        self.messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            result = tool_result(call.function.name, call.function.arguments)
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

    def answer(self) -> tuple[float, int]:
        """Seconds to the first token of the answer to the tool's result (the gateway sends its first chunk once
        the first token is generated; a call's id and name follow when they are generated, as llama-server's
        envelope text does), and the prompt tokens computed for it (not taken from the session's KV)."""
        started, first, computed = time.monotonic(), None, -1
        content, calls = [], {}
        for chunk in self._create(tool_choice="auto", stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                computed = chunk.usage.prompt_tokens - (chunk.usage.prompt_tokens_details.cached_tokens or 0)
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is None:
                continue
            if first is None:
                first = time.monotonic()
            content.append(delta.content or "")
            for c in delta.tool_calls or ():
                slot = calls.setdefault(
                    c.index, {"id": c.id, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                if c.function is not None:
                    slot["function"]["name"] += c.function.name or ""
                    slot["function"]["arguments"] += c.function.arguments or ""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
        if calls:
            message["tool_calls"] = [calls[k] for k in sorted(calls)]
        self.messages.append(message)
        for call in message.get("tool_calls", ()):
            result = tool_result(call["function"]["name"], call["function"]["arguments"])
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return (first or time.monotonic()) - started, computed


class LlamaServerLoop:
    """The same conversation through llama-server, the tools offered in the gateway's words and envelope."""

    def __init__(self, client: Any, i: int):
        self.client = client
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM + "\n\n" + toolbox("auto").offer()}]

    def _create(self, choice: str, **kw: Any) -> Any:
        schema, _ = toolbox(choice).schema()
        return self.client.chat.completions.create(
            model="default", messages=self.messages, max_tokens=48, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "envelope", "schema": schema}}, **kw,
        )  # fmt: skip

    def _results(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        with contextlib.suppress(ValueError, KeyError, TypeError):
            calls = json.loads(text)["tool_calls"]
            results = [{"tool_response": {"name": c["name"], "content": tool_result(c["name"], "")}} for c in calls]
            self.messages.append({"role": "user", "content": "\n".join(json.dumps(r) for r in results)})

    def call(self, question: str) -> None:
        self._add_user(question)
        self._results(self._create("required").choices[0].message.content or "")

    def answer(self) -> tuple[float, int]:
        started, first, parts, computed = time.monotonic(), None, [], -1
        for chunk in self._create("auto", stream=True):
            timings = (chunk.model_extra or {}).get("timings")  # llama-server's own: prompt_n tokens evaluated
            if isinstance(timings, dict) and "prompt_n" in timings:
                computed = int(timings["prompt_n"])
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                first = first or time.monotonic()
                parts.append(piece)
        self._results("".join(parts))
        return (first or time.monotonic()) - started, computed

    def _add_user(self, text: str) -> None:
        if self.messages[-1]["role"] == "user":  # after a tool result: one user turn (roles alternate)
            self.messages[-1]["content"] += "\n" + text
        else:
            self.messages.append({"role": "user", "content": text})


def toolbox(choice: str) -> Toolbox:
    return Toolbox(tuple(TOOLS), choice, parallel=False, response=None)


def run(loops: list[Any], rounds: int, tool_ms: float = 0.0) -> tuple[list[float], list[int]]:
    """Each answer's time to first token (ms) and its computed prompt tokens (-1: the server did not say).
    ``tool_ms``: how long each tool takes to answer (the loop waits that long between the call and the answer)."""
    ttft, computed = [], []
    for r in range(rounds):
        for i, loop in enumerate(loops):
            loop.call(ask(i, r))
            time.sleep(tool_ms / 1000.0)  # the tool at work (a lamp switched, a forecast fetched)
            seconds, tokens = loop.answer()
            ttft.append(seconds * 1000.0)
            computed.append(tokens)
    return ttft, computed


def floor(daemon_address: str, server: str | None, sizes: list[int], repeat: int) -> dict[str, dict[int, float]]:
    """Median milliseconds to compute each of ``sizes`` new tokens on a conversation of HISTORY tokens, alternating
    the two servers; a fresh conversation (and its first HISTORY tokens, untimed) for every measurement."""
    import httpx

    words = ["the", "robot", "looked", "at", "the", "kitchen", "timer", "and", "wrote", "a", "note"]
    client = Client(daemon_address)
    samples: dict[str, dict[int, list[float]]] = {}

    def text(n: int, offset: int) -> list[int]:
        return client.tokenize(" ".join(words[(i * 7 + offset) % len(words)] for i in range(n)), add_bos=False)[:n]

    def note(name: str, n: int, value: float) -> None:
        samples.setdefault(name, {}).setdefault(n, []).append(value)

    try:
        for r in range(repeat):
            for n in sizes:
                history = [*client.tokenize("", add_bos=True), *text(HISTORY - 1, r)]
                new = text(n, r + 3)
                session = client.open_session("default")
                try:
                    list(session.generate(history, max_tokens=1, temperature=0.0))
                    started = time.monotonic()
                    stream = session.generate(new, max_tokens=1, temperature=0.0)
                    list(stream)
                    note("kvpool client", n, (time.monotonic() - started) * 1000.0)
                    assert stream.final is not None
                    note("kvpool daemon", n, stream.final.timings.ttft_ms)
                finally:
                    session.close()
                if server is None:
                    continue
                ask = {"n_predict": 1, "cache_prompt": True, "id_slot": 0, "temperature": 0.0}
                httpx.post(server + "/completion", json={**ask, "prompt": history}, timeout=120).raise_for_status()
                started = time.monotonic()
                reply = httpx.post(server + "/completion", json={**ask, "prompt": history + new}, timeout=120)
                reply.raise_for_status()
                note("llama-server wall", n, (time.monotonic() - started) * 1000.0)
                timings = reply.json()["timings"]
                note("llama-server prompt_ms", n, float(timings["prompt_ms"]))
                note("llama-server prompt_n", n, float(timings["prompt_n"]))
    finally:
        client.close()
    return {name: {n: statistics.median(v) for n, v in by_n.items()} for name, by_n in samples.items()}


def main() -> int:
    import openai

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--llama-server", help="a llama-server binary (default: one scripts/build-llama-server.sh built)")
    ap.add_argument("--floor-repeat", type=int, default=7, help="measurements per size in the floor table (0: none)")
    ap.add_argument("--tool-ms", type=float, default=0.0, help="how long each tool takes to answer (default: at once)")
    args = ap.parse_args()
    model = default_model(args.model)
    binary = llama_server_binary(args.llama_server)
    results: dict[str, list[float]] = {}
    computed: dict[str, list[int]] = {}
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(private_daemon(model, "--hot-slots", str(SLOTS), "--threads", "2"))
        reuse = stack.enter_context(gateway(daemon.address, Path(tempfile.mkdtemp(prefix="kvgw-"))))
        plain = stack.enter_context(
            gateway(daemon.address, Path(tempfile.mkdtemp(prefix="kvgw-")), "--no-tool-result-prefill")
        )
        fresh = stack.enter_context(gateway(daemon.address, Path(tempfile.mkdtemp(prefix="kvgw-")), "--no-reuse"))
        setups: dict[str, tuple[str, Any]] = {
            "(a) kvpool": (reuse, lambda c, i: KvpoolLoop(c, i, named=True)),
            "(a') no prefill": (plain, lambda c, i: KvpoolLoop(c, i, named=True)),
            "(b) no reuse": (fresh, lambda c, i: KvpoolLoop(c, i, named=False)),
        }
        server = None
        if binary:
            server = stack.enter_context(llama_server(binary, model, SLOTS, 2048))
            setups["(c) llama-server"] = (server, LlamaServerLoop)
            same_text = stack.enter_context(
                llama_server(binary, model, SLOTS, 2048, "--chat-template-file", str(TRANSCRIPT))
            )
            setups["(d) same text"] = (same_text, LlamaServerLoop)
        else:
            print("(no llama-server: build one with scripts/build-llama-server.sh, or pass --llama-server)")
        for name, (url, make) in setups.items():
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            loops = [make(client, i) for i in range(args.conversations)]
            results[name], computed[name] = run(loops, args.rounds, args.tool_ms)
            print(f"measured {name}", file=sys.stderr, flush=True)
        known = {name: [t for t in tokens if t >= 0] for name, tokens in computed.items() if name != "(b) no reuse"}
        size_of = {name: round(statistics.median(tokens)) for name, tokens in known.items() if tokens}
        sizes = sorted(set(size_of.values()))
        floors = floor(daemon.address, server, sizes, args.floor_repeat) if args.floor_repeat > 0 else {}
    print(f"\nTime to the first token of the answer after a tool's result, ms ({args.conversations} conversations x "
          f"{args.rounds} rounds, {SLOTS} slots, Gemma 3 270M, tools answering in {args.tool_ms:.0f} ms)")  # fmt: skip
    print(f"{'setup':>18} | {'p50':>7} | {'p99':>7} | {'p50 vs (a)':>10} | {'computed tokens p50':>19}")
    base = statistics.median(results["(a) kvpool"])
    for name, values in results.items():
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        p50 = statistics.median(values)
        known = [t for t in computed[name] if t >= 0]
        tokens = f"{statistics.median(known):.0f}" if known else "?"
        print(f"{name:>18} | {p50:>7.0f} | {p99:>7.0f} | {p50 / base:>9.2f}x | {tokens:>19}")
    if floors:
        print(f"\nThe floor: ms to compute N new tokens on a conversation of {HISTORY} tokens each server holds (one "
              f"output, no grammar), medians of {args.floor_repeat}")  # fmt: skip
        names = list(floors)
        print(f"{'N':>4} | " + " | ".join(f"{name:>22}" for name in names))
        for n in sizes:
            print(f"{n:>4} | " + " | ".join(f"{floors[name].get(n, float('nan')):>22.0f}" for name in names))
        if "llama-server wall" in floors and "(c) llama-server" in size_of:
            theirs_n = size_of["(c) llama-server"]
            theirs = floors["llama-server wall"][theirs_n]
            for name in ("(a) kvpool", "(a') no prefill"):
                ours_n = size_of[name]
                loop = statistics.median(results[name]) / statistics.median(results["(c) llama-server"])
                print(f"floor ratio {name}: kvpool computing {ours_n} / llama-server {theirs_n} = "
                      f"{floors['kvpool client'][ours_n] / theirs:.2f}x (the loop measured {loop:.2f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
