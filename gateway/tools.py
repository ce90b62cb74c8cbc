"""Tool calls for chat templates without a tool syntax (the tiny test model's, Gemma 3's): kvpool's envelope
format, modelled on llama.cpp's former "generic" one (docs/gateway.md, "Tool calls").

The model answers exactly one JSON object: ``{"tool_calls": [{"name": NAME, "arguments": {...}}, ...]}`` or
``{"response": ...}`` (a string, or what response_format's schema allows). One JSON Schema for that envelope goes
to the daemon as its json_schema, so each call's arguments follow its tool's schema from the first token: the
model picks, the grammar guarantees the syntax.

- ``Toolbox``: the tools offered (a short instruction in the system message) and the envelope's schema for a
  tool_choice.
- ``EnvelopeParser``: reads the envelope as its text arrives (a streamed answer emits a call's name first, then
  its arguments piece by piece, exactly as generated) or all at once. Hand-written: partial-JSON libraries (jiter's
  partial mode) give values, and a call's arguments must be the very text generated, for the client and for
  rendering the call again.
- ``AnswerMemory``: the raw text behind an answer, so that an assistant message a client sends back renders as the
  very text the session holds, and the conversation's KV is reused.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .http_errors import HttpError
from .schema import ChatCompletionRequest, NamedToolChoice

INSTRUCTION = (
    "You can call tools. To call them, answer only with JSON: "
    '{"tool_calls": [{"name": "<tool name>", "arguments": {<its parameters>}}]}. '
    'To answer without a tool, answer only with JSON: {"response": <your answer>}. Tools:'
)
MEMORY_ENTRIES = 2048  # answers remembered (each at most one answer's text)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Toolbox:
    """The tools a request offers and what the answer may be (tool_choice, parallel_tool_calls, response_format)."""

    tools: tuple[Tool, ...]
    choice: str  # auto, required, or the one tool's name that must be called
    parallel: bool
    response: dict[str, Any] | None  # the response branch's schema (None: a string)

    @classmethod
    def of(cls, body: ChatCompletionRequest, response: dict[str, Any] | None) -> Toolbox | None:
        """The request's toolbox; None when it offers no tools (none, or tool_choice "none")."""
        if not body.tools or body.tool_choice == "none":
            return None
        tools, seen = [], set()
        for i, tool in enumerate(body.tools):
            f = tool.function
            if f.name in seen:
                raise HttpError(
                    400, f"Two tools are named {f.name!r}.", "invalid_value", param=f"tools[{i}].function.name"
                )
            seen.add(f.name)
            parameters = f.parameters if f.parameters else {"type": "object", "properties": {}}
            tools.append(Tool(f.name, f.description or "", parameters))
        choice = body.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in seen:
                raise HttpError(
                    400,
                    f"`tool_choice` names {choice.function.name!r}, which is not among `tools`.",
                    "invalid_value",
                    param="tool_choice",
                )
            choice = choice.function.name
        parallel = body.parallel_tool_calls is not False  # OpenAI's default: true
        return cls(tuple(tools), choice, parallel, response)

    def offer(self) -> str:
        """The text added to the system message: short and concrete, for a small model. It does not depend on
        tool_choice (the grammar forces a call), so a conversation's earlier turns render alike and keep their KV."""
        lines = [INSTRUCTION]
        for tool in self.tools:
            described = f" {tool.description.strip()}" if tool.description.strip() else ""
            lines.append(f"- {tool.name}:{described} Arguments: {json.dumps(tool.parameters, separators=(', ', ': '))}")
        return "\n".join(lines)

    def schema(self) -> tuple[dict[str, Any], list[tuple[str, str]]]:
        """The envelope's JSON Schema for this request's tool_choice, and where each tool's parameters (and the
        response's schema) stand in it: (the daemon's path to it, the request field), so that a refusal of a
        schema names the field the client wrote.

        Each tool's parameters (and the response's schema) sit in the envelope's ``$defs`` under a name of their
        own, their local references (``#/$defs/...``, as pydantic writes them) rewritten to point there: inside the
        envelope, ``#`` is the envelope, not the tool."""
        chosen = [
            (i, t) for i, t in enumerate(self.tools) if self.choice in ("auto", "required") or t.name == self.choice
        ]
        defs = {f"tool{i}": relocate(t.parameters, f"#/$defs/tool{i}") for i, t in chosen}
        locations = [(f"$.$defs.tool{i}", f"tools[{i}].function.parameters") for i, _ in chosen]
        calls_of = [call_schema(t.name, f"#/$defs/tool{i}") for i, t in chosen]
        calls: dict[str, Any] = {
            "type": "array",
            "items": {"anyOf": calls_of} if len(calls_of) > 1 else calls_of[0],
            "minItems": 1,
        }
        if not self.parallel:
            calls["maxItems"] = 1
        calling = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
        if self.choice != "auto":
            return {**calling, "$defs": defs}, locations
        if self.response is not None:
            defs["response"] = relocate(self.response, "#/$defs/response")
            locations.append(("$.$defs.response", "response_format.json_schema.schema"))
        answer = {"$ref": "#/$defs/response"} if self.response is not None else {"type": "string"}
        responding = {"type": "object", "properties": {"response": answer}, "required": ["response"]}
        return {"anyOf": [calling, responding], "$defs": defs}, locations


def call_schema(name: str, arguments_ref: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {"$ref": arguments_ref}},
        "required": ["name", "arguments"],
    }


def relocate(schema: Any, base: str) -> Any:
    """A copy of ``schema`` whose local references (``#...``) point into it where it now stands, at ``base``."""
    if isinstance(schema, list):
        return [relocate(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: relocate(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------- reading the envelope


@dataclass
class Call:
    name: str = ""
    named: bool = False  # the name's string is complete
    arguments: str = ""  # the arguments' JSON text as generated so far
    id: str = field(default_factory=call_id)


class _Frame:
    __slots__ = ("expect", "index", "key", "kind")

    def __init__(self, kind: str):
        self.kind = kind  # "{" or "["
        self.key: str | None = None  # the key whose value comes (objects)
        self.index = 0  # the position of the value that comes (arrays)
        self.expect = "key" if kind == "{" else "value"


HEX = set("0123456789abcdefABCDEF")
ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class EnvelopeParser:
    """Reads the envelope's JSON text as it arrives, one character at a time (a grammar-constrained answer is
    valid JSON up to where it stops). What it has found so far: ``calls`` (each call's name once its string is
    complete, and its arguments' text exactly as generated), ``response`` (the response string decoded, or a
    structured response's JSON text) and ``responding``."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.response = ""
        self.responding = False
        self.whole = False  # the envelope's object has closed (an answer can stop before: a limit, a stop string)
        self._stack: list[_Frame] = []
        self._string: list[str] | None = None  # the characters of the string being read
        self._string_is_key = False
        self._escape: str | None = None  # None, "" after a backslash, or the hex digits of a \u escape so far
        self._high_surrogate = ""
        self._scalar = False  # inside a number, true, false or null
        self._capture: tuple[str, int] | None = None  # ("arguments", call index) or ("response", -1)
        self._capture_depth = 0  # the stack depth the captured value started at
        self._decode_response = False  # the response is a string: its decoded characters are the response

    def feed(self, text: str) -> None:
        for char in text:
            self._char(char)

    # -- the value being read, by where it stands in the envelope

    def _path(self) -> tuple[object, ...]:
        return tuple(f.key if f.kind == "{" else f.index for f in self._stack)

    def _value_starts(self, char: str) -> None:
        path = self._path()
        if len(path) == 3 and path[0] == "tool_calls" and path[2] == "arguments" and isinstance(path[1], int):
            self._call(path[1])
            self._capture, self._capture_depth = ("arguments", path[1]), len(self._stack)
        elif path == ("response",):
            self.responding = True
            if char == '"':
                self._decode_response = True
            else:
                self._capture, self._capture_depth = ("response", -1), len(self._stack)
        elif len(path) == 2 and path[0] == "tool_calls" and isinstance(path[1], int):
            self._call(path[1])

    def _call(self, index: int) -> Call:
        while len(self.calls) <= index:
            self.calls.append(Call())
        return self.calls[index]

    def _emit(self, char: str) -> None:
        if self._capture is None:
            return
        kind, index = self._capture
        if kind == "arguments":
            self.calls[index].arguments += char
        else:
            self.response += char

    def _value_ends(self) -> None:
        """The value at the current position is complete (its last character emitted already)."""
        if self._capture is not None and len(self._stack) == self._capture_depth:
            self._capture = None
        frame = self._stack[-1] if self._stack else None
        if frame is not None:
            frame.expect = "comma"

    # -- JSON, one character at a time

    def _char(self, char: str) -> None:
        if self._string is not None:
            self._emit(char)
            self._string_char(char)
            return
        if self._scalar:
            if char in ",}] \t\r\n":
                self._scalar = False
                self._value_ends()
            else:
                self._emit(char)
                return
        if char in " \t\r\n":
            self._emit(char)  # inside a captured value: as generated
            return
        frame = self._stack[-1] if self._stack else None
        if char in "{[":
            self._value_starts(char)
            self._emit(char)
            self._stack.append(_Frame(char))
        elif char in "}]":
            if frame is not None:
                self._stack.pop()
                self._emit(char)
                self._value_ends()
                self.whole = not self._stack
        elif char == ":":
            self._emit(char)
            if frame is not None:
                frame.expect = "value"
        elif char == ",":
            self._emit(char)
            if frame is not None:
                if frame.kind == "[":
                    frame.index += 1
                frame.expect = "key" if frame.kind == "{" else "value"
        elif char == '"':
            self._string_is_key = frame is not None and frame.kind == "{" and frame.expect == "key"
            if not self._string_is_key:
                self._value_starts(char)
            self._emit(char)
            self._string = []
        else:
            self._value_starts(char)
            self._scalar = True
            self._emit(char)

    def _string_char(self, char: str) -> None:
        assert self._string is not None
        if self._escape is not None:
            if self._escape == "" and char != "u":
                self._string_text(ESCAPES.get(char, char))
                self._escape = None
            elif self._escape == "":
                self._escape = "u"
            else:
                self._escape += char
                if len(self._escape) == 5:
                    digits, self._escape = self._escape[1:], None
                    self._string_text(chr(int(digits, 16)) if all(c in HEX for c in digits) else "\ufffd")
            return
        if char == "\\":
            self._escape = ""
        elif char == '"':
            text, self._string = "".join(self._string), None
            if self._string_is_key:
                frame = self._stack[-1]
                frame.key, frame.expect = text, "colon"
                return
            path = self._path()
            if len(path) == 3 and path[0] == "tool_calls" and path[2] == "name" and isinstance(path[1], int):
                call = self._call(path[1])
                call.name, call.named = text, True
            self._decode_response = False
            self._value_ends()
        else:
            self._string_text(char)

    def _string_text(self, text: str) -> None:
        """A decoded character of the current string; a surrogate pair's halves (\\ud83d\\ude00) become one."""
        assert self._string is not None
        if self._high_surrogate:
            pair, self._high_surrogate = self._high_surrogate + text, ""
            text = pair.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        elif "\ud800" <= text <= "\udbff":
            self._high_surrogate = text
            return
        elif "\udc00" <= text <= "\udfff":
            text = "\ufffd"
        self._string.append(text)
        if self._decode_response and not self._string_is_key:
            self.response += text


# ---------------------------------------------------------------------- the raw text behind an answer


def envelope_text(calls: list[tuple[str, str]]) -> str:
    """An assistant message's calls as the envelope, when the gateway does not remember the raw text (a
    conversation from elsewhere): the session is then recomputed, which is correct, only slower."""
    rendered = []
    for name, arguments in calls:
        try:
            value: Any = json.loads(arguments)
        except ValueError:
            value = arguments
        rendered.append({"name": name, "arguments": value})
    return json.dumps({"tool_calls": rendered}, ensure_ascii=False)


def canonical_json(text: str) -> str:
    """One spelling of a JSON text (the text itself when it is not JSON)."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return text


class AnswerMemory:
    """A bounded LRU from an assistant message, as a client sends it back (its content and each call's name and
    arguments), to the raw text the model generated for it. The conversation machinery reuses a session only when
    the new rendering starts with exactly the text the session holds, so an answer that was reshaped (a call
    envelope into tool_calls, a response string out of its JSON) must render as its raw text again."""

    def __init__(self, entries: int = MEMORY_ENTRIES):
        self.entries = entries
        self._raw: OrderedDict[str, str] = OrderedDict()

    @staticmethod
    def key(content: str | None, calls: list[tuple[str, str]]) -> str:
        # Arguments by their JSON value, not their spelling: a client may send them back re-serialised (Anthropic's
        # tool_use blocks carry an object, which the gateway writes out again).
        parts = json.dumps([content or "", [(name, canonical_json(arguments)) for name, arguments in calls]])
        return hashlib.sha256(parts.encode("utf-8", "surrogatepass")).hexdigest()

    def remember(self, content: str | None, calls: list[tuple[str, str]], raw: str) -> None:
        if raw == (content or "") and not calls:
            return  # the answer renders as itself
        key = self.key(content, calls)
        self._raw[key] = raw
        self._raw.move_to_end(key)
        while len(self._raw) > self.entries:
            self._raw.popitem(last=False)

    def recall(self, content: str | None, calls: list[tuple[str, str]]) -> str | None:
        key = self.key(content, calls)
        raw = self._raw.get(key)
        if raw is not None:
            self._raw.move_to_end(key)
        return raw

    def __len__(self) -> int:
        return len(self._raw)
