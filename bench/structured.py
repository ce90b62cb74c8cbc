"""Constrained decoding: what a grammar costs in decode speed, and what it buys in valid answers.

(1) Decode tokens/s of answers constrained by a JSON Schema, and by a tool-call envelope (the gateway's format,
    docs/gateway.md), against free text, at 1 and 4 concurrent streams through one daemon, alternating within each
    round (target: constrained >= 0.85x free). Streams read per-token rates from the daemon's own timings
    (tokens after the first / decode time), so answers that end at different lengths compare fairly.
(2) Schema-valid answers over 100 varied requests at temperature 0.8 (5 schemas x 20 seeds): constrained, and the
    same requests unconstrained (the prompt shows the schema; the first {...} or [...] in the answer is taken),
    i.e. how often the model alone gets it right (target: constrained 100 %).

    python bench/structured.py [--model PATH] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import default_model, private_daemon  # noqa: E402

from kvpool.client import Client  # noqa: E402

TOKENS = 64
MAX_ANSWER_TOKENS = 160
THREADS = 2
LONG_RECORD = {  # long enough that no answer ends before TOKENS
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 8, "maxItems": 8},
        "summary": {"type": "string"},
    },
    "required": ["items", "summary"],
}
TOOLS = {  # the gateway's tool-call envelope for three device functions
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "tool_calls": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "anyOf": [
                            {
                                "type": "object",
                                "properties": {
                                    "name": {"const": "set_lights"},
                                    "arguments": {
                                        "type": "object",
                                        "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}},
                                        "required": ["room", "on"],
                                    },
                                },
                                "required": ["name", "arguments"],
                            },
                            {
                                "type": "object",
                                "properties": {
                                    "name": {"const": "set_volume"},
                                    "arguments": {
                                        "type": "object",
                                        "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 100}},
                                        "required": ["level"],
                                    },
                                },
                                "required": ["name", "arguments"],
                            },
                            {
                                "type": "object",
                                "properties": {
                                    "name": {"const": "note"},
                                    "arguments": {
                                        "type": "object",
                                        "properties": {"text": {"type": "string"}},
                                        "required": ["text"],
                                    },
                                },
                                "required": ["name", "arguments"],
                            },
                        ]
                    },
                }
            },
            "required": ["tool_calls"],
        },
        {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]},
    ]
}
SPEED_PROMPT = "List eight things you find in a kitchen, then summarise them, as JSON:"
TOOL_PROMPT = "Functions: set_lights(room, on), set_volume(level), note(text). Call them to: turn on the kitchen "
TOOL_PROMPT += "lights, set the volume to 40 and note that the milk is finished. Answer as JSON:"
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
     "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
     "population": {"type": "integer", "minimum": 0}}, "required": ["city", "country", "population"]},
    {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
     "required": ["colour", "bright"]},
    {"type": "object", "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}}, "required": ["room",
     "on"]},
]  # fmt: skip
ASKS = [
    "Describe a person as JSON matching this schema",
    "Give a city as JSON matching this schema",
    "Name three fruits as JSON matching this schema",
    "Pick a colour as JSON matching this schema",
    "Turn on the kitchen lights; answer as JSON matching this schema",
]


def speeds(address: str, streams: int, kind: str) -> float:
    """The median per-token decode rate (tokens/s) of ``streams`` answers generated at once."""
    rates: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        params: dict[str, object] = {"max_tokens": TOKENS, "temperature": 0.0}
        prompt = SPEED_PROMPT
        if kind == "schema":
            params["json_schema"] = LONG_RECORD
        elif kind == "tool call":
            params["json_schema"], prompt = TOOLS, TOOL_PROMPT
        with Client(address, timeout=600) as client, client.open_session() as s:
            answer = s.complete(f"{prompt} ({i})", **params)
        with lock:
            rates.append(answer.timings.decode_tokens_per_s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(rates) * streams  # the aggregate rate of the streams decoding together


def first_json(text: str) -> object:
    """The first JSON value in ``text`` that parses (what a client would try with a model that is not constrained)."""
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch in "[{":
            try:
                return decoder.raw_decode(text[i:])[0]
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON in the answer")


@dataclass
class Validity:
    valid: int = 0
    cut: int = 0  # ended by max_tokens before the answer was whole (not valid)
    total: int = 0
    failures: list[str] = field(default_factory=list)


def valid_rate(address: str, constrained: bool) -> Validity:
    counts = Validity()
    with Client(address, timeout=600) as client:
        for schema, ask in zip(SCHEMAS, ASKS, strict=True):
            for seed in range(20):
                prompt = f"{ask}: {json.dumps(schema)}\n"
                params = {"max_tokens": MAX_ANSWER_TOKENS, "temperature": 0.8, "seed": seed}
                if constrained:
                    params["json_schema"] = schema
                with client.open_session() as s:
                    done = s.complete(prompt, **params)
                counts.total += 1
                try:
                    jsonschema.validate(json.loads(done.text) if constrained else first_json(done.text), schema)
                    counts.valid += 1
                except (ValueError, jsonschema.ValidationError):
                    counts.cut += done.finish_reason == "length"
                    counts.failures.append(f"{done.finish_reason}: {done.text[:100]!r}")
    return counts


def speed_table(address: str, repeat: int) -> None:
    kinds = ["free", "schema", "tool call"]
    print(f"(1) decode tokens/s at 1 and 4 streams, {TOKENS} greedy tokens, median of {repeat} alternating")
    head = ["streams", "free", "schema", "tool call", "schema/free", "tool/free"]
    print(" | ".join(f"{h:>{max(6, len(h))}}" for h in head))
    for streams in (1, 4):
        runs: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(repeat):
            for kind in kinds:
                runs[kind].append(speeds(address, streams, kind))
        free, schema, tool = (statistics.median(runs[k]) for k in kinds)
        print(
            f"{streams:>7} | {free:>6.1f} | {schema:>6.1f} | {tool:>9.1f} | {schema / free:>10.2f}x | "
            f"{tool / free:>8.2f}x",
            flush=True,
        )


def validity_table(address: str) -> None:
    print(
        f"\n(2) schema-valid answers, 100 requests (5 schemas x 20 seeds) at temperature 0.8, at most "
        f"{MAX_ANSWER_TOKENS} tokens"
    )
    for constrained in (True, False):
        c = valid_rate(address, constrained)
        name = "constrained" if constrained else "unconstrained"
        whole = c.total - c.cut
        print(
            f"{name:>13}: {c.valid}/{c.total} valid ({c.valid / c.total:.0%}); {c.cut} cut by max_tokens; "
            f"of the answers that ended by themselves {c.valid}/{whole} valid ({c.valid / max(1, whole):.0%})",
            flush=True,
        )
        if constrained:
            for failure in c.failures:
                print(f"    {failure}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--parts", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    args = ap.parse_args()
    model = default_model(args.model)
    with private_daemon(model, "--hot-slots", "4", "--threads", str(THREADS)) as daemon:
        if 1 in args.parts:
            speed_table(daemon.address, args.repeat)
        if 2 in args.parts:
            validity_table(daemon.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
