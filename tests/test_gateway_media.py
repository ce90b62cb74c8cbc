"""Images and audio through the gateway with the real openai and anthropic clients, against a kvpoold with the tiny
projector: a conversation about a picture continues with reuse (cached_tokens counts the picture's cells), URLs are
read only as the flags allow."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import anthropic
import openai
import pytest

from .daemon_process import DaemonProcess
from .gateway_process import GatewayProcess, client_of
from .test_media import png, tone, wav

GREEDY = {"temperature": 0.0}


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture
def media_gateway(
    start_daemon: Callable[..., DaemonProcess],
    start_gateway: Callable[..., GatewayProcess],
    tiny_mmproj: dict[str, Path],
) -> Callable[..., GatewayProcess]:
    daemon = start_daemon("--mmproj", str(tiny_mmproj["vision+audio"]), "--context-size", "2048", name="md")

    def start(*args: str) -> GatewayProcess:
        return start_gateway(daemon.address, *args)

    return start


def test_a_conversation_about_a_picture_continues_with_its_cells_reused(
    media_gateway: Callable[..., GatewayProcess],
) -> None:
    gateway = media_gateway()
    client = client_of(gateway)
    picture = data_url(png(24, 16))
    history: list[dict] = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(picture)]}
    ]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=6, **GREEDY)
    assert first.usage.prompt_tokens > 16  # the picture's 16 cells count in the prompt
    assert (first.usage.prompt_tokens_details.cached_tokens or 0) == 0
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the colours?"},
    ]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=6, **GREEDY)
    # The first turn, its picture included, was not computed again.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    other = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(data_url(png(16, 24)))]}
    ]
    changed = client.chat.completions.create(model="tiny", messages=other, max_tokens=6, **GREEDY)
    assert (changed.usage.prompt_tokens_details.cached_tokens or 0) < first.usage.prompt_tokens  # another picture
    streamed = client.chat.completions.create(
        model="tiny", messages=history[:1], max_tokens=6, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == first.usage.prompt_tokens


def test_audio_and_anthropic_images(media_gateway: Callable[..., GatewayProcess]) -> None:
    gateway = media_gateway()
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(tone())).decode(), "format": "wav"}}
    heard = client_of(gateway).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "Hear:"}, audio]}], max_tokens=4
    )
    assert heard.usage.prompt_tokens > 25  # one 30 s chunk: 25 cells
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="none", max_retries=0)
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(8, 8)).decode()},
    }
    seen = claude.messages.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": [{"type": "text", "text": "See:"}, block]}]
    )
    assert seen.usage.input_tokens > 16 and seen.stop_reason == "max_tokens"


def test_urls_and_files_are_read_only_as_the_flags_allow(
    media_gateway: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "kitchen.png").write_bytes(png(8, 8))
    plain = client_of(media_gateway())

    def ask(client: openai.OpenAI, url: str) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [image_part(url)]}], max_tokens=2
        )

    for url, said in (
        ("http://127.0.0.1:9/cat.png", "--fetch-media-urls"),
        (str(folder / "kitchen.png"), "--media-dir"),
        ("ftp://127.0.0.1/cat.png", "ftp"),
        ("data:image/png;base64,@@@", "base64"),
        ("data:image/png;base64,", "the file is empty"),  # (it named the daemon's frame area)
        # A declared type that contradicts the bytes is refused, not passed over.
        (data_url(png(4, 4), "audio/wav"), "the image is declared audio/wav; an image part carries an image"),
        (data_url(png(4, 4), "image/gif"), "its declared type is image/gif, but the bytes are a PNG file"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(plain, url)
        assert said in refused.value.body["message"], refused.value.body  # type: ignore[index]
    allowed = client_of(media_gateway("--media-dir", str(folder)))
    assert ask(allowed, "kitchen.png").usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as refused:
        ask(allowed, "../kitchen.png")
    assert "no file" in refused.value.body["message"]  # type: ignore[index]


def test_a_refused_medium_is_named_as_the_request_names_it(media_gateway: Callable[..., GatewayProcess]) -> None:
    """The daemon names a medium by its index among the parts it was sent (`parts[3]`), which no client sent: the
    gateway names the request's field. An image in an assistant message is refused for what it is."""
    client = client_of(media_gateway())
    good, bad = data_url(png(8, 8)), data_url(png(8, 8)[:30])  # (a PNG cut inside its pixels: no decoder reads it)
    content = [{"type": "text", "text": "two pictures: "}, image_part(good), {"type": "text", "text": " and "}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [*content, image_part(bad)]}], max_tokens=2
        )
    message = refused.value.body["message"]  # type: ignore[index]
    assert "`messages[0].content[3].image_url`" in message and "parts[" not in message, message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": "look"},
                {"role": "assistant", "content": [image_part(good)]},
                {"role": "user", "content": "and?"},
            ],
            max_tokens=2,
        )
    message = refused.value.body["message"]  # type: ignore[index]
    assert "only user and system messages carry image_url parts" in message, message
    mislabelled = {"data": base64.b64encode(wav(tone())).decode(), "format": "mp3"}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": mislabelled}]}],
            max_tokens=2,
        )
    assert "input_audio.format is mp3, but the bytes are a WAV file" in refused.value.body["message"]  # type: ignore[index]
