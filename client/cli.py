"""`kvpool`: the command line for a running kvpoold (status, sessions, health, top, generate, chat).

Exit codes: 0 ok; 1 the daemon refused the request (its code and message are printed); 2 bad usage;
3 no daemon answered (down, wrong address, or timed out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvpool import protocol as p
from kvpool.protocol.status import (
    MAX_ENGINE_SILENCE_S,
    Counters,
    CpuStatus,
    DaemonStatus,
    DraftStatus,
    PrefixStatus,
    TierSnapshots,
)

from .chat_template import TemplateError
from .client import Client, Session
from .curve import CurveKeyError, curve_from_files
from .errors import DaemonUnavailable, KvpoolError, RequestTimeout

EXIT_REFUSED, EXIT_USAGE, EXIT_UNAVAILABLE = 1, 2, 3
ADDRESS_SCHEMES = ("ipc://", "tcp://")


def _number(kind: type[float] | type[int], least: float, above: bool = False, most: float = math.inf) -> Any:
    """An argparse type: a finite ``kind`` of at least ``least`` (above it, with ``above``) and at most ``most``;
    else a usage error (exit 2) that says so, never a traceback, a refusal after a session was opened for it, or a
    wait that never ends (a NaN timeout)."""

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < least or (above and value == least) or value > most:
            lower = f"{'above' if above else 'at least'} {least}"
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a number {lower}{f' and at most {most}' * (most < math.inf)}"
            )
        return value

    return parse


SECONDS = _number(float, 0.0, above=True)
COUNT = _number(int, 0)
# A generate's own bounds (protocol.Generate's), so that a value out of them is bad usage, not a refusal.
MAX_TOKENS = _number(int, 0, most=1 << 20)
TEMPERATURE = _number(float, 0.0, most=100.0)
TOP_K = _number(int, 0, most=1 << 24)
TOP_P = _number(float, 0.0, above=True, most=1.0)
PROBABILITY = _number(float, 0.0, most=1.0)
SEED = _number(int, 0, most=2**32 - 1)
TOP_LOGPROBS = _number(int, 0, most=20)


def _session_ref(text: str) -> str:
    """ID:TOKEN, a session and its owner's token."""
    session_id, sep, token = text.partition(":")
    if not (session_id and sep and token):
        raise argparse.ArgumentTypeError(f"{text!r}: give the session as ID:TOKEN (its owner's token)")
    return text


def _stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string cannot be empty")
    return text


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvpool", description="Talk to a running kvpoold.")
    ap.add_argument("--address", help="daemon address (default: $KVPOOL_ADDRESS or the daemon's default)")
    ap.add_argument("--timeout", type=SECONDS, default=30.0, help="seconds to wait for each answer")
    ap.add_argument(
        "--curve-server-key",
        default=os.environ.get("KVPOOL_CURVE_SERVER_KEY", ""),
        metavar="FILE",
        help="a tcp:// daemon's public key file (with --curve-client-key)",
    )
    ap.add_argument(
        "--curve-client-key",
        default=os.environ.get("KVPOOL_CURVE_CLIENT_KEY", ""),
        metavar="FILE",
        help="this client's secret key file, listed in the daemon's curve_clients_dir",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="model, slots, sessions and counters")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    sessions = sub.add_parser("sessions", help="list open sessions")
    sessions.add_argument("--json", action="store_true")
    health = sub.add_parser("health", help="exit 0 only when the daemon answers and its engine is stepping")
    health.add_argument("--max-engine-silence", type=SECONDS, default=MAX_ENGINE_SILENCE_S, help="seconds")
    top = sub.add_parser("top", help="a live view of slots, tiers, pool use and per-task latency")
    top.add_argument("--interval", type=SECONDS, default=1.0)
    top.add_argument("--iterations", type=COUNT, default=0, help="stop after N views (0: until Ctrl-C)")
    top.add_argument("--max-sessions", type=COUNT, default=20, help="session rows to show")
    gen = sub.add_parser("generate", help="stream a completion of PROMPT to stdout (in a new session)")
    gen.add_argument("prompt", help="prompt text; '-' reads it from stdin")
    gen.add_argument("--task", default="default")
    gen.add_argument("--max-tokens", type=MAX_TOKENS, default=128)
    gen.add_argument("--temperature", type=TEMPERATURE, default=0.8)
    gen.add_argument("--top-k", type=TOP_K, default=40)
    gen.add_argument("--top-p", type=TOP_P, default=0.95)
    gen.add_argument("--min-p", type=PROBABILITY, default=0.05)
    gen.add_argument("--seed", type=SEED)
    gen.add_argument("--stop", type=_stop_string, action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stats", action="store_true", help="print finish reason, usage and timings to stderr")
    constrained = gen.add_mutually_exclusive_group()
    constrained.add_argument("--json-schema", metavar="SCHEMA", help="the answer follows this JSON Schema (or @FILE)")
    constrained.add_argument("--grammar", metavar="GBNF", help="the answer follows this GBNF grammar (or @FILE)")
    gen.add_argument(
        "--logprobs", type=TOP_LOGPROBS, metavar="N", help="print each token's log-probability and its top N"
    )
    migrate = sub.add_parser(
        "migrate", help="hand a session over to another kvpoold through the remote tier (docs/remote.md)"
    )
    migrate.add_argument("session", type=_session_ref, metavar="ID:TOKEN", help="the session and its owner's token")
    migrate.add_argument("--to", required=True, metavar="ADDRESS", help="the daemon that takes it over")
    chat = sub.add_parser("chat", help="an interactive multi-turn chat on one session, in the model's chat format")
    chat.add_argument("--system", default="", help="a system message to start the conversation with")
    chat.add_argument("--task", default="default")
    chat.add_argument("--resume", type=_session_ref, metavar="ID:TOKEN", help="pick a conversation up again")
    chat.add_argument("--max-tokens", type=MAX_TOKENS, default=256)
    chat.add_argument("--temperature", type=TEMPERATURE, default=0.0)
    chat.add_argument("--stop", type=_stop_string, action="append", default=[], help="stop string (repeatable)")
    chat.add_argument(
        "--chat-template", default="auto", help="auto (the GGUF's own, else a transcript), gemma3, chatml, transcript"
    )
    sub.add_parser(
        "rpc-worker",
        help="lend this machine's CPU and memory to a kvpoold elsewhere (llama.cpp's RPC server; "
        "`kvpool rpc-worker --help`)",
        add_help=False,
    )
    return ap.parse_args(argv)


def run_rpc_worker(args: Sequence[str]) -> int:
    """`kvpool rpc-worker ...` is the daemon's worker program (kvpool-rpc-worker), run in this process's place:
    the client never imports the daemon."""
    os.execv(sys.executable, [sys.executable, "-m", "kvpool.daemon.rpc.worker", *args])
    return 1  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "rpc-worker" in argv[:1]:
        return run_rpc_worker(argv[1:])
    args = parse_args(argv)
    try:
        curve = curve_from_files(args.curve_server_key, args.curve_client_key)
    except CurveKeyError as exc:
        print(f"kvpool: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    if args.address and not args.address.startswith(ADDRESS_SCHEMES):
        print(f"kvpool: --address {args.address!r} is ipc://PATH or tcp://HOST:PORT.", file=sys.stderr)
        return EXIT_USAGE
    try:
        with Client(args.address, timeout=args.timeout, name="kvpool-cli", curve=curve) as client:
            return COMMANDS[args.command](client, args)
    except (DaemonUnavailable, RequestTimeout) as exc:
        print(f"kvpool: {exc.message}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KvpoolError as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except TemplateError as exc:  # (kvpool chat --chat-template NAME it does not know)
        print(f"kvpool: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    status = client.status()
    if args.json:
        print(json.dumps(msgspec.to_builtins(status), indent=2, sort_keys=True))
        return 0
    print(format_status(status))
    return 0


def _compression(tier: TierSnapshots, when: str) -> str:
    """A tier's KV type and what it achieved: "kv q8_0 when full: 3 of 11 snapshots compressed, 1.31x"."""
    if tier.kv_type == "same":
        return "kv at the hot types"
    done = f"{tier.compressed_snapshots} of {tier.snapshots} snapshots compressed, {tier.compression_ratio:.2f}x"
    return f"kv {tier.kv_type}{' when full' if when == 'when_full' else ''}: {done}"


def _drafts(d: DraftStatus, c: Counters) -> str:
    jumped = f"{c.jumped_tokens} forced tokens {'appended' if d.jump_forward == 'append' else 'guessed and taken'}"
    if d.jump_forward == "off":
        jumped = "no jump-forward"
    if not d.most_tokens:
        return f"off (draft_tokens = 0); {jumped}"
    least = f" (at least {d.least_tokens}, paying or not)" if d.least_tokens else ""
    return (
        f"up to {d.most_tokens} a step{least}, matched by up to {d.ngram} tokens: "
        f"{c.accepted_tokens} of {c.drafted_tokens} guessed tokens taken; {jumped}"
    )


def _cpu(cpu: CpuStatus) -> str:
    slowdown = f", steps {cpu.slowdown:.2f}x their time at start" if cpu.slowdown is not None else ""
    if cpu.cores is not None:
        slowdown += f" on {cpu.cores:.1f} cores"
    if not cpu.adaptive:
        return f"{cpu.threads} threads, fixed ({cpu.fixed_because}){slowdown}"
    return (
        f"{cpu.threads} of {cpu.most_threads} threads, following the free cores{slowdown} "
        f"({cpu.probes} probes, {cpu.switches} switches)"
    )


def format_status(status: DaemonStatus) -> str:
    """The status as a person reads it: daemon, tiers and counters, then one latency row per task."""
    out: list[str] = []
    model, slots, kv, sessions, c, pool = (
        status.model,
        status.slots,
        status.kv,
        status.sessions,
        status.counters,
        status.pool,
    )
    rows: list[tuple[str, Any]] = [
        ("daemon", f"kvpoold {status.daemon_version} (pid {status.pid}, up {status.uptime_s:.0f} s)"),
        ("model", f"{model.description} ({model.path}), cpu_repack {'on' if model.cpu_repack else 'off'}"),
        (
            "hot kv",
            f"K {model.kv_type_k}, V {model.kv_type_v}, flash attention {'on' if model.flash_attn else 'off'}",
        ),
        ("slots", f"{slots.used}/{slots.total} used"),
        ("kv cells", f"{kv.cells_used}/{kv.cells_total} used"),
        (
            "pool",
            f"{_bytes(pool.used_bytes)} used, {_bytes(pool.free_bytes)} free, largest free extent "
            f"{_bytes(pool.largest_free_extent_bytes)} ({pool.name}); {_compression(pool, pool.kv_policy)}",
        ),
        (
            "spill",
            f"{_bytes(status.spill.used_bytes)} of {_bytes(status.spill.max_bytes)}; "
            f"{_compression(status.spill, 'always')}",
        ),
        ("tiers", _counts(status.sessions_by_tier)),
        ("prefixes", _prefixes(status.prefixes)),
        ("sessions", f"{sessions.open} open (max {sessions.max}), {sessions.generating} generating"),
        ("tokens", f"{c.generated_tokens} generated, {c.prompt_tokens} prompt, {c.decode_calls} decodes"),
        ("requests", _counts(c.requests)),
        ("errors", _counts(dict(Counter(c.errors) + Counter(c.frame_errors)))),
    ]
    if status.remote is not None:
        r = status.remote
        rows.append(
            (
                "remote",
                f"{r.url} as {r.node!r}: {'connected' if r.connected else 'UNREACHABLE'}, {r.writes} writes "
                f"({_bytes(r.write_bytes)}), {r.pending} pending, {r.dropped} dropped, {r.write_failures} failed, "
                f"{r.fetches} fetched, {r.conflicts} conflicts, {r.corrupt} corrupt, {r.leases_held} leases",
            )
        )
    if status.preload is not None:
        pre = status.preload
        rows.append(("preload", f"{pre.mode}: {pre.preloads} preloads, {pre.hits} hits, {pre.wasted} wasted"))
    m = status.media
    if m is None:
        rows.append(("media", "none: text only (no projector, mmproj)"))
    else:
        served = " and ".join(
            kind for kind, on in (("images", m.vision), (f"audio at {m.audio_sample_rate} Hz", m.audio)) if on
        )
        rows.append(
            (
                "media",
                f"{served} ({m.projector}): {m.prepared} read, {m.encodes} encoded ({m.encode_ms_total:.0f} ms), "
                f"{m.cache_hits} found by content, {m.cached} cached ({_bytes(m.cached_bytes)})",
            )
        )
    if status.cpu is not None:
        rows.append(("cpu", _cpu(status.cpu)))
    if status.drafts is not None:
        rows.append(("guesses", _drafts(status.drafts, status.counters)))
    for name, value in rows:
        out.append(f"{name:>9}  {value}")
    scheduler = status.scheduler
    cap = scheduler.step_cap_ms
    out.append(f"{'schedule':>9}  {scheduler.policy}, step cap {f'{cap:.0f} ms' if cap else 'none'}")
    out.append(
        f"\n{'task':<10} {'ttft p50/p95/p99 ms':>21} {'tpot p50 ms':>11} {'missed':>6} {'late tok':>8} "
        f"{'preempt':>7} {'queue':>5}  refusals"
    )
    for task, t in status.tasks.items():
        ttft, tpot = t.ttft_ms, t.tpot_ms
        pct = f"{ttft.p50:.0f}/{ttft.p95:.0f}/{ttft.p99:.0f}" if ttft.count else "-"
        per_token = f"{tpot.p50:.0f}" if tpot.count else "-"
        out.append(
            f"{task:<10} {pct:>21} {per_token:>11} {t.deadline_misses:>6} {t.late_tokens:>8} "
            f"{t.preemptions:>7} {t.queue_depth:>5}  {_counts(t.refusals)}"
        )
    return "\n".join(out)


def _prefixes(info: PrefixStatus) -> str:
    if not info.enabled:
        return "sharing off"
    return (
        f"{info.count} shared ({info.hot} hot, {info.users} sessions on them), {info.hits} hits, "
        f"{info.tokens_saved} prompt tokens not computed, {_bytes(info.pool_bytes_saved)} of snapshots saved"
    )


def cmd_health(client: Client, args: argparse.Namespace) -> int:
    """Exit 0 only when the daemon answers and its engine loop is stepping."""
    status = client.status()
    idle = status.engine_idle_s
    healthy = status.stepping(args.max_engine_silence)
    print(
        f"kvpoold pid {status.pid}: {'healthy' if healthy else 'UNHEALTHY'} (engine loop last passed "
        f"{idle:.1f} s ago, {status.sessions.open} sessions, {status.sessions.generating} generating)"
    )
    for w in status.rpc_workers:
        # A lost worker ends the daemon (docs/rpc.md), so a listed worker is one that answered its last check.
        print(
            f"rpc worker {w.endpoint}: {w.state} ({w.device}, {w.layers} layers{' + output' if w.output else ''}, "
            f"{_bytes(w.memory_free_bytes)} free), answered {w.checked_s_ago:.1f} s ago"
        )
    return 0 if healthy else EXIT_REFUSED


def cmd_top(client: Client, args: argparse.Namespace) -> int:
    """A live view: the status redrawn in place every --interval seconds (Ctrl-C to leave)."""
    shown = 0
    while args.iterations == 0 or shown < args.iterations:
        if shown:
            time.sleep(args.interval)
        view = format_status(client.status())
        sessions = client.sessions()
        lines = [
            f"kvpool top - {time.strftime('%H:%M:%S')} - {client.address}",
            "",
            view,
            "",
            f"{'session':<18} {'task':<10} {'tier':<5} {'tokens':>7} {'busy':<5} {'idle s':>8}",
        ]
        lines += [
            f"{x.session:<18} {x.task:<10} {x.tier:<5} {x.context_tokens:>7} {'yes' if x.busy else 'no':<5} "
            f"{x.idle_s:>8.1f}"
            for x in sessions[: args.max_sessions]
        ]
        clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
        sys.stdout.write(clear + "\n".join(lines) + "\n")
        sys.stdout.flush()
        shown += 1
    return 0


def cmd_sessions(client: Client, args: argparse.Namespace) -> int:
    sessions = client.sessions()
    if args.json:
        print(json.dumps([{f: getattr(s, f) for f in s.__struct_fields__} for s in sessions], indent=2))
        return 0
    print(
        f"{'session':<18} {'task':<10} {'tier':<5} {'tokens':>7} {'shared':>7} {'snapshot':>9} {'kv type':<10} "
        f"{'saved':<5} {'busy':<5} {'idle s':>8} {'age s':>8}  newest copy"
    )
    for s in sessions:
        print(
            f"{s.session:<18} {s.task:<10} {s.tier:<5} {s.context_tokens:>7} {s.shared_tokens:>7} "
            f"{_bytes(s.snapshot_bytes):>9} {s.kv_type or '-':<10} {'yes' if s.saved else 'no':<5} "
            f"{'yes' if s.busy else 'no':<5} {s.idle_s:>8.1f} {s.age_s:>8.1f}  {newest_copy(s)}"
        )
    return 0


def newest_copy(s: p.SessionInfo) -> str:
    """Where the session's newest state lives: this node's tier, and whether the remote tier holds it too."""
    here = {"hot": "here (hot, checkpointed)" if s.saved else "here (hot only)", "new": "here (new)"}.get(
        s.tier, f"here ({s.tier})"
    )
    remote = {
        "current": " + remote",
        "behind": " (remote copy behind)",
        "lost": ": stale, another node owns it",
    }.get(s.remote, "")
    return here + remote


def cmd_migrate(client: Client, args: argparse.Namespace) -> int:
    session_id, _, token = args.session.partition(":")
    moved = Session(client, session_id, token, "", 0).migrate(
        args.to, timeout=args.timeout, curve=curve_from_files(args.curve_server_key, args.curve_client_key)
    )
    try:
        print(f"session {session_id} now lives at {args.to} ({len(moved.history())} tokens)")
    finally:
        moved.client.close()
    return 0


def argument_text(value: str) -> str:
    """A flag's text, or the contents of the file it names as @FILE."""
    return Path(value[1:]).read_text(encoding="utf-8") if value.startswith("@") else value


def cmd_generate(client: Client, args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop,
        "logprobs": args.logprobs,
    }
    try:
        if args.json_schema:
            params["json_schema"] = argument_text(args.json_schema)
        if args.grammar:
            params["grammar"] = argument_text(args.grammar)
    except OSError as exc:
        print(f"kvpool: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    with client.open_session(task=args.task) as session:
        stream = session.generate(prompt, **params)
        logprobs: list[p.TokenLogprob] = []
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            logprobs += chunk.logprobs or []
        sys.stdout.write("\n")
        for entry in logprobs:
            top = " ".join(f"{client.detokenize([t.token])!r}:{t.logprob:.3f}" for t in entry.top)
            print(f"{client.detokenize([entry.token])!r} {entry.logprob:.4f}  {top}", file=sys.stderr)
        final = stream.final
        if args.stats and final is not None:
            t, u = final.timings, final.usage
            print(
                f"finish={final.finish_reason} prompt={u.prompt_tokens} completion={u.completion_tokens} "
                f"ttft={t.ttft_ms:.1f}ms decode={t.decode_tokens_per_s:.1f}tok/s",
                file=sys.stderr,
            )
    return 0


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def cmd_chat(client: Client, args: argparse.Namespace) -> int:
    try:
        from .chat import run
    except ImportError as exc:
        print(f"kvpool: {exc.name} is missing: pip install 'kvpool[chat]'.", file=sys.stderr)
        return 2
    return run(client, args)


COMMANDS = {
    "status": cmd_status,
    "sessions": cmd_sessions,
    "generate": cmd_generate,
    "health": cmd_health,
    "top": cmd_top,
    "chat": cmd_chat,
    "migrate": cmd_migrate,
}

if __name__ == "__main__":
    sys.exit(main())
