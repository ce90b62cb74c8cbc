"""`kvpool chat`, driven through a pseudo-terminal as a person would type, against a real daemon."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .daemon_process import DaemonProcess

WAIT_S = 30.0


class Terminal:
    """A program on a pseudo-terminal: type lines, read what it printed, with bounded waits."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.screen = ""

    def read_until(self, pattern: str) -> str:
        """Everything printed until ``pattern`` (a regex) appears; the screen is consumed up to its end."""
        deadline = time.monotonic() + WAIT_S
        while not (match := re.search(pattern, self.screen)):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{pattern!r} did not appear; the terminal shows:\n{self.screen}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.screen += os.read(self.master, 4096).decode("utf-8", errors="replace")
                except OSError:  # the program ended and closed the terminal
                    if not re.search(pattern, self.screen):
                        raise TimeoutError(f"the program ended before {pattern!r}:\n{self.screen}") from None
        shown, self.screen = self.screen[: match.end()], self.screen[match.end() :]
        return shown

    def type(self, line: str) -> str:
        """Type a line and return what the program printed until its next prompt."""
        os.write(self.master, (line + "\n").encode())
        return self.read_until(r"\n> ")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT_S)
        os.close(self.master)


def chat_command(daemon: DaemonProcess, *args: str) -> list[str]:
    cli = [sys.executable, "-m", "kvpool.client.cli", "--address", daemon.address]
    return [*cli, "chat", "--max-tokens", "8", *args]


def test_a_chat_in_the_terminal_reuses_its_turns_and_resumes_after_a_restart(
    start_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    daemon = start_daemon("--hot-slots", "2", "--context-size", "2048")
    env = {**os.environ, "XDG_STATE_HOME": str(short_tmp / "state")}
    term = Terminal(chat_command(daemon, "--system", "You are a robot."), env)
    try:
        banner = term.read_until(r"\n> ")
        first_session = re.search(r"session (\w+):(\w+)", banner)
        assert first_session
        term.type("hello there")
        stats = term.type("/stats")
        assert re.search(r"time to first token \d+ ms, [\d.]+ tokens/s, 0 of \d+ prompt tokens cached", stats)
        term.type("and again")
        cached, total = map(int, re.search(r"(\d+) of (\d+) prompt tokens cached", term.type("/stats")).groups())
        assert 0 < cached < total  # the second turn computed only its new part
        os.write(term.master, b"/quit\n")
        farewell = term.read_until(r"--resume (\w+:\w+)\s")
        resume = re.search(r"--resume (\w+:\w+)", farewell).group(1)
        assert term.proc.wait(WAIT_S) == 0
    finally:
        term.close()
    daemon.stop(signal.SIGKILL)
    daemon.start()
    term = Terminal(chat_command(daemon, "--resume", resume), env)
    try:
        assert resume in term.read_until(r"\n> ")
        term.type("one more")
        cached, total = map(int, re.search(r"(\d+) of (\d+) prompt tokens cached", term.type("/stats")).groups())
        assert cached > 0  # the conversation came back from the pool, with its transcript
        renewed = term.type("/reset")
        assert re.search(r"new conversation: session \w+", renewed) and resume.split(":")[0] not in renewed
        term.type("fresh start")
        assert re.search(r" 0 of \d+ prompt tokens cached", term.type("/stats"))
    finally:
        term.close()


def test_a_refused_turn_in_the_terminal_is_said_and_the_chat_goes_on(
    start_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """A line longer than the context is refused (CONTEXT_OVERFLOW): the chat says so and asks again, with the
    conversation as it was; it does not end on it (exit 1, the resume line unsaid)."""
    daemon = start_daemon("--hot-slots", "2", "--context-size", "2048")
    env = {**os.environ, "XDG_STATE_HOME": str(short_tmp / "state")}
    term = Terminal(chat_command(daemon), env)
    try:
        term.read_until(r"\n> ")
        term.type("hello there")
        refused = term.type("x" * 3000)  # (under the terminal's 4,096-character line, over the 2,048-token context)
        assert "refused: CONTEXT_OVERFLOW" in refused, refused
        term.type("and again")
        cached, total = map(int, re.search(r"(\d+) of (\d+) prompt tokens cached", term.type("/stats")).groups())
        assert 0 < cached < total  # the turn after the refused one continued the conversation
        os.write(term.master, b"/quit\n")
        term.read_until(r"--resume \w+:\w+\s")
        assert term.proc.wait(WAIT_S) == 0
    finally:
        term.close()


def test_a_chat_session_turn_that_was_refused_can_be_sent_again(start_daemon: Callable[..., DaemonProcess]) -> None:
    from kvpool.client.chat_session import ChatSession
    from kvpool.client.errors import Overloaded

    daemon = start_daemon("--context-size", "4096", config="[tasks.default]\nmax_queue = 1\n")
    with daemon.client() as client, daemon.client() as other:
        chat = ChatSession(client, max_tokens=8)
        chat.say("hello")
        busy = other.open_session().generate("go on", max_tokens=1800)
        next(busy)  # the task's one place is taken
        with pytest.raises(Overloaded):
            chat.say("again")
        busy.close()
        reply = chat.say("again")
        assert reply.cached_tokens > 0 and reply.final is not None  # the conversation went on where it was
        assert [m["role"] for m in chat.conversation.messages] == ["user", "assistant", "user", "assistant"]
        chat.close()


def test_json_answers_on_a_transcript_continue_their_session(daemon: DaemonProcess) -> None:
    """A JSON-constrained answer starts with `{` right after the transcript's `Assistant:`; the template renders
    it back as `Assistant: {...}`. The next turn still computes only its new part."""
    from kvpool.client.chat_session import ChatSession

    schema = {"type": "object", "properties": {"say": {"type": "string", "maxLength": 12}}, "required": ["say"]}
    with daemon.client() as client:
        chat = ChatSession(client, system="Answer in JSON.", chat_template="transcript", max_tokens=40)
        first = chat.say("hello", json_schema=schema)
        assert first.text.startswith("{")  # no space: what the transcript renders differs from what was generated
        second = chat.say("again", json_schema=schema)
        assert second.final is not None and first.final is not None
        assert second.cached_tokens == first.final.usage.context_tokens > 0
        chat.close()


def test_conversations_that_start_alike_share_their_start(daemon: DaemonProcess) -> None:
    """`share_start`: the system message and the examples are the session's system prompt, computed by the first
    conversation and shared by the next; each conversation's first turn computes only the question."""
    from kvpool.client.chat_session import ChatSession

    examples = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "A small robot."}]
    with daemon.client() as client:
        before = client.status().prefixes
        first = ChatSession(client, system="Be brief. " * 8, examples=examples, share_start=True, max_tokens=4)
        one = first.say("hello")
        second = ChatSession(client, system="Be brief. " * 8, examples=examples, share_start=True, max_tokens=4)
        two = second.say("hello again")
        after = client.status().prefixes
        assert one.cached_tokens == two.cached_tokens > 30  # the start, held before the first turn
        assert after.hits - before.hits == 1 and after.tokens_saved - before.tokens_saved == two.cached_tokens
        third = second.say("and again")  # the conversation goes on from its first turn
        assert two.final is not None and third.cached_tokens == two.final.usage.context_tokens
        first.close()
        second.close()
