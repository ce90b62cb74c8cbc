"""Images in sessions, measured side by side in one run on the default model (Gemma 3 270M, 2 threads) with a
projector of Gemma 3's kind built here with random weights (nothing is downloaded; tests/tiny_mmproj.py), sized
like a small device's vision encoder: a SigLIP-base-shaped ViT (12 layers of 768), 224x224 input, 16x16 patches,
pooled to 49 image tokens (--projector tiny: the test suite's, for a quick run).

  voice      a voice turn every 1-2 s (task "voice", 300 ms first-token budget) while the vision task sends a
             640x480 frame every second through shared memory, its encodes beside the steps (the default) and
             inline, against the text vision load of bench/latency.py (~1,100-token scene descriptions back to
             back): voice TTFT p50/p99, and the frame's encode time
  next turn  an image conversation's next turn when it comes back from the pool, against the same turn on a daemon
             that must encode the image and prefill the conversation again (media cache off, session gone)
  twice      a frame seen twice: the second time is a cache hit (its time to first token, the daemon's counters)
  llama      the same image conversation on llama-server (--mmproj, the same projector), one slot shared with a
             second conversation so that each turn finds its slot taken: its next-turn time against kvpool's
  memory     the daemon's PSS on configs/edge-2gb.toml with the projector and a full (16 MiB) embeddings cache,
             against its memory plan

    python bench/vision.py [--seconds 40] [--projector small|tiny] [--llama-server PATH] [--skip voice llama ...]

Raw numbers go to bench/out/vision.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from anchors import llama_server, llama_server_binary  # noqa: E402
from common import default_model, private_daemon  # noqa: E402
from latency import VOICE_BUDGET_MS, role_vision, role_voice  # noqa: E402

from kvpool.client import Client, Image  # noqa: E402
from tests.test_media import png  # noqa: E402
from tests.tiny_mmproj import build_tiny_mmproj  # noqa: E402

CONFIG = ROOT / "configs" / "default.toml"
EDGE = ROOT / "configs" / "edge-2gb.toml"
GEMMA_WIDTH = 640  # Gemma 3 270M's embedding width: the projector's output
PROJECTORS = {
    "small": {"width": 768, "ff": 3072, "heads": 12, "n_layer": 12, "image_size": 224, "patch_size": 16, "merge": 2},
    "tiny": {},
}
GREEDY = {"temperature": 0.0}
CONVERSATION = (
    "You watch the kitchen camera of a home robot. Answer in one sentence, name the objects you see, say where "
    "they are on the table and whether anything moved since the last frame; if a person or a pet is in view, say "
    "so first. Never guess what you cannot see; say that the view is unclear instead. "
)
# The conversation before the measured turn: the picture, then two exchanges about it (~250 tokens in all).
EARLIER = [
    " What is on the table?",
    " Is the cat still on the chair, and did the robot's cup move?",
]


def frame(i: int, height: int = 480, width: int = 640) -> np.ndarray:
    """A 640x480 camera frame that changes every time (a moving square on a gradient)."""
    out = np.zeros((height, width, 3), dtype=np.uint8)
    out[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    out[..., 1] = (i * 37) % 256
    x, y = (53 * i) % (width - 80), (31 * i) % (height - 80)
    out[y : y + 80, x : x + 80] = 250
    return out


def role_frames(address: str, seconds: float) -> None:
    """The vision task with a camera: a frame a second, each in a fresh session (task "vision")."""
    done = 0
    started = time.monotonic()
    end = started + seconds
    with Client(address, timeout=600) as client:
        while time.monotonic() < end:
            sent = time.monotonic()
            with client.open_session("vision") as session:
                session.complete(["Frame: ", Image(frame(done)), "\nCaption:"], max_tokens=16, **GREEDY)
            done += 1
            time.sleep(max(0.0, sent + 1.0 - time.monotonic()))
        media = client.status().media
    print(json.dumps({"frames": done, "encode_ms": media.encode_ms_total / max(1, media.encodes) if media else 0}))


def voice_under(model: str, projector: Path, load: str, seconds: float, *args: str) -> dict[str, object]:
    setup = ("--config", str(CONFIG), "--threads", "2", "--mmproj", str(projector), *args)
    with private_daemon(model, *setup) as daemon:
        me = [sys.executable, str(Path(__file__))]
        vision = subprocess.Popen(
            [*me, "--role", load, daemon.address, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        time.sleep(2.0)  # let the vision load get going before the first voice turn (pacing, not syncing)
        voice = subprocess.Popen(
            [*me, "--role", "voice", daemon.address, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        voice_out, _ = voice.communicate(timeout=seconds * 4 + 600)
        vision_out, _ = vision.communicate(timeout=seconds * 4 + 600)
    turns = json.loads(voice_out.strip().splitlines()[-1])
    ttfts = [t["ttft_ms"] for t in turns if t["ttft_ms"] is not None]
    return {
        "ttft_ms": ttfts,
        "turns": len(turns),
        "refused": sum(1 for t in turns if t["refused"]),
        "late": sum(1 for v in ttfts if v > VOICE_BUDGET_MS),
        "vision": json.loads(vision_out.strip().splitlines()[-1]),
    }


def next_turn(model: str, projector: Path, rounds: int) -> dict[str, list[float]]:
    """The next turn's time to first token: restored from the pool, against encoding and prefilling it all again."""
    picture = frame(7)
    follow = " And now?"
    pooled, redone, context = [], [], 0
    slot = ("--threads", "2", "--mmproj", str(projector), "--hot-slots", "1")
    with private_daemon(model, *slot) as daemon, Client(daemon.address, timeout=300) as client:
        for _ in range(rounds):
            with client.open_session() as s, client.open_session() as other:
                answers = [s.complete([CONVERSATION, Image(picture), EARLIER[0]], max_tokens=24, **GREEDY).text]
                answers += [s.complete(turn, max_tokens=24, **GREEDY).text for turn in EARLIER[1:]]
                other.complete("Something else.", max_tokens=4, **GREEDY)  # takes the slot: s goes to the pool
                done = s.complete(follow, max_tokens=8, **GREEDY)
                pooled.append(done.ttft_ms)
                context = done.usage.context_tokens
    # The same turn where nothing was kept: the image encoded and the whole conversation prefilled again.
    history = "".join(f"{turn}{answer}" for turn, answer in zip(EARLIER, answers, strict=True))
    nothing_kept = ("--threads", "2", "--mmproj", str(projector), "--media-cache-size", "0")
    with private_daemon(model, *nothing_kept) as daemon, Client(daemon.address, timeout=300) as client:
        for _ in range(rounds):
            with client.open_session() as s:
                whole = [CONVERSATION, Image(picture), f"{history}{follow}"]
                redone.append(s.complete(whole, max_tokens=8, **GREEDY).ttft_ms)
        encodes = client.status().media.encodes  # type: ignore[union-attr]
    return {"pool_ms": pooled, "again_ms": redone, "context_tokens": context, "encodes_again": encodes}


def seen_twice(model: str, projector: Path) -> dict[str, float]:
    with private_daemon(model, "--threads", "2", "--mmproj", str(projector)) as daemon, Client(daemon.address) as c:
        times = []
        for _ in range(2):
            with c.open_session() as s:
                times.append(s.complete(["Frame: ", Image(frame(3)), " Caption:"], max_tokens=4, **GREEDY).ttft_ms)
        media = c.status().media
        assert media is not None
        return {"first_ms": times[0], "second_ms": times[1], "encodes": media.encodes, "hits": media.cache_hits}


def on_llama_server(binary: str, model: str, projector: Path, rounds: int) -> dict[str, list[float]]:
    """The image conversation on llama-server with one slot that a second conversation takes between its turns."""
    picture = "data:image/png;base64," + base64.b64encode(png(224, 224)).decode()
    follow_up = "And now?"
    other = [{"role": "user", "content": "Something else."}]
    turns: list[float] = []
    computed: list[int] = []
    with llama_server(binary, model, 1, 4096, "--mmproj", str(projector)) as url:

        def ask(messages: list[dict], max_tokens: int = 24) -> dict:
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()

        def first_token(messages: list[dict]) -> tuple[float, int]:
            """Milliseconds to the first streamed text, and the prompt tokens it computed (its timings)."""
            body = {
                "messages": messages,
                "max_tokens": 8,
                "temperature": 0.0,
                "stream": True,
                "timings_per_token": True,
            }
            started, first, computed = time.perf_counter(), None, -1
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as answer:
                for line in answer.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                        first = time.perf_counter()
                    computed = chunk.get("timings", {}).get("prompt_n", computed)
            return ((first or time.perf_counter()) - started) * 1000.0, computed

        for _ in range(rounds):
            history: list[dict] = [{"role": "system", "content": CONVERSATION}]
            for i, turn in enumerate(EARLIER):
                content: str | list = turn.strip()
                if i == 0:
                    content = [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": content}]
                history.append({"role": "user", "content": content})
                history.append(ask(history)["choices"][0]["message"])
            ask(other, 4)  # takes the only slot
            history.append({"role": "user", "content": follow_up})
            ms, n = first_token(history)
            turns.append(ms)
            computed.append(n)
    return {"turn_ms": turns, "prompt_computed": computed}


def memory(model: str, projector: Path) -> dict[str, float]:
    """PSS on the 2 GB device's settings (configs/edge-2gb.toml) once a 16 MiB media cache is full of distinct
    frames' embeddings."""
    edge = ("--config", str(EDGE), "--mmproj", str(projector), "--media-cache-size", "16MiB")
    with private_daemon(model, *edge) as daemon:
        with Client(daemon.address, timeout=300) as c:
            for i in range(400):
                with c.open_session() as s:
                    s.complete([Image(frame(1000 + i))], max_tokens=1, **GREEDY)
                media = c.status().media
                assert media is not None
                if media.cached_bytes * 1.1 >= media.cache_max_bytes:
                    break
            pss = psutil.Process(daemon.proc.pid).memory_full_info().pss
        plan = subprocess.run(
            [sys.executable, "-m", "kvpool.daemon.main", "--model", model, *edge, "--check-config"],
            capture_output=True, text=True,
        ).stderr  # fmt: skip
    total = next((line for line in plan.splitlines() if "total" in line), "")
    return {"pss_mib": pss / 2**20, "cached_mib": media.cached_bytes / 2**20, "frames": i + 1, "plan": total.strip()}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--projector", choices=list(PROJECTORS), default="small")
    ap.add_argument("--llama-server", help="llama-server binary (default: one scripts/build-llama-server.sh built)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["voice", "next", "twice", "llama", "memory"])
    args = ap.parse_args()
    if args.role:
        roles = {"voice": role_voice, "vision": role_vision, "frames": role_frames}
        roles[args.role](args.args[0], float(args.args[1]))
        return 0
    model = default_model(args.model)
    projector = Path(tempfile.mkdtemp(prefix="kvpool-mmproj-")) / f"gemma3-{args.projector}.gguf"
    shape = build_tiny_mmproj(projector, "gemma3", GEMMA_WIDTH, vision=PROJECTORS[args.projector])
    print(
        f"projector: {projector.name}, {projector.stat().st_size / 2**20:.0f} MiB, {shape['image_tokens']} image tokens"
    )
    results: dict[str, object] = {"projector": args.projector, "image_tokens": shape["image_tokens"]}
    if "voice" not in args.skip:
        results["voice_text"] = voice_under(model, projector, "vision", args.seconds)
        results["voice_frames"] = voice_under(model, projector, "frames", args.seconds)
        results["voice_frames_inline"] = voice_under(
            model, projector, "frames", args.seconds, "--media-encode", "inline"
        )
    if "next" not in args.skip:
        results["next_turn"] = next_turn(model, projector, args.rounds)
    if "twice" not in args.skip:
        results["twice"] = seen_twice(model, projector)
    binary = llama_server_binary(args.llama_server)
    if "llama" not in args.skip:
        results["llama"] = on_llama_server(binary, model, projector, args.rounds) if binary else None
    if "memory" not in args.skip:
        results["memory"] = memory(model, projector)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "vision.json").write_text(json.dumps(results, indent=2))

    if "voice_text" in results:
        print(f"\nVoice TTFT under a vision load, {args.seconds:.0f} s each (budget {VOICE_BUDGET_MS:.0f} ms)")
        print(f"{'vision load':>28} | {'turns':>5} | {'p50 ms':>6} | {'p99 ms':>6} | {'late':>4} | {'refused':>7}")
        for name, key in (
            ("~1,100-token text prompts", "voice_text"),
            ("a 640x480 frame a second", "voice_frames"),
            ("the same, encoded inline", "voice_frames_inline"),
        ):
            r = results[key]
            assert isinstance(r, dict)
            print(f"{name:>28} | {r['turns']:>5} | {pct(r['ttft_ms'], 50):>6.0f} | {pct(r['ttft_ms'], 99):>6.0f} | "
                  f"{r['late']:>4} | {r['refused']:>7}")  # fmt: skip
        for key in ("voice_frames", "voice_frames_inline"):
            frames = results[key]["vision"]  # type: ignore[index]
            print(f"{key}: frames sent {frames['frames']}, one encode {frames['encode_ms']:.0f} ms")
    if "next_turn" in results:
        r = results["next_turn"]
        assert isinstance(r, dict)
        pool, again = statistics.median(r["pool_ms"]), statistics.median(r["again_ms"])
        print(f"\nnext turn of an image conversation ({r['context_tokens']} tokens): from the pool {pool:.1f} ms, "
              f"encoded ({r['encodes_again']} encodes) and prefilled again {again:.1f} ms: {again / pool:.1f}x "
              f"(medians of {args.rounds}, time to first token)")  # fmt: skip
    if "twice" in results:
        r = results["twice"]
        assert isinstance(r, dict)
        print(f"\na frame seen twice: first {r['first_ms']:.1f} ms, second {r['second_ms']:.1f} ms to first token; "
              f"{r['encodes']} encode, {r['hits']} cache hit")  # fmt: skip
    if "llama" in results:
        r = results["llama"]
        if r is None:
            print("\nllama-server: not found (scripts/build-llama-server.sh builds it, ~10 minutes); skipped")
        else:
            assert isinstance(r, dict)
            pooled = results.get("next_turn")
            ours = statistics.median(pooled["pool_ms"]) if isinstance(pooled, dict) else float("nan")
            theirs = statistics.median(r["turn_ms"])
            print(f"\nllama-server, its slot taken between turns: next turn {theirs:.0f} ms to first token (prompt "
                  f"tokens computed: {r['prompt_computed']}); kvpool from the pool {ours:.1f} ms: "
                  f"{theirs / ours:.1f}x")  # fmt: skip
    if "memory" in results:
        r = results["memory"]
        assert isinstance(r, dict)
        print(f"\nmemory: PSS {r['pss_mib']:.0f} MiB with {r['cached_mib']:.0f} MiB of embeddings cached "
              f"({r['frames']} frames); the plan: {r['plan']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
