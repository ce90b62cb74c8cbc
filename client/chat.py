"""`kvpool chat`: an interactive multi-turn chat on one session, in the model's chat format, tokens streamed as
they come (chat_session.py). The terminal twin of the gateway: the same templates and the same rule for what
each turn computes.

Commands at the prompt: /reset (a new conversation), /stats (the last turn's time to first token, tokens per
second and cached tokens), /quit (or end of input). ``--resume ID:TOKEN`` picks a conversation up again, after
a daemon restart too.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from .chat_session import ChatSession, Reply, default_save_dir
from .client import Client
from .errors import DaemonUnavailable, KvpoolError, RequestTimeout, ShuttingDown


def stats(reply: Reply | None) -> str:
    if reply is None:
        return "no turn yet"
    rate = reply.final.timings.decode_tokens_per_s if reply.final is not None else 0.0
    return (
        f"time to first token {reply.ttft_ms:.0f} ms, {rate:.1f} tokens/s, "
        f"{reply.cached_tokens} of {reply.prompt_tokens} prompt tokens cached"
    )


def run(client: Client, args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    chat = ChatSession(
        client,
        task=args.task,
        system=args.system,
        chat_template=args.chat_template,
        stop=args.stop,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        resume=args.resume,
        save_dir=default_save_dir(),
    )

    def show(text: str) -> None:
        out.write(text)
        out.flush()

    last: Reply | None = None
    out.write(f"kvpool chat: session {chat.ids} (/reset, /stats, /quit)\n")
    try:
        while True:
            out.write("> ")
            out.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.strip()
            if text in ("/quit", "/exit"):
                break
            if text == "/reset":
                chat.reset()
                out.write(f"new conversation: session {chat.ids}\n")
            elif text == "/stats":
                out.write(stats(last) + "\n")
            elif text:
                try:
                    last = chat.say(text, on_text=show)
                except KvpoolError as exc:
                    if exc.cut or isinstance(exc, DaemonUnavailable | RequestTimeout | ShuttingDown):
                        raise  # (the answer was cut, or no daemon is there to say the next turn to)
                    out.write(f"refused: {exc}; the conversation is as it was, say it otherwise\n")
                    continue
                out.write("\n")
    finally:  # (also when the chat ends on an error: the conversation is kept, and this picks it up again)
        out.write(f"\nresume with: kvpool chat --resume {chat.ids}\n")
    return 0
