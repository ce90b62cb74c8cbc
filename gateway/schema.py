"""The OpenAI request bodies the gateway accepts, as msgspec Structs: a wrong type or value is a 400 that names
the field, before anything reaches the daemon. Fields OpenAI clients send that kvpool has no use for are
accepted and ignored; those it cannot honour yet (n > 1, tools, images, audio) are refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=1 << 20)]
Seed = Annotated[int, Meta(ge=0, le=2**32 - 1)]
Stop = str | Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=16)]


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class _Request(Struct, kw_only=True):
    """What chat and text completions share."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    prompt_cache_key: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    user: str | None = None


class ChatCompletionRequest(_Request, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str]
    max_tokens: MaxTokens | None = 16  # OpenAI's default for completions
    echo: bool = False


class Unsupported(ValueError):
    """A request asks for something kvpool does not do yet; the message names it."""


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as a chat template reads them (text only), or Unsupported."""
    if request.n not in (None, 1):
        raise Unsupported("`n` > 1 is not supported: ask for one choice per request.")
    if request.tools:
        raise Unsupported("`tools` are not supported yet: send the conversation without tools.")
    out = []
    for i, message in enumerate(request.messages):
        if message.role == "tool" or message.tool_calls:
            raise Unsupported(f"messages[{i}]: tool messages and tool calls are not supported yet.")
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise Unsupported(f"messages[{i}]: only text content is supported (no images or audio yet).")
            content = "".join(part.text or "" for part in content)
        role = "system" if message.role == "developer" else message.role
        out.append({"role": role, "content": content or ""})
    return out


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
