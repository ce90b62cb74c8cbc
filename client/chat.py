"""`kvpool chat`: an interactive multi-turn chat on one session, in the model's chat format, tokens streamed as
they come. The terminal twin of the gateway: the same templates (chat_template.py) and the same rule for what
each turn computes (conversation.py): only the new part of the conversation.

Commands at the prompt: /reset (a new conversation), /stats (the last turn's time to first token, tokens per
second and cached tokens), /quit (or end of input). The conversation is saved after every turn under the
session's id, so ``--resume ID:TOKEN`` picks it up again, after a daemon restart too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from .chat_template import ChatTemplate, template_for  # needs jinja2: pip install 'kvpool[chat]'
from .client import Client, Session
from .conversation import Held, after_answer


def saved_dir() -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "kvpool" / "chat"


@dataclass
class Conversation:
    session: str
    token: str
    messages: list[dict[str, str]] = field(default_factory=list)
    held: Held | None = None
    empty: bool = False  # the session holds nothing yet (a new conversation)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        record = {"session": self.session, "token": self.token, "messages": self.messages}
        record["held"] = asdict(self.held) if self.held else None
        path = directory / f"{self.session}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(record), encoding="utf-8")
        os.replace(partial, path)

    @classmethod
    def load(cls, directory: Path, session: str, token: str) -> Conversation:
        path = directory / f"{session}.json"
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return cls(session, token)  # the session's context is kept; the transcript of it is not
        held = Held(**record["held"]) if record.get("held") else None
        return cls(session, token, list(record.get("messages", [])), held)


@dataclass
class TurnStats:
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0
    cached_tokens: int = 0
    prompt_tokens: int = 0


class Chat:
    def __init__(self, client: Client, args: argparse.Namespace, out: TextIO):
        self.client, self.args, self.out = client, args, out
        model = client.status().model
        source, stops = template_for(args.chat_template, model.chat_template)
        self.template = ChatTemplate(source, model.bos_token, model.eos_token, tuple(stops))
        self.stops = [*args.stop, *(s for s in self.template.stops if s not in args.stop)]
        self.add_bos = bool(model.bos_token)
        self.directory = saved_dir()
        self.last = TurnStats()
        self.conversation = self._start(args.resume)

    def _start(self, resume: str | None) -> Conversation:
        if resume:
            session_id, _, token = resume.partition(":")
            session = self.client.resume_session(session_id, token)
            return Conversation.load(self.directory, session.id, session.token)
        session = self.client.open_session(self.args.task, system_prompt="")
        messages = [{"role": "system", "content": self.args.system}] if self.args.system else []
        return Conversation(session.id, session.token, messages, empty=True)

    def session(self) -> Session:
        return self.client.resume_session(self.conversation.session, self.conversation.token)

    def reset(self) -> None:
        self.session().close()
        self.conversation = self._start(None)

    def turn(self, text: str) -> None:
        c = self.conversation
        c.messages.append({"role": "user", "content": text})
        rendered = self.template.render(c.messages, add_generation_prompt=True)
        session = self.session()
        rest = c.held.rest(rendered) if c.held is not None else None
        if c.held is not None and rest is not None:
            tokens, held = c.held.trim(self.client.tokenize(rest, add_bos=False)), c.held.tokens
        else:
            if not c.empty:  # what the session holds is not this conversation: start it over in a new one
                session.close()
                session = self.client.open_session(self.args.task, system_prompt="")
                c.session, c.token = session.id, session.token
            add_bos = self.add_bos and not (self.template.bos_token and rendered.startswith(self.template.bos_token))
            tokens, held = self.client.tokenize(rendered, add_bos=add_bos), 0
        started = time.monotonic()
        first: float | None = None
        answer, generated = [], []
        stream = session.generate(
            tokens, after=held, max_tokens=self.args.max_tokens, temperature=self.args.temperature, stop=self.stops
        )
        for chunk in stream:
            generated.extend(chunk.tokens)
            if chunk.text:
                first = first or time.monotonic()
                answer.append(chunk.text)
                self.out.write(chunk.text)
                self.out.flush()
        self.out.write("\n")
        final = stream.final
        c.empty = False
        text = "".join(answer)
        c.messages.append({"role": "assistant", "content": text})
        c.held = after_answer(rendered, self.client.detokenize(generated) if generated else "", generated, final)
        c.save(self.directory)
        if final is not None:
            self.last = TurnStats(
                ttft_ms=((first or time.monotonic()) - started) * 1000.0,
                tokens_per_s=final.timings.decode_tokens_per_s,
                cached_tokens=held,
                prompt_tokens=held + len(tokens),
            )

    def stats(self) -> str:
        s = self.last
        return (
            f"time to first token {s.ttft_ms:.0f} ms, {s.tokens_per_s:.1f} tokens/s, "
            f"{s.cached_tokens} of {s.prompt_tokens} prompt tokens cached"
        )


def run(client: Client, args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    chat = Chat(client, args, out)
    c = chat.conversation
    out.write(f"kvpool chat: session {c.session}:{c.token} (/reset, /stats, /quit)\n")
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
            out.write(f"new conversation: session {chat.conversation.session}:{chat.conversation.token}\n")
        elif text == "/stats":
            out.write(chat.stats() + "\n")
        elif text:
            chat.turn(text)
    c = chat.conversation
    out.write(f"\nresume with: kvpool chat --resume {c.session}:{c.token}\n")
    return 0
