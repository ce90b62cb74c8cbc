"""A chat on one kvpool session in the model's chat format: the messages so far, rendered by the model's chat
template (chat_template.py), and only the new part of each turn computed (conversation.py). `kvpool chat` and
the voice assistant example are built on it.

The conversation is saved after every turn (with ``save_dir``) under the session's id, so ``resume="ID:TOKEN"``
picks it up again, after a daemon restart too.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool import protocol as p

from .chat_template import ChatTemplate, template_for  # needs jinja2: pip install 'kvpool[chat]'
from .client import Client, Session
from .conversation import REFUSALS, Held, after_answer, starting_with
from .errors import KvpoolError


def default_save_dir() -> Path:
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
        try:
            record = json.loads((directory / f"{session}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return cls(session, token)  # the session's context is kept; the transcript of it is not
        held = Held.load(record.get("held"))
        return cls(session, token, list(record.get("messages", [])), held)


@dataclass(frozen=True)
class Reply:
    text: str
    final: p.Final | None
    ttft_ms: float  # from sending the turn to its first text
    cached_tokens: int  # prompt tokens the session held already
    prompt_tokens: int  # the whole conversation's


class ChatSession:
    def __init__(
        self,
        client: Client,
        *,
        task: str = "default",
        system: str = "",
        chat_template: str = "auto",
        stop: list[str] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        resume: str | None = None,
        save_dir: Path | None = None,
        examples: list[dict[str, str]] | None = None,
        share_start: bool = False,
    ):
        """``examples``: messages the conversation starts with after ``system`` (few-shot turns). ``share_start``:
        open the session with ``system`` and ``examples`` rendered as its system prompt, so that every session
        starting alike shares their KV in the daemon (docs/prefix-sharing.md): the first computes them, the
        others only their own turns."""
        self.client, self.task, self.system = client, task, system
        self.examples, self.share_start = list(examples or []), share_start
        self.max_tokens, self.temperature = max_tokens, temperature
        model = client.status().model
        source, implied = template_for(chat_template, model.chat_template)
        self.template = ChatTemplate(source, model.bos_token, model.eos_token, tuple(implied))
        own = list(stop or [])
        self.stops = [*own, *(s for s in implied if s not in own)]
        self.save_dir = save_dir
        self.conversation = self._start(resume)

    @property
    def ids(self) -> str:
        return f"{self.conversation.session}:{self.conversation.token}"

    def _start(self, resume: str | None) -> Conversation:
        if resume:
            session_id, _, token = resume.partition(":")
            session = self.client.resume_session(session_id, token)
            if self.save_dir is None:
                return Conversation(session.id, session.token)
            return Conversation.load(self.save_dir, session.id, session.token)
        conversation = Conversation("", "", self._start_messages())
        self._open(conversation)
        return conversation

    def _start_messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.examples

    def _open(self, c: Conversation, rendered: str | None = None) -> None:
        """A new session for ``c``: holding its start (the system message and the examples) when the start is
        shared and begins ``rendered`` (the conversation about to be sent), else empty."""
        start = self._start_messages()
        text = self.template.render(start, add_generation_prompt=False) if self.share_start and start else ""
        if not text or (rendered is not None and starting_with(text, 0).rest(rendered) is None):
            session = self.client.open_session(self.task, system_prompt="")
            c.session, c.token, c.held, c.empty = session.id, session.token, None, True
            return
        tokens = self.client.tokenize(text, add_bos=self.template.needs_bos(text))
        session = self.client.open_session(self.task, system_prompt=tokens)
        c.session, c.token, c.empty = session.id, session.token, False
        c.held = starting_with(text, len(tokens))

    def _session(self) -> Session:
        return self.client.resume_session(self.conversation.session, self.conversation.token)

    def reset(self) -> None:
        self.close()
        self.conversation = self._start(None)

    def close(self) -> None:
        """Close the session (the conversation is gone with it)."""
        self._session().close()

    def say(self, text: str, on_text: Callable[[str], None] | None = None, **params: Any) -> Reply:
        """One turn: ``text`` from the user, the answer streamed to ``on_text``. ``params``: generate parameters
        for this turn beyond the session's own (e.g. ``json_schema=`` for an answer in JSON). A turn that fails
        (refused for its budget, say) leaves the conversation as it was, so it can be sent again."""
        c = self.conversation
        messages = [*c.messages, {"role": "user", "content": text}]
        rendered = self.template.render(messages, add_generation_prompt=True)
        session = self._session()
        rest = c.held.rest(rendered) if c.held is not None else None
        if rest is None and not c.empty:  # what the session holds is not this conversation: start it over
            session.close()
            self._open(c, rendered)
            session = self._session()
            rest = c.held.rest(rendered) if c.held is not None else None
        if c.held is not None and rest is not None:
            tokens, held = c.held.trim(self.client.tokenize(rest, add_bos=False)), c.held.tokens
        else:
            tokens, held = self.client.tokenize(rendered, add_bos=self.template.needs_bos(rendered)), 0
        started = time.monotonic()
        first: float | None = None
        answer, generated = [], []
        params = {"max_tokens": self.max_tokens, "temperature": self.temperature, "stop": self.stops, **params}
        try:
            with session.generate(tokens, after=held, **params) as stream:
                for chunk in stream:
                    generated.extend(chunk.tokens)
                    if chunk.text:
                        first = first or time.monotonic()
                        answer.append(chunk.text)
                        if on_text is not None:
                            on_text(chunk.text)
        except KvpoolError as exc:
            # A refusal (over budget, overloaded) comes before anything was applied: the turn can be sent again.
            # Anything else may have left part of it in the session, which then stands for nothing known.
            if generated or exc.cut or exc.code not in REFUSALS:
                c.held, c.empty = None, False
            raise
        except BaseException:
            c.held, c.empty = None, False
            raise
        final = stream.final
        reply_text = "".join(answer)
        c.messages = [*messages, {"role": "assistant", "content": reply_text}]
        c.empty = False
        c.held = after_answer(rendered, self.client.detokenize(generated) if generated else "", generated, final)
        if self.save_dir is not None:
            c.save(self.save_dir)
        ttft = ((first or time.monotonic()) - started) * 1000.0
        return Reply(reply_text, final, ttft, held, held + len(tokens))
